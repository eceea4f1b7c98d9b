"""The shared backend suite: a trainer in this process, `asyncwt worker` servers in others.

Every case runs against every CPU backend (tcp, shm, torch_dist), so a new transport
gets the whole suite by adding its name to `BACKENDS`. Every round is checked
bit-exact through the worker's `/weights_status` checksum.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import _dist
import _e2e_ranks
import _models
import anyio
import pytest
import torch

from asyncwt import (
    ControlPlaneError,
    HttpClient,
    ModuleSource,
    ParamMeta,
    ShmTrainerInitInfo,
    SourceMismatchError,
    TcpTrainerInitInfo,
    TorchDistTrainerInitInfo,
    TrainerInitInfo,
    TransferError,
    WeightSource,
    model_checksum,
    trainer_init,
)
from asyncwt._launch import start_worker, stop_worker, worker_process

TESTS = Path(__file__).resolve().parent
uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])


def worker_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


BACKENDS = ["tcp", "shm", "torch_dist"]
INFO_CLASSES: dict[str, type[TrainerInitInfo]] = {
    "tcp": TcpTrainerInitInfo,
    "shm": ShmTrainerInitInfo,
    "torch_dist": TorchDistTrainerInitInfo,
}


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.param
    yield name
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("asyncwt_")], "shm leftovers"


def info_for(backend: str, workers: int = 1, **kwargs: Any) -> TrainerInitInfo:
    kwargs.setdefault("bucket_bytes", _models.BUCKET_BYTES)
    if backend == "torch_dist":
        kwargs["num_workers"] = workers
    return INFO_CLASSES[backend](rank=0, **kwargs)


@pytest.fixture(scope="module")
def mixed_worker(backend: str) -> Iterator[str]:
    with worker_process("_models:mixed", "--backend", backend, env=worker_env()) as url:
        yield url


@pytest.fixture(scope="module")
def second_mixed_worker(backend: str) -> Iterator[str]:
    with worker_process("_models:mixed", "--backend", backend, env=worker_env()) as url:
        yield url


@pytest.fixture
def info(backend: str) -> Callable[..., TrainerInitInfo]:
    """`info(**kwargs)`: trainer init info of the backend under test, for one worker."""
    return functools.partial(info_for, backend)


async def assert_worker_has(client: HttpClient, model: torch.nn.Module, version: str) -> None:
    expected = model_checksum(model)
    for status in await client.weights_status():
        assert (status["weight_version"], status["checksum"]) == (version, expected)


async def push_rounds(
    client: HttpClient, model: torch.nn.Module, rounds: int, info: TrainerInitInfo
) -> None:
    engine = await trainer_init(info, client=client, source=ModuleSource(model))
    async with engine:
        for r in range(1, rounds + 1):
            _models.randomize(model, seed=r)
            stats = await engine.send_weights(weight_version=f"v{r}")
            assert stats.bytes == sum(p.numel() * p.element_size() for p in model.parameters())
            assert stats.buckets == len(engine.plan.buckets)
            assert stats.workers == len(client.base_urls)
            await assert_worker_has(client, model, f"v{r}")


@pytest.mark.asyncio
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "packed"])
async def test_mixed_dtypes_arrive_bit_exact_every_round(
    mixed_worker: str, info: Callable[..., TrainerInitInfo], zero_copy: bool
) -> None:
    model = _models.mixed()
    assert not model.noncontig.is_contiguous()
    assert model.big.numel() * 4 > _models.BUCKET_BYTES
    async with HttpClient(mixed_worker) as client:
        await push_rounds(client, model, rounds=3, info=info(zero_copy=zero_copy))


@uvloop_only
async def test_background_copy_path_is_bit_exact(backend: str) -> None:
    """With a transform every parameter goes through the applier (and chunk reassembly)."""
    args = ("--backend", backend, "--transform", "_models:identity_transform", "--apply-threads", "3")
    with worker_process("_models:mixed", *args, env=worker_env()) as url:
        async with HttpClient(url) as client:
            await push_rounds(client, _models.mixed(), rounds=2, info=info_for(backend))


@uvloop_only
async def test_five_thousand_tiny_tensors(backend: str) -> None:
    with worker_process("_models:many_tiny", "--backend", backend, env=worker_env()) as url:
        async with HttpClient(url) as client:
            model = _models.many_tiny()
            info = info_for(backend, bucket_bytes=16 << 10)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                assert len(engine.plan.buckets) > 3
                for r in (1, 2):
                    _models.randomize(model, seed=r)
                    await engine.send_weights(weight_version=f"v{r}")
                    await assert_worker_has(client, model, f"v{r}")


@uvloop_only
async def test_two_workers_receive_every_round(
    backend: str, mixed_worker: str, second_mixed_worker: str
) -> None:
    async with HttpClient([mixed_worker, second_mixed_worker]) as client:
        await push_rounds(client, _models.mixed(), rounds=2, info=info_for(backend, workers=2))


def test_two_trainer_ranks_push_an_fsdp2_model(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with worker_process("_models:dtensor_mlp", "--backend", backend, env=worker_env()) as url:
        monkeypatch.setenv("ASYNCWT_TEST_WORKER_URL", url)
        monkeypatch.setenv("ASYNCWT_TEST_BACKEND", backend)
        monkeypatch.setenv("PYTHONPATH", str(TESTS))
        rank0, rank1 = _dist.run_ranks(_e2e_ranks.fsdp_push, 2, tmp_path, timeout_s=90)
    full_bytes = sum(p.numel() * 4 for p in _models.dtensor_mlp().parameters())
    for r, (mine, theirs) in enumerate(zip(rank0["rounds"], rank1["rounds"]), start=1):
        assert mine["checksum"] == theirs["checksum"]
        assert (mine["bytes"], theirs["bytes"]) == (full_bytes, 0)
        assert mine["status"]["weight_version"] == f"fsdp-{r}"
        assert mine["status"]["checksum"] == mine["checksum"]


class RecordingClient(HttpClient):
    """Notes, right after `update_weights` and `finish_weight_update` return, what `probe` says."""

    def __init__(self, url: str, probe: Callable[[], bool]) -> None:
        super().__init__(url)
        self.probe = probe
        self.seen: list[tuple[str, bool]] = []

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await super().update_weights(update_info)
        self.seen.append(("update", self.probe()))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await super().finish_weight_update(weight_version)
        self.seen.append(("finish", self.probe()))


@uvloop_only
async def test_update_returns_before_slow_transform_and_finish_waits(
    backend: str, info: Callable[..., TrainerInitInfo], tmp_path: Path
) -> None:
    marker = tmp_path / "transformed"
    env = worker_env(ASYNCWT_TEST_MARKER=str(marker))
    args = ("--backend", backend, "--transform", "_models:slow_transform")
    with worker_process("_models:mixed", *args, env=env) as url:
        async with RecordingClient(url, marker.exists) as client:
            model = _models.mixed()
            _models.randomize(model, seed=5)
            engine = await trainer_init(info(), client=client, source=ModuleSource(model))
            async with engine:
                await engine.send_weights(weight_version="slow")
            assert client.seen == [("update", False), ("finish", True)]
            await assert_worker_has(client, model, "slow")


@uvloop_only
async def test_failing_transform_surfaces_at_finish_and_version_stays(
    backend: str, info: Callable[..., TrainerInitInfo], tmp_path: Path
) -> None:
    flag = tmp_path / "fail"
    env = worker_env(ASYNCWT_TEST_FAIL=str(flag))
    args = ("--backend", backend, "--transform", "_models:failing_transform")
    with worker_process("_models:mixed", *args, env=env) as url:
        async with HttpClient(url) as client:
            model = _models.mixed()
            engine = await trainer_init(info(), client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=1)
                await engine.send_weights(weight_version="good")
                flag.touch()
                _models.randomize(model, seed=2)
                with pytest.raises(
                    ControlPlaneError,
                    match=r"^POST /finish_weight_update to http://127\.0\.0\.1:\d+ failed with HTTP 500: "
                    r"ApplyError: round 2, bucket \d+: applying parameter 'w16' failed: "
                    r"RuntimeError: quantisation of w16 failed on purpose$",
                ):
                    await engine.send_weights(weight_version="bad")
                (status,) = await client.weights_status()
                assert status["weight_version"] == "good"
                flag.unlink()
                _models.randomize(model, seed=3)
                await engine.send_weights(weight_version="fixed")
                await assert_worker_has(client, model, "fixed")


@uvloop_only
async def test_plan_digest_mismatch_fails_before_any_data_moves(
    mixed_worker: str, info: Callable[..., TrainerInitInfo]
) -> None:
    async with HttpClient(mixed_worker) as client:
        model = _models.mixed()
        engine = await trainer_init(info(), client=client, source=ModuleSource(model))
        async with engine:
            with pytest.raises(
                ControlPlaneError,
                match=r"HTTP 500: PlanMismatchError: round 1000: transfer plan digest 0{16}… does not "
                r"match this side's [0-9a-f]{16}…; both ends must use the same metadata",
            ):
                await client.update_weights({"round_id": 1000, "plan_digest": "0" * 64})
            # Nothing was read from the data connection: the next round works.
            _models.randomize(model, seed=9)
            await engine.send_weights(weight_version="after-mismatch")
            await assert_worker_has(client, model, "after-mismatch")


@uvloop_only
async def test_worker_model_that_lacks_a_parameter_fails_init(
    mixed_worker: str, info: Callable[..., TrainerInitInfo]
) -> None:
    async with HttpClient(mixed_worker) as client:
        with pytest.raises(ControlPlaneError, match=r"the worker's model has no parameter '0'"):
            await trainer_init(info(), client=client, source=ModuleSource(_models.many_tiny()))


class FaultySource(WeightSource):
    """`ModuleSource` whose iteration can be bent to break the contract."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = ModuleSource(model)
        self.fault: Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]] | None = None
        self.delay = 0.0

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        pairs = list(self.inner.iter_full())
        if self.fault is not None:
            pairs = self.fault(pairs)
        for pair in pairs:
            if self.delay:
                import time

                time.sleep(self.delay)
            yield pair


FAULTS = [
    pytest.param(
        lambda p: [p[1], p[0], *p[2:]],
        r"^source yielded 'w16' at index 0, expected 'w32' \(parameters must come in metadata order\)$",
        id="wrong-order",
    ),
    pytest.param(
        lambda p: [(p[0][0], p[0][1].double()), *p[1:]],
        r"^parameter 'w32' \(index 0\): dtype should be torch\.float32, got torch\.float64$",
        id="wrong-dtype",
    ),
    pytest.param(
        lambda p: [(p[0][0], p[0][1].reshape(32, 64)), *p[1:]],
        r"^parameter 'w32' \(index 0\): shape should be \(64, 32\), got \(32, 64\)$",
        id="wrong-shape",
    ),
    pytest.param(
        lambda p: p[:-1],
        r"^source stopped after 7 parameters, expected 8; first missing: 'tail' \(index 7\)$",
        id="too-few",
    ),
    pytest.param(
        lambda p: [*p, ("extra", torch.zeros(1))],
        r"^source yielded 'extra' at index 8, after all 8 expected parameters; "
        r"expected the iteration to end$",
        id="too-many",
    ),
]


@uvloop_only
@pytest.mark.parametrize(("fault", "message"), FAULTS)
async def test_source_that_breaks_the_plan_fails_the_round_then_recovers(
    mixed_worker: str, info: Callable[..., TrainerInitInfo], fault: Callable[..., Any], message: str
) -> None:
    async with HttpClient(mixed_worker) as client:
        model = _models.mixed()
        source = FaultySource(model)
        engine = await trainer_init(info(), client=client, source=source)
        async with engine:
            _models.randomize(model, seed=1)
            await engine.send_weights(weight_version="before")
            source.fault = fault
            _models.randomize(model, seed=2)
            with pytest.raises(SourceMismatchError, match=message):
                await engine.send_weights(weight_version="broken")
            (status,) = await client.weights_status()
            assert status["weight_version"] == "before"
            source.fault = None
            await engine.send_weights(weight_version="after")
            await assert_worker_has(client, model, "after")


def _threads_in_asyncwt() -> list[str]:
    """Threads other than this one currently executing asyncwt or test-source code."""
    import threading

    busy = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        stack = []
        while frame is not None:
            stack.append(frame.f_code.co_filename)
            frame = frame.f_back
        if any("asyncwt" in f or "test_e2e_tcp" in f for f in stack):
            busy.append(str(ident))
    return busy


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@uvloop_only
@pytest.mark.parametrize("cancel_after", [0.05, 0.3, 0.9])
async def test_cancelling_send_weights_leaves_nothing_behind(
    mixed_worker: str, info: Callable[..., TrainerInitInfo], cancel_after: float
) -> None:
    async with HttpClient(mixed_worker) as client:
        model = _models.mixed()
        source = FaultySource(model)
        engine = await trainer_init(info(), client=client, source=source)
        async with engine:
            _models.randomize(model, seed=1)
            await engine.send_weights(weight_version="before")
            fds = _open_fds()
            tasks = asyncio.all_tasks()
            source.delay = 0.15  # the round would take ~1.2 s
            _models.randomize(model, seed=2)
            with anyio.move_on_after(cancel_after) as scope:
                await engine.send_weights(weight_version="cancelled")
            assert scope.cancelled_caught
            assert _threads_in_asyncwt() == []
            assert asyncio.all_tasks() == tasks
            # The cancelled HTTP request may drop its pooled connection: fewer is fine.
            assert _open_fds() <= fds
            (status,) = await client.weights_status()
            assert status["weight_version"] == "before"
            source.delay = 0.0
            _models.randomize(model, seed=3)
            await engine.send_weights(weight_version="after")
            await assert_worker_has(client, model, "after")


class TamperingClient(HttpClient):
    """Hands the workers a token other than the trainer's."""

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await super().init_weight_transfer_engine({**init_info, "token": "not-the-token-" * 4})


@uvloop_only
async def test_worker_with_the_wrong_token_is_refused(
    mixed_worker: str, info: Callable[..., TrainerInitInfo]
) -> None:
    model = _models.mixed()
    async with TamperingClient(mixed_worker) as bad:
        with pytest.raises(
            ControlPlaneError,
            match=r"HTTP 500: AuthenticationError: the trainer failed the token challenge",
        ):
            await trainer_init(info(), client=bad, source=ModuleSource(model))
    async with HttpClient(mixed_worker) as client:
        await push_rounds(client, model, rounds=1, info=info())


@uvloop_only
async def test_killed_worker_ends_the_round_with_an_error_not_a_hang(backend: str) -> None:
    proc, url = start_worker("_models:mixed", "--backend", backend, env=worker_env())
    try:
        async with HttpClient(url, timeout=20) as client:
            model = _models.mixed()
            source = FaultySource(model)
            timeouts = {"send_timeout": 10.0, "ready_timeout": 10.0, "recv_timeout": 10.0}
            engine = await trainer_init(info_for(backend, **timeouts), client=client, source=source)
            async with engine:
                await engine.send_weights(weight_version="alive")
                source.delay = 0.2

                async def kill_soon() -> None:
                    await anyio.sleep(0.5)
                    os.kill(proc.pid, signal.SIGKILL)

                with anyio.fail_after(40):  # a hang fails here; the timeouts above are 10 s
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(kill_soon)
                        with pytest.raises((TransferError, ControlPlaneError)):
                            await engine.send_weights(weight_version="killed")
                # The worker is gone: the next round fails at once too (its control
                # plane is unreachable, or the data connection is known broken).
                with anyio.fail_after(20), pytest.raises((TransferError, ControlPlaneError)):
                    await engine.send_weights(weight_version="after")
    finally:
        stop_worker(proc)
