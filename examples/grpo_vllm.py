"""GRPO against a real vLLM server, pushing the trainer's weights with asyncwt every step.

The policy is a causal LM served by vLLM (the OpenAI server, with asyncwt's plugin and
`--weight-transfer-config '{"backend": "asyncwt_tcp"}'`) and trained here, on the CPU,
by Hugging Face `transformers`. Each step:

1. generate: 16 prompts x 8 samples x 8 tokens from vLLM (`/v1/completions`,
   temperature 1); this starts while the previous step's push is still landing, so a
   batch may come from the weights one step behind (off-policy by at most one step);
2. reward: the share of a target token among each sample's 8 tokens;
3. train: GRPO, one Adam step (lr 3e-3) on the group-normalised advantages
   (reward minus the mean of the prompt's 8 samples, over their spread);
4. push: `engine.send_weights(weight_version=f"step-{k}")`, a background task the
   next step's generation overlaps.

It prints one JSON line per step: `step`, `reward` (the batch's mean), the seconds of
each phase (`generate_s`, `train_s`, `push_s`: the wait for the previous push, and
`push_wall_s`: its whole round), `push_bytes` and `version`.

Run it, starting a server on a tiny Llama it writes itself (needs vLLM's CPU build,
see docs/how-to/vllm.md):

    python examples/grpo_vllm.py --steps 80

or against a running server of the model in `--model`:

    python examples/grpo_vllm.py --url http://127.0.0.1:8000 --model MODEL_DIR

`--chart PATH` draws the reward curve (needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import torch

from asyncwt import HttpClient, ModuleSource, RoundStats, TcpTrainerInitInfo, trainer_init

PROMPTS = 16
SAMPLES = 8
TOKENS = 8
PROMPT_TOKENS = 8
TARGET = 42
"""The token whose share in a completion is its reward."""


def write_tiny_llama(path: Path, vocab_size: int = 256) -> None:
    """A random 2-layer Llama with a word-level tokenizer (`t0` ... `tN`): a model
    vLLM can serve on the CPU, written without any download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="t0", eos_token="t1")
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@contextlib.contextmanager
def vllm_server(model: Path, log: Path, timeout: float = 300.0) -> Iterator[str]:
    """Serve `model` with vLLM's OpenAI server and asyncwt's tcp backend; its URL."""
    port = _free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", "128", "--seed", "0",
        "--weight-transfer-config", json.dumps({"backend": "asyncwt_tcp"}),
    ]  # fmt: skip
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


async def generate(
    session: aiohttp.ClientSession, url: str, model: str, prompts: list[list[int]]
) -> list[list[int]]:
    """`SAMPLES` sampled completions of each prompt, grouped by prompt (token ids)."""
    body = {
        "model": model,
        "prompt": prompts,
        "n": SAMPLES,
        "max_tokens": TOKENS,
        "temperature": 1.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"vLLM answered {response.status}: {await response.text()}")
        choices = (await response.json())["choices"]
    completions = [list(c["token_ids"]) for c in sorted(choices, key=lambda c: c["index"])]
    if len(completions) != len(prompts) * SAMPLES:
        raise RuntimeError(f"expected {len(prompts) * SAMPLES} completions, got {len(completions)}")
    return completions


def grpo_step(
    policy: Any,
    optimizer: torch.optim.Optimizer,
    prompts: list[list[int]],
    completions: list[list[int]],
    rewards: torch.Tensor,
) -> None:
    """One GRPO update: group-normalised advantages times the completions' log-probs."""
    groups = rewards.view(len(prompts), SAMPLES)
    advantages = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    sequences = torch.tensor(
        [prompts[i // SAMPLES] + completion for i, completion in enumerate(completions)]
    )
    logits = policy(input_ids=sequences).logits[:, PROMPT_TOKENS - 1 : -1]
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    taken = log_probs.gather(-1, sequences[:, PROMPT_TOKENS:, None]).squeeze(-1).sum(-1)
    loss = -(advantages.flatten() * taken).mean() / TOKENS
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


async def train(url: str, model_dir: Path, steps: int, seed: int) -> list[dict[str, Any]]:
    """The GRPO loop against the server at `url`, serving `model_dir`; one record a step."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    vocab = policy.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    records: list[dict[str, Any]] = []
    # A fresh connection per request: a training step may outlast the server's
    # keep-alive (uvicorn closes idle connections after 5 s), and reusing one it just
    # closed fails the request.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session, HttpClient(url) as client:
        engine = await trainer_init(
            TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(policy)
        )
        async with engine:
            await engine.send_weights(weight_version="step-0")  # serve the trainer's copy
            push: asyncio.Task[RoundStats] | None = None
            for step in range(1, steps + 1):
                prompts = torch.randint(2, vocab, (PROMPTS, PROMPT_TOKENS), generator=generator)
                t0 = time.perf_counter()
                completions = await generate(session, url, str(model_dir), prompts.tolist())
                t1 = time.perf_counter()
                stats = await push if push is not None else None  # landed meanwhile
                t2 = time.perf_counter()
                rewards = torch.tensor([c.count(TARGET) / TOKENS for c in completions])
                grpo_step(policy, optimizer, prompts.tolist(), completions, rewards)
                t3 = time.perf_counter()
                push = asyncio.ensure_future(engine.send_weights(weight_version=f"step-{step}"))
                record = {
                    "step": step,
                    "reward": round(float(rewards.mean()), 4),
                    "generate_s": round(t1 - t0, 4),
                    "push_s": round(t2 - t1, 4),
                    "train_s": round(t3 - t2, 4),
                    "push_wall_s": round(stats.wall_s, 4) if stats else None,
                    "push_bytes": stats.bytes if stats else None,
                    "version": stats.weight_version if stats else "step-0",
                }
                print(json.dumps(record), flush=True)
                records.append(record)
            if push is not None:
                await push
    return records


def draw(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """The reward curve, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot([r["step"] for r in records], [r["reward"] for r in records], marker=".")
    axes.set_xlabel("step (one asyncwt push each)")
    axes.set_ylabel("mean reward")
    axes.set_ylim(0, 1.05)
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", help="a running vLLM server (else one is started)")
    parser.add_argument("--model", type=Path, help="the model the server serves (a HF dir)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chart", type=Path, help="write the reward curve to this PNG")
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        model = args.model
        if model is None:
            if args.url:
                parser.error("--url needs --model (the model that server serves)")
            model = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny-llama"
            write_tiny_llama(model)
        url = args.url or stack.enter_context(vllm_server(model, model.parent / "vllm.log"))
        records = asyncio.run(train(url, model, args.steps, args.seed))
    if args.chart:
        draw(records, args.chart, f"GRPO on vLLM, asyncwt push every step ({args.steps} steps)")


if __name__ == "__main__":
    main()
