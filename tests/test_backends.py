"""The shared backend suite: a trainer in this process, `asyncwt worker` servers in others.

Every case runs against every CPU backend (tcp, shm, torch_dist), so a new transport
gets the whole suite by adding its name to `_faults.BACKENDS`. Every round is checked
bit-exact through the worker's `/weights_status` checksum. Failures on purpose (cut
connections, killed or stopped peers, cancellation) are in `test_faults.py`.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _dist
import _e2e_ranks
import _models
import anyio
import pytest
import torch
from _faults import (
    BACKENDS,
    FaultySource,
    assert_worker_has,
    info_for,
    shm_leftovers,
    worker_env,
)

from asyncwt import (
    ControlPlaneError,
    HttpClient,
    ModuleSource,
    SourceMismatchError,
    TcpWorkerInitInfo,
    Timeouts,
    TrainerInitInfo,
    Tuning,
    trainer_init,
)
from asyncwt._core import sched as _sched
from asyncwt._core.plan import TransferPlan
from asyncwt._core.sched import BULK_SLICE_NS, SHORT_SLICE_NS, thread_slice_ns
from asyncwt._trainer import pipeline as _pipeline
from asyncwt._worker.launch import worker_process

TESTS = Path(__file__).resolve().parent
uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.param
    yield name
    assert not shm_leftovers(), "shm leftovers"


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
        await push_rounds(client, model, rounds=3, info=info(tuning=Tuning(zero_copy=zero_copy)))


@uvloop_only
@pytest.mark.parametrize("elementwise", [False, True], ids=["whole-tensors", "elementwise"])
@pytest.mark.slow
async def test_background_copy_path_is_bit_exact(backend: str, elementwise: bool) -> None:
    """With a transform every parameter goes through the applier (and chunk reassembly,
    or, elementwise, chunks landing and in-place transforms; 0-d and empty ones too)."""
    args = (
        "--backend",
        backend,
        "--transform",
        "_models:identity_transform",
        "--apply-threads",
        "3",
    )
    args += ("--transform-elementwise",) if elementwise else ()
    with worker_process("_models:mixed", *args, env=worker_env()) as url:
        async with HttpClient(url) as client:
            await push_rounds(client, _models.mixed(), rounds=2, info=info_for(backend))


@uvloop_only
@pytest.mark.parametrize(
    "transform", [(), ("--transform", "_models:identity_transform"),
                  ("--transform", "_models:identity_transform", "--transform-elementwise")],
    ids=["in-place", "through-buffers", "elementwise"],
)  # fmt: skip
@pytest.mark.slow
async def test_slices_of_a_mib_and_more_among_small_ones(
    backend: str, transform: tuple[str, ...]
) -> None:
    """Long slices (torch_dist broadcasts them on their own, into the parameter when
    it can take them) between short ones, and a parameter chunked over buckets;
    elementwise, each bucket's work is split among the apply threads."""
    args = ("--backend", backend, *transform)
    with worker_process("_models:large_slices", *args, env=worker_env()) as url:
        async with HttpClient(url) as client:
            model = _models.large_slices()
            info = info_for(backend, bucket_bytes=_models.LARGE_BUCKET_BYTES)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                sizes = [s.nbytes for b in engine.plan.buckets for s in b.slices]
                assert any(n >= 1 << 20 for n in sizes) and any(n < 1 << 10 for n in sizes)
                for r in (1, 2):
                    _models.randomize(model, seed=r)
                    await engine.send_weights(weight_version=f"v{r}")
                    await assert_worker_has(client, model, f"v{r}")


@uvloop_only
@pytest.mark.slow
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


@pytest.mark.slow
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


class SlowStartClient(HttpClient):
    """`start_weight_update` takes `delay_s` longer (a far or busy control plane), or
    fails while `fail_starts` is positive; notes when each start returned."""

    def __init__(self, url: str, delay_s: float, fail_starts: int = 0) -> None:
        super().__init__(url)
        self.delay_s = delay_s
        self.fail_starts = fail_starts
        self.started_at: list[float] = []

    async def start_weight_update(self) -> None:
        await anyio.sleep(self.delay_s)
        if self.fail_starts > 0:
            self.fail_starts -= 1
            raise ControlPlaneError("start_weight_update failed on purpose")
        await super().start_weight_update()
        self.started_at.append(time.monotonic())


class FirstYieldSource(ModuleSource):
    """Notes when each pass yields its first tensor, and how many tensors it yielded."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.first_yield_at: list[float] = []
        self.yielded = 0

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.yielded = 0
        for i, pair in enumerate(super().iter_full()):
            if i == 0:
                self.first_yield_at.append(time.monotonic())
            self.yielded += 1
            yield pair


@uvloop_only
async def test_the_first_tensors_are_gathered_while_the_round_opens(
    mixed_worker: str, backend: str
) -> None:
    model = _models.mixed()
    source = FirstYieldSource(model)
    async with SlowStartClient(mixed_worker, delay_s=0.5) as client:
        engine = await trainer_init(info_for(backend), client=client, source=source)
        async with engine:
            for r in (1, 2):
                _models.randomize(model, seed=r)
                await engine.send_weights(weight_version=f"v{r}")
                await assert_worker_has(client, model, f"v{r}")
    assert len(source.first_yield_at) == len(client.started_at) == 2
    for yielded, started in zip(source.first_yield_at, client.started_at):
        assert yielded < started - 0.3, "the source should be iterated while start runs"


class YieldTimesSource(ModuleSource):
    """Notes when each tensor of the first pass was yielded."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.yielded_at: list[float] = []

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        first = not self.yielded_at
        for pair in super().iter_full():
            if first:
                self.yielded_at.append(time.monotonic())
            yield pair


@uvloop_only
@pytest.mark.parametrize("read_ahead", [1, 3])
async def test_the_source_runs_read_ahead_buckets_ahead_while_the_round_opens(
    mixed_worker: str, backend: str, read_ahead: int
) -> None:
    model = _models.mixed()
    source = YieldTimesSource(model)
    async with SlowStartClient(mixed_worker, delay_s=0.5) as client:
        info = info_for(backend, tuning=Tuning(read_ahead=read_ahead))
        engine = await trainer_init(info, client=client, source=source)
        async with engine:
            buckets = engine.plan.buckets
            assert len(buckets) > read_ahead + 1, "the test needs more buckets than that"
            await engine.send_weights(weight_version="v1")
            await assert_worker_has(client, model, "v1")
    # Before the round opened nothing was packed: `read_ahead` buckets waited for the
    # pack stage, and the iterate stage stopped right after completing one more.
    (started,) = client.started_at
    before_open = sum(1 for t in source.yielded_at if t < started)
    assert before_open == buckets[read_ahead].slices[-1].param + 1


class SliceRecordingSource(ModuleSource):
    """Notes the scheduler slice of the thread that yields each tensor, and which thread."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.slices: list[int | None] = []
        self.threads: set[int] = set()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for pair in super().iter_full():
            self.slices.append(thread_slice_ns())
            self.threads.add(threading.get_ident())
            yield pair


@uvloop_only
async def test_the_round_asks_for_prompt_gathers_and_bulk_copies(
    mixed_worker: str, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source runs on a thread with a short slice, the pack copies on one with a
    long slice (see `asyncwt._core.sched`); the caller's thread is left as it was."""
    model = _models.mixed()
    source = SliceRecordingSource(model)
    pack_slices: list[int | None] = []
    copy_into = _pipeline._copy_into

    def recording_copy_into(*args: Any) -> Any:
        pack_slices.append(thread_slice_ns())
        return copy_into(*args)

    monkeypatch.setattr(_pipeline, "_copy_into", recording_copy_into)
    own_slice = thread_slice_ns()
    async with HttpClient(mixed_worker) as client:
        info = info_for(backend, tuning=Tuning(zero_copy=False))  # every tensor is packed
        engine = await trainer_init(info, client=client, source=source)
        async with engine:
            await engine.send_weights(weight_version="v1")
            await assert_worker_has(client, model, "v1")
    assert len(source.slices) == len(engine.plan.params)
    assert threading.get_ident() not in source.threads
    hinted = _sched.hints_enabled() and bool(own_slice)  # a kernel that takes requests
    assert set(source.slices) == {SHORT_SLICE_NS if hinted else own_slice}
    assert len(pack_slices) == len(engine.plan.buckets)
    assert set(pack_slices) == {BULK_SLICE_NS if hinted else own_slice}
    assert thread_slice_ns() == own_slice


@pytest.mark.parametrize(
    ("read_ahead", "message"),
    [
        (0, r"^tuning\.read_ahead should be a positive int, got 0$"),
        (65, r"^tuning\.read_ahead should be at most 64, got 65$"),
        (2.0, r"^tuning\.read_ahead should be a positive int, got 2\.0$"),
    ],
)
def test_read_ahead_out_of_range_is_rejected_by_name(read_ahead: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Tuning(read_ahead=read_ahead)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["connect", "recv", "send", "handshake"])
@pytest.mark.parametrize("value", [9_007_199_254_740_993, 1e300, 604_801])
def test_timeouts_past_a_week_are_rejected_by_name(name: str, value: float) -> None:
    """Found by the route fuzzer: a huge `connect_timeout` reached `settimeout`, whose
    OverflowError escaped as a bare 500. Both ends now bound every timeout."""
    limit = rf"should be at most 604800, got {re.escape(str(value))}$"
    with pytest.raises(ValueError, match=rf"^timeouts\.{name} {limit}"):
        Timeouts(**{name: value})
    if name in ("connect", "recv"):  # what a worker receives, too (as `<name>_timeout`)
        plan = TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=1 << 20)
        fields = {"plan": plan.to_wire(), "host": "127.0.0.1", "port": 1, "token": "t"}
        with pytest.raises(ValueError, match=rf"^{name}_timeout {limit}"):
            TcpWorkerInitInfo(**fields, **{f"{name}_timeout": value})


async def _fails_then_the_next_round_arrives(
    engine: Any,
    client: HttpClient,
    model: torch.nn.Module,
    error: type[Exception],
    match: str,
    after_failure: Callable[[], None] = lambda: None,
) -> None:
    """A round fails with `error` and leaves the worker exactly as it was (version,
    checksum, `weights_incomplete` false); the next round arrives bit-exact.
    `after_failure` runs right after the failed round."""
    (before,) = await client.weights_status(checksum=True)
    _models.randomize(model, seed=1)
    with pytest.raises(error, match=match):
        await engine.send_weights(weight_version="failed")
    after_failure()
    (after,) = await client.weights_status(checksum=True)
    assert after == before  # nothing reached the worker
    _models.randomize(model, seed=2)
    await engine.send_weights(weight_version="v2")
    await assert_worker_has(client, model, "v2")


@uvloop_only
async def test_a_failed_start_stops_the_gather_and_the_next_round_arrives(
    mixed_worker: str, backend: str
) -> None:
    model = _models.mixed()
    source = FirstYieldSource(model)
    async with SlowStartClient(mixed_worker, delay_s=0.2, fail_starts=1) as client:
        engine = await trainer_init(info_for(backend), client=client, source=source)
        async with engine:

            def stopped_early() -> None:
                assert 0 < source.yielded < len(source.metadata)

            await _fails_then_the_next_round_arrives(
                engine, client, model, ControlPlaneError,
                r"^start_weight_update failed on purpose$", after_failure=stopped_early,
            )  # fmt: skip


class SlowUpdateClient(HttpClient):
    """`update_weights` reaches the worker `delay_s` late, so the trainer waits that
    long for the workers' READY."""

    def __init__(self, url: str, delay_s: float) -> None:
        super().__init__(url)
        self.delay_s = delay_s

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await anyio.sleep(self.delay_s)
        await super().update_weights(update_info)


class FailsOnceSource(ModuleSource):
    """Its first pass raises after `after_s`, before yielding anything; later passes work."""

    def __init__(self, module: torch.nn.Module, after_s: float) -> None:
        super().__init__(module)
        self.after_s = after_s
        self.failures = 1

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.failures:
            self.failures -= 1
            time.sleep(self.after_s)
            raise RuntimeError("the gather failed on purpose")
        yield from super().iter_full()


@uvloop_only
async def test_a_source_error_while_waiting_for_ready_aborts_and_the_next_round_arrives(
    mixed_worker: str, backend: str
) -> None:
    model = _models.mixed()
    source = FailsOnceSource(model, after_s=0.1)
    async with SlowUpdateClient(mixed_worker, delay_s=0.5) as client:
        engine = await trainer_init(info_for(backend), client=client, source=source)
        async with engine:
            await _fails_then_the_next_round_arrives(
                engine, client, model, RuntimeError, r"^the gather failed on purpose$"
            )


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
@pytest.mark.slow
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
@pytest.mark.slow
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
                    r"RuntimeError: quantisation of w16 failed on purpose; the published "
                    r"version stays 'good' and the model holds a mix of versions until a "
                    r"round completes$",
                ):
                    await engine.send_weights(weight_version="bad")
                (status,) = await client.weights_status(checksum=True)
                assert (status["weight_version"], status["weights_incomplete"]) == ("good", True)
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
                match=r"HTTP 409: PlanMismatchError: round 1000: transfer plan digest 0{16}… does not "
                r"match this side's [0-9a-f]{16}…; both ends must use the same metadata",
            ):
                await client.start_weight_update()
                await client.update_weights(
                    {"round_id": 1000, "plan_digest": "0" * 64, "trainer_id": engine.trainer_id}
                )
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
            (status,) = await client.weights_status(checksum=True)
            assert status["weight_version"] == "before"
            source.fault = None
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
