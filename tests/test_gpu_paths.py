"""The GPU paths, proved on the CPU as far as the CPU can prove them.

Each test stands in for one finding of a close reading of the CUDA code (issue 27):
device resolution with its index, in the caller's thread; packing into device
staging; the fence every rank takes; events that sleep instead of spinning; CUDA
left alone at import; CUDA IPC by GPU UUID and a ring never freed under a worker
(the NCCL group is in `test_gpu_paths_2.py`). What needs a GPU runs in
`scripts/gpu-check`.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from types import SimpleNamespace
from typing import Any, ClassVar

import anyio
import pytest
import torch
from _models import AcceptingClient as _Client
from _models import two_linears as _model

from asyncwt import (
    ModuleSource,
    SyncTrainerEngine,
    TcpTrainerInitInfo,
    TorchDistTrainerInitInfo,
    trainer_init,
)
from asyncwt._backends import cuda_ipc
from asyncwt._backends.torch_dist import TorchDistSender
from asyncwt._core.device import resolve_device
from asyncwt._core.errors import TransferError
from asyncwt._core.lanes import DeviceLane, LaneEvent
from asyncwt._core.plan import Bucket, TransferPlan
from asyncwt._trainer.pipeline import PipelineConfig, StagingPool, _runs_on_device, run_pipeline

BUCKET_BYTES = 4096


@pytest.fixture
def gpu_host(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """CUDA said to be there, the current device a per-thread value as in CUDA."""
    current = threading.local()
    state = {"default": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "current_device", lambda: getattr(current, "index", state["default"])
    )
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: setattr(current, "index", torch.device(d).index)
    )
    return state


# -- device resolution ---------------------------------------------------------------


def test_bare_cuda_resolves_to_the_calling_threads_device(gpu_host: dict[str, int]) -> None:
    torch.cuda.set_device(torch.device("cuda", 3))
    assert resolve_device("cuda") == torch.device("cuda", 3)
    seen: list[torch.device] = []
    thread = threading.Thread(target=lambda: seen.append(resolve_device("cuda")))
    thread.start()
    thread.join()
    assert seen == [torch.device("cuda", 0)]  # another thread: its own current device
    assert resolve_device("cuda:5") == torch.device("cuda", 5)


def test_a_cpu_model_stays_on_the_cpu_and_on_gloo_on_a_gpu_host(gpu_host: dict[str, int]) -> None:
    source = ModuleSource(_model())
    device = resolve_device(None, source)
    assert device == torch.device("cpu")
    plan = TransferPlan.build(source.metadata, bucket_bytes=BUCKET_BYTES)
    sender = TorchDistSender(TorchDistTrainerInitInfo(rank=0), plan, device)
    try:
        assert sender.group_backend == "gloo"
    finally:
        sender.close()


def test_a_source_that_cannot_say_follows_cuda_where_it_is(gpu_host: dict[str, int]) -> None:
    assert resolve_device(None, None) == torch.device("cuda", 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
def test_bare_cuda_without_cuda_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"^device is 'cuda' but CUDA is not available here$"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"^device should name a torch device, got 'gpu0'"):
        resolve_device("gpu0")


def test_nccl_refuses_a_trainer_device_off_the_gpu() -> None:
    source = ModuleSource(_model())
    plan = TransferPlan.build(source.metadata, bucket_bytes=BUCKET_BYTES)
    info = TorchDistTrainerInitInfo(rank=0, group_backend="nccl")
    with pytest.raises(
        ValueError, match=r"^group_backend is 'nccl' but the trainer's device is cpu"
    ):
        TorchDistSender(info, plan, torch.device("cpu"))


def test_a_lane_needs_the_gpu_index() -> None:
    with pytest.raises(ValueError, match=r"^device should be a CUDA device with its index"):
        DeviceLane(torch.device("cuda"))


def test_the_blocking_facade_resolves_the_device_in_the_callers_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncwt._trainer.blocking as sync

    threads: list[threading.Thread] = []
    real = sync.resolve_device

    def recording(name: Any, source: Any = None) -> torch.device:
        threads.append(threading.current_thread())
        return real(name, source)

    monkeypatch.setattr(sync, "resolve_device", recording)
    info = TcpTrainerInitInfo(rank=1)
    with SyncTrainerEngine(info, client=_Client(), source=ModuleSource(_model())) as engine:
        assert threads == [threading.current_thread()]
        assert engine.engine.info.device == "cpu"  # what the caller's thread resolved
        assert info.device is None  # the caller's info is left as it was


# -- the fence every rank takes --------------------------------------------------------


class _Fence:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _RecordingLane(DeviceLane):
    """A CPU lane that remembers what it was told to wait on, and in which thread
    the caller's fence was taken."""

    def __init__(self) -> None:
        super().__init__("cpu")
        self.waited: list[LaneEvent] = []
        self.fenced_in: list[threading.Thread] = []
        self.fence = _Fence()

    def record_caller(self) -> LaneEvent:
        self.fenced_in.append(threading.current_thread())
        return self.fence

    def wait_on(self, event: LaneEvent) -> None:
        self.waited.append(event)


@pytest.mark.asyncio
async def test_every_rank_waits_for_the_callers_stream_before_reading() -> None:
    engine: Any = await trainer_init(
        TcpTrainerInitInfo(rank=1), client=_Client(), source=ModuleSource(_model())
    )
    lane = _RecordingLane()
    engine._iterate_lane = lane
    await engine.send_weights()
    assert lane.fenced_in == [threading.current_thread()]  # taken where send_weights was called
    assert lane.waited == [lane.fence]  # and waited for on the iterate lane
    explicit = _Fence()
    await engine.send_weights(after=explicit)
    assert lane.waited == [lane.fence, explicit]
    assert len(lane.fenced_in) == 1  # an explicit fence is not taken again


def test_the_blocking_facade_fences_in_the_training_thread() -> None:
    with SyncTrainerEngine(
        TcpTrainerInitInfo(rank=1), client=_Client(), source=ModuleSource(_model())
    ) as facade:
        lane = _RecordingLane()
        facade.engine._iterate_lane = lane  # type: ignore[attr-defined]
        facade.send_weights()
        assert lane.fenced_in == [threading.current_thread()]  # not the loop's thread
        assert lane.waited == [lane.fence]


# -- packing into device staging -------------------------------------------------------


class _DeviceStagingSink:
    """A sink whose staging is device memory: the `meta` device stands in for a GPU
    (its tensors have no bytes on the host, just as CUDA's)."""

    min_view_bytes = None
    in_flight_buckets = 1

    def __init__(self, plan: TransferPlan) -> None:
        self.buffers = [
            torch.empty(plan.bucket_bytes, dtype=torch.uint8, device="meta") for _ in range(2)
        ]
        self.sent: list[tuple[int, list[tuple[str, int]]]] = []

    def staging(self, slot: int) -> torch.Tensor:
        return self.buffers[slot]

    async def reclaim(self, slot: int) -> None:
        return None

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[torch.Tensor]) -> None:
        self.sent.append((bucket.index, [(s.device.type, s.numel()) for s in segments]))


@pytest.mark.asyncio
async def test_packing_into_device_staging_hands_the_sink_device_segments() -> None:
    source = ModuleSource(_model())
    plan = TransferPlan.build(source.metadata, bucket_bytes=BUCKET_BYTES)
    sink = _DeviceStagingSink(plan)
    cpu = torch.device("cpu")
    await run_pipeline(
        plan,
        source,
        sink,
        pool=StagingPool(2, plan.bucket_bytes, cpu),
        iterate_lane=DeviceLane(cpu),
        pack_lane=DeviceLane(cpu),
        config=PipelineConfig(num_buffers=2),
        fence=DeviceLane(cpu).record_caller(),
    )
    assert [index for index, _ in sink.sent] == list(range(len(plan.buckets)))
    for (index, segments), bucket in zip(sink.sent, plan.buckets):
        assert segments == [("meta", s.nbytes) for s in bucket.slices], index


def test_only_copies_the_device_runs_alone_are_queued_from_the_loop() -> None:
    lane = SimpleNamespace(is_async=True)
    on_gpu = SimpleNamespace(is_cuda=True)
    on_host = SimpleNamespace(is_cuda=False)

    def staging(cuda: bool, pinned: bool) -> Any:
        return SimpleNamespace(is_cuda=cuda, is_pinned=lambda: pinned)

    slice_ = object()
    assert _runs_on_device(staging(True, False), [(slice_, on_gpu)], lane)  # type: ignore[list-item]
    assert _runs_on_device(staging(False, True), [(slice_, on_gpu)], lane)  # type: ignore[list-item]
    # A device-to-host copy into pageable memory waits for the device: a thread's job.
    assert not _runs_on_device(staging(False, False), [(slice_, on_gpu)], lane)  # type: ignore[list-item]
    # A CPU tensor's copy is the host's own work.
    assert not _runs_on_device(staging(False, True), [(slice_, on_host)], lane)  # type: ignore[list-item]
    assert not _runs_on_device(
        staging(True, False),
        [(slice_, on_gpu)],
        SimpleNamespace(is_async=False),  # type: ignore[arg-type]
    )


# -- events that sleep -----------------------------------------------------------------


class _FakeEvent:
    made: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, **kwargs: Any) -> None:
        _FakeEvent.made.append(kwargs)

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool:
        return False

    def synchronize(self) -> None: ...


class _FakeStream:
    def __init__(self, device: Any = None) -> None:
        self.device = device


def test_every_cuda_event_sleeps_instead_of_spinning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _FakeStream(device))
    _FakeEvent.made.clear()
    lane = DeviceLane(torch.device("cuda", 1))
    lane.record()
    lane.record_caller()
    from asyncwt._core.lanes import wait_for_stream

    wait_for_stream(_FakeStream())
    anyio.run(DeviceLane.wait, lane.record())
    assert _FakeEvent.made and all(kw == {"blocking": True} for kw in _FakeEvent.made)


# -- CUDA left alone at import -----------------------------------------------------------

_IMPORT_PROBE = """
import torch, torch.cuda
calls = []
def spy(name, real):
    def wrapper(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    return wrapper
torch.cuda.is_available = spy("is_available", torch.cuda.is_available)
torch.cuda.device_count = spy("device_count", torch.cuda.device_count)
torch.cuda.init = spy("init", torch.cuda.init)
torch.cuda._lazy_init = spy("_lazy_init", torch.cuda._lazy_init)
if hasattr(torch._C, "_cuda_getDeviceCount"):  # CUDA builds only
    torch._C._cuda_getDeviceCount = spy("_cuda_getDeviceCount", torch._C._cuda_getDeviceCount)
import asyncwt, asyncwt._vllm.plugin, asyncwt._backends.cuda_ipc, asyncwt._backends.torch_dist
print(calls, torch.cuda.is_initialized())
"""


@pytest.mark.slow
def test_importing_asyncwt_asks_nothing_of_cuda() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == "[] False"


# -- CUDA IPC --------------------------------------------------------------------------


def test_ipc_handles_open_on_the_gpu_with_the_trainers_uuid(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    uuids = {0: "GPU-aaa", 1: "GPU-bbb"}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cuda_ipc, "gpu_uuid", lambda device: uuids[device.index])
    assert cuda_ipc.local_index("GPU-bbb", torch.device("cuda", 0)) == 1
    assert cuda_ipc.local_index(None, torch.device("cuda", 1)) == 1  # a trainer that could not tell
    with pytest.raises(
        TransferError,
        match=r"^the trainer's ring is on GPU GPU-ccc, which this worker cannot see \(it sees "
        r"\['GPU-aaa', 'GPU-bbb'\]\)",
    ):
        cuda_ipc.local_index("GPU-ccc", torch.device("cuda", 0))


def test_a_closed_rings_memory_goes_to_the_next_ring_never_back_to_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The shelf's bookkeeping is the same on any device; blocks come from the CPU here.
    monkeypatch.setattr(
        cuda_ipc, "ring_block", lambda device, n: torch.empty(n, dtype=torch.uint8, device=device)
    )
    device = torch.device("cpu")
    nbytes = 1234567
    first = cuda_ipc.take_ring(device, nbytes, 2)
    addresses = {b.data_ptr() for b in first}
    cuda_ipc.shelve_ring(first)
    del first
    second = cuda_ipc.take_ring(device, nbytes, 3)  # two from the shelf, one new
    assert addresses < {b.data_ptr() for b in second}
    other = cuda_ipc.take_ring(device, nbytes, 1)  # the shelf is empty: nothing is shared
    assert not addresses & {b.data_ptr() for b in other}
    cuda_ipc.shelve_ring(second)
    cuda_ipc.shelve_ring(other)
