"""The GPU paths of issue 33 (findings 8-14), proved on the CPU as far as it can.

A recording fake of `torch.cuda` (streams, events, the current stream per thread,
device syncs, host registration, memory pools) stands in for the GPU; each test
shows what asyncwt asks of CUDA, where and in which order. What needs the device
itself is checked on a GPU by `scripts/_gpu_checks/findings_8_14.py` (`scripts/gpu-check`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import torch
from _models import AcceptingClient as _Client
from _models import two_linears as _model

from asyncwt import (
    ModuleSource,
    ShmTrainerInitInfo,
    SyncTrainerEngine,
    TcpTrainerInitInfo,
    TorchDistTrainerInitInfo,
    trainer_init,
)
from asyncwt._backends import cuda_ipc, torch_dist
from asyncwt._backends.shm import backend as shm_backend
from asyncwt._backends.tcp.backend import TCP
from asyncwt._core import checksum, cuda_sync
from asyncwt._core.errors import TransferError
from asyncwt._core.lanes import DeviceLane
from asyncwt._core.plan import Slice, TransferPlan
from asyncwt._delta.codec import encode, unit_of
from asyncwt._trainer import pipeline
from asyncwt._trainer.engine import PipelinedTrainerEngine, trainer_engine_class
from asyncwt._trainer.pipeline import PipelineConfig, StagingPool, run_pipeline
from asyncwt._transports.base import ReceivedBucket, SenderTransport
from asyncwt._worker import delta as delta_receiver
from asyncwt._worker.applier import ModelTarget

BUCKET_BYTES = 4096


# -- a recording fake of torch.cuda ------------------------------------------------------


@dataclass(eq=False)
class _Stream:
    name: str
    device: Any = None
    waited: list[_Event] = field(default_factory=list)

    def wait_event(self, event: _Event) -> None:
        self.waited.append(event)


class _Event:
    cuda: _FakeCuda

    def __init__(self, blocking: bool = False) -> None:
        self.blocking = blocking
        self.stream: _Stream | None = None

    def record(self, stream: _Stream | None = None) -> None:
        self.stream = stream if stream is not None else self.cuda.current_stream()

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        assert self.blocking, "a host wait on a spinning event"
        assert self.stream is not None
        self.cuda.log.append(("sleep", self.stream.name, threading.current_thread()))


class _CudaRt:
    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:
        self.log.append(("register", pointer, nbytes, flags))
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:
        self.log.append(("unregister", pointer))
        return 0


class _FakeCuda:
    """What asyncwt asks of torch.cuda: streams made, events recorded and slept on,
    the current stream of each thread, device syncs (`log`), registrations."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.streams: list[_Stream] = []
        self.currents: list[_Stream] = []
        self._current = threading.local()
        self.cudart = _CudaRt(self.log)

    def current_stream(self, device: Any = None) -> _Stream:
        stream = getattr(self._current, "stream", None)
        if stream is None:
            stream = self._current.stream = _Stream(f"current of {threading.current_thread().name}")
            self.currents.append(stream)
        return stream

    def new_stream(self, device: Any = None) -> _Stream:
        stream = _Stream(f"stream {len(self.streams)}", device)
        self.streams.append(stream)
        return stream

    @contextlib.contextmanager
    def use_stream(self, stream: _Stream) -> Iterator[None]:
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("DEVICE SYNC", device))

    def sleeps(self) -> list[str]:
        return [entry[1] for entry in self.log if entry[0] == "sleep"]


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    cuda = _FakeCuda()
    event_cls = type("Event", (_Event,), {"cuda": cuda})  # isinstance() checks work on it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", event_cls)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: cuda.new_stream(device))
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", cuda.use_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cuda.cudart)
    return cuda


def _plan() -> TransferPlan:
    return TransferPlan.build(ModuleSource(_model()).metadata, bucket_bytes=BUCKET_BYTES)


# -- 8: the CUDA IPC ring in allocations of its own --------------------------------------


def test_ring_blocks_are_whole_allocations_of_asyncwts_own_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pools: list[object] = []
    allocations: list[tuple[int, object | None]] = []
    active: list[object] = []

    class Pool:
        def __init__(self) -> None:
            pools.append(self)

    @contextlib.contextmanager
    def use_mem_pool(pool: object, device: Any = None) -> Iterator[None]:
        active.append(pool)
        try:
            yield
        finally:
            active.pop()

    real_empty = torch.empty

    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") == torch.device("cuda", 3):
            allocations.append((int(size[0]), active[-1] if active else None))
            kwargs["device"] = "cpu"
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch.cuda, "MemPool", Pool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(cuda_ipc, "_POOLS", {}, raising=False)
    monkeypatch.setattr(cuda_ipc, "_SHELF", {})
    device = torch.device("cuda", 3)
    nbytes = (3 << 20) + 5
    ring = cuda_ipc.take_ring(device, nbytes, 3)
    more = cuda_ipc.take_ring(device, 64 << 20, 1)
    assert len(pools) == 1  # one pool per device, kept
    # Every block was allocated inside asyncwt's pool, never the shared caching segments,
    # each as a whole segment (>= 10 MiB, a multiple of 2 MiB: nothing else can share it).
    assert allocations == [(10 << 20, pools[0])] * 3 + [(64 << 20, pools[0])]
    assert [b.numel() for b in ring] == [nbytes] * 3 and more[0].numel() == 64 << 20
    assert cuda_ipc.block_bytes(1) == 10 << 20
    assert cuda_ipc.block_bytes((12 << 20) + 1) == 14 << 20


def test_without_a_memory_pool_the_ring_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.cuda, "MemPool")
    with pytest.raises(TransferError, match=r"^the 'cuda_ipc' backend needs torch.cuda.MemPool"):
        cuda_ipc.ring_block(torch.device("cuda", 0), 4096)


# -- 9: a worker maps the ring on its own GPU -------------------------------------------


def _ipc_receiver(
    monkeypatch: pytest.MonkeyPatch, device: torch.device, refuse: set[int]
) -> tuple[cuda_ipc.CudaIpcReceiver, list[int], list[int]]:
    """A receiver whose CUDA IPC opens are recorded (and refused on `refuse`)."""
    plan = _plan()
    opened: list[int] = []
    asked: list[int] = []

    def open_shared(index: int, handle: bytes, size: int, *rest: Any) -> torch.UntypedStorage:
        if index in refuse:
            raise RuntimeError("CUDA error: peer access is not supported between these devices")
        opened.append(index)
        return torch.UntypedStorage(size)

    def uuid(d: torch.device) -> str:
        asked.append(d.index)
        return {0: "GPU-trainer", 1: "GPU-worker"}[d.index]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", open_shared, raising=False)
    monkeypatch.setattr(cuda_ipc, "gpu_uuid", uuid)
    receiver = cuda_ipc.CudaIpcReceiver.__new__(cuda_ipc.CudaIpcReceiver)
    handle = {
        "handle": "aGFuZGxl",
        "size": plan.bucket_bytes,
        "offset": 0,
        "ref_counter_handle": "cmVm",
        "ref_counter_offset": 0,
        "event_handle": None,
        "event_sync_required": False,
    }
    receiver.plan = plan
    receiver.handles = [handle, handle]
    receiver.gpu = "GPU-trainer"
    receiver.device = device
    return receiver, opened, asked


def test_a_worker_maps_the_ring_on_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver, opened, asked = _ipc_receiver(monkeypatch, torch.device("cuda", 1), refuse=set())
    buffers = receiver.map_ring()
    assert opened == [1, 1]  # the worker's GPU: no context on the trainer's
    assert asked == []  # nor a look for the trainer's GPU among this worker's
    assert [b.numel() for b in buffers] == [receiver.plan.bucket_bytes] * 2


def test_without_peer_access_the_ring_is_mapped_on_the_trainers_gpu(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    receiver, opened, _ = _ipc_receiver(monkeypatch, torch.device("cuda", 1), refuse={1})
    with caplog.at_level(logging.WARNING, logger="asyncwt"):
        receiver.map_ring()
    assert opened == [0, 0]
    assert "cannot be mapped on this worker's GPU cuda:1 (no peer access" in caplog.text
    receiver.gpu = "GPU-elsewhere"  # and where the trainer's GPU is not visible either
    with pytest.raises(TransferError, match=r"^the trainer's ring is on GPU GPU-elsewhere"):
        receiver.map_ring()


# -- 10: delta rounds scatter into a GPU worker's parameters -----------------------------


def test_a_gpu_parameter_of_the_wire_dtype_is_its_own_delta_base() -> None:
    plan = _plan()
    meta = plan.params[0]
    on_gpu = SimpleNamespace(
        device=torch.device("cuda", 0), dtype=meta.dtype, is_contiguous=lambda: True
    )
    target: Any = SimpleNamespace(params={meta.name: on_gpu}, load_weights=None)
    assert delta_receiver._keeps_wire_bytes(target, meta, "cuda")
    assert not delta_receiver._keeps_wire_bytes(target, meta, "cpu")
    target.load_weights = lambda weights: None  # vLLM's loader wants whole tensors
    assert not delta_receiver._keeps_wire_bytes(target, meta, "cuda")


def test_delta_buckets_are_scattered_into_gpu_parameters_without_a_host_shadow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CPU parameters play the GPU ones (`_keeps_wire_bytes` says so): nothing is
    shadowed, a coded bucket's changes land in the parameters, the digest reads them
    back through `to_host`, and the receiver never lands bytes in them."""
    real = delta_receiver._keeps_wire_bytes

    def as_if_on_gpu(target: Any, meta: Any, device_type: str = "cpu") -> bool:
        return device_type == "cuda" and real(target, meta, "cpu")

    read_back: list[int] = []

    def to_host(tensor: torch.Tensor) -> torch.Tensor:
        read_back.append(tensor.numel())
        return tensor

    monkeypatch.setattr(delta_receiver, "_keeps_wire_bytes", as_if_on_gpu)
    monkeypatch.setattr(delta_receiver, "to_host", to_host)
    model = _model()
    plan = _plan()
    target = ModelTarget.resolve(model, plan, None, in_place=False)
    delta = delta_receiver.WorkerDelta(plan)
    landing = delta.adapt(target)
    applied = delta.applied(landing)
    assert not any(landing.direct)  # a receiver lands nothing in a GPU parameter
    assert all(applied.direct)  # and the applier leaves them to the delta
    params = dict(model.named_parameters())
    bucket = plan.buckets[0]

    def segments() -> list[torch.Tensor]:
        """The bucket's payload as the model holds it, slice by slice."""
        return [
            params[plan.params[s.param].name]
            .detach()
            .reshape(-1)
            .view(torch.uint8)[s.start : s.start + s.nbytes]
            .clone()
            for s in bucket.slices
        ]

    def buffer_of(parts: list[torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(bucket.buffer_bytes, dtype=torch.uint8)
        for s, part in zip(bucket.slices, parts):
            out[s.offset : s.offset + s.nbytes] = part
        return out

    old = segments()
    # A full round: the bucket arrives in a buffer, this side copies it in.
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    run = delta.prepare(applied, ReceivedBucket(bucket, buffer_of(old), lambda: None))
    assert run is not None
    run()
    assert all(torch.equal(a, b) for a, b in zip(segments(), old))
    # A delta round: a few units changed.
    new = [part.clone() for part in old]
    for part in new:
        part[::256] += 1
    coded = encode(new, torch.cat(old), unit_of(bucket))
    assert isinstance(coded.body, bytes) and len(coded.body) < bucket.payload_bytes // 2
    body = torch.frombuffer(bytearray(coded.body), dtype=torch.uint8)
    run = delta.prepare(applied, ReceivedBucket(bucket, body, lambda: None, header=coded.header))
    assert run is not None
    run()
    assert all(torch.equal(a, b) for a, b in zip(segments(), new))
    assert delta.shadow_bytes == 0  # no host copy of the model
    assert sum(read_back) == bucket.payload_bytes  # the digest read the bucket once


# -- 11: staging allocated at init, in a thread -------------------------------------------


class _Transport(SenderTransport):
    own_staging = False

    def __init__(self) -> None:
        self.prepared_in: list[threading.Thread] = []
        self.closed = 0

    def prepare(self) -> None:
        self.prepared_in.append(threading.current_thread())

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: Any) -> None:
        return None

    @property
    def num_workers(self) -> int:
        return 1

    async def begin_round(self, round_id: int) -> None: ...

    async def send_bucket(self, bucket: Any, slot: int, segments: Any) -> None: ...

    async def end_round(self) -> None: ...

    async def abort_round(self, reason: str) -> None: ...

    def close(self) -> None:
        self.closed += 1


def _engine_class(transport: SenderTransport) -> type[PipelinedTrainerEngine[Any]]:
    backend = dataclasses.replace(TCP, sender=lambda info, plan, device: transport, fleet=None)
    return trainer_engine_class(backend, name="Engine", module=__name__)


@pytest.fixture
def staging_allocations(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, threading.Thread]]:
    """`staging_buffer` calls, by size and thread (a CPU buffer comes back)."""
    made: list[tuple[int, threading.Thread]] = []

    def staging_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
        made.append((nbytes, threading.current_thread()))
        return torch.zeros(nbytes, dtype=torch.uint8)

    monkeypatch.setattr(pipeline, "staging_buffer", staging_buffer)
    return made


@pytest.mark.asyncio
async def test_a_gpu_trainer_allocates_its_staging_at_init_in_a_thread(
    fake_cuda: _FakeCuda, staging_allocations: list[tuple[int, threading.Thread]]
) -> None:
    transport = _Transport()
    engine: Any = await _engine_class(transport).trainer_init(
        TcpTrainerInitInfo(rank=0, device="cuda:0", bucket_bytes=BUCKET_BYTES, num_buffers=3),
        client=_Client(),
        source=ModuleSource(_model()),
    )
    loop_thread = threading.current_thread()
    assert [n for n, _ in staging_allocations] == [BUCKET_BYTES] * 3  # every slot, at init
    assert all(thread is not loop_thread for _, thread in staging_allocations)
    assert len(transport.prepared_in) == 1 and transport.prepared_in[0] is not loop_thread
    assert engine._pool.allocated_bytes == 3 * BUCKET_BYTES
    await engine.shutdown()


@pytest.mark.asyncio
async def test_a_transport_that_stages_itself_leaves_the_pool_unallocated(
    fake_cuda: _FakeCuda, staging_allocations: list[tuple[int, threading.Thread]]
) -> None:
    transport = _Transport()
    transport.own_staging = True
    engine: Any = await _engine_class(transport).trainer_init(
        TcpTrainerInitInfo(rank=0, device="cuda:0", bucket_bytes=BUCKET_BYTES),
        client=_Client(),
        source=ModuleSource(_model()),
    )
    assert staging_allocations == [] and engine._pool.allocated_bytes == 0
    await engine.shutdown()


class _PackingSink:
    """A sink without staging of its own: every bucket is packed into the pool."""

    min_view_bytes = None
    in_flight_buckets = 1

    def staging(self, slot: int) -> None:
        return None

    async def reclaim(self, slot: int) -> None:
        return None

    async def send_bucket(self, bucket: Any, slot: int, segments: Any) -> None:
        return None


@pytest.mark.asyncio
async def test_a_pool_buffer_first_used_in_a_round_is_allocated_off_the_loop(
    staging_allocations: list[tuple[int, threading.Thread]],
) -> None:
    source = ModuleSource(_model())
    plan = TransferPlan.build(source.metadata, bucket_bytes=BUCKET_BYTES)
    cpu = torch.device("cpu")
    await run_pipeline(
        plan,
        source,
        _PackingSink(),  # type: ignore[arg-type]
        pool=StagingPool(2, plan.bucket_bytes, cpu),
        iterate_lane=DeviceLane(cpu),
        pack_lane=DeviceLane(cpu),
        config=PipelineConfig(num_buffers=2, zero_copy=False),
        fence=DeviceLane(cpu).record_caller(),
    )
    assert len(staging_allocations) == min(2, len(plan.buckets))  # one per slot used
    assert all(thread is not threading.current_thread() for _, thread in staging_allocations)


# -- 12: gloo staging pinned, the shm ring registered, for a GPU trainer -------------------


@pytest.fixture
def pinned_requests(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """`pin_memory` of every host allocation (granted as plain memory on this CPU build)."""
    asked: list[bool] = []
    real_empty = torch.empty

    def empty(*size: Any, **kwargs: Any) -> torch.Tensor:
        if "pin_memory" in kwargs:
            asked.append(bool(kwargs.pop("pin_memory")))
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    return asked


def test_gloo_staging_of_a_gpu_trainer_is_pinned_and_made_by_prepare(
    pinned_requests: list[bool],
) -> None:
    info = TorchDistTrainerInitInfo(rank=0, group_backend="gloo", num_buffers=2)
    sender = torch_dist.TorchDistSender(info, _plan(), torch.device("cuda", 0))
    try:
        assert sender.own_staging
        sender.prepare()
        assert pinned_requests == [True, True]
        assert all(b is not None for b in sender._staging)
    finally:
        sender.close()
    cpu_sender = torch_dist.TorchDistSender(info, _plan(), torch.device("cpu"))
    try:
        cpu_sender.prepare()
        assert pinned_requests[2:] == [False, False]  # a CPU trainer: nothing to pin for
    finally:
        cpu_sender.close()


def test_the_shm_ring_of_a_gpu_trainer_is_registered_until_close(
    fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    unmapped: list[int] = []
    real_close = shm_backend._memfd.AnonymousRing.close

    def close(ring: Any) -> None:
        unmapped.append(len(fake_cuda.log))
        real_close(ring)

    monkeypatch.setattr(shm_backend._memfd.AnonymousRing, "close", close)
    info = ShmTrainerInitInfo(rank=0, bucket_bytes=BUCKET_BYTES, num_buffers=2)
    sender = shm_backend.ShmSender(info, _plan(), torch.device("cuda", 0))
    try:
        sender.prepare()
        slots = [(b.data_ptr(), b.numel()) for b in sender.buffers]
        assert fake_cuda.log == [("register", p, n, 1) for p, n in slots]
    finally:
        sender.close()
    assert fake_cuda.log[2:] == [("unregister", p) for p, _ in slots]
    if unmapped:  # memfd ring: unmapped only once unregistered
        assert unmapped == [4]
    cpu = shm_backend.ShmSender(info, _plan(), torch.device("cpu"))
    cpu.prepare()
    cpu.close()
    assert len(fake_cuda.log) == 4  # a CPU trainer registers nothing


def test_a_ring_the_driver_will_not_register_stays_pageable_and_says_so(
    fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(fake_cuda.cudart, "cudaHostRegister", lambda pointer, nbytes, flags: 2)
    info = ShmTrainerInitInfo(rank=0, bucket_bytes=BUCKET_BYTES, num_buffers=2)
    sender = shm_backend.ShmSender(info, _plan(), torch.device("cuda", 0))
    try:
        with caplog.at_level(logging.WARNING, logger="asyncwt"):
            sender.prepare()
        assert sender.registration is None
        assert "the ring could not be registered with CUDA (cudaHostRegister of" in caplog.text
    finally:
        sender.close()
    assert fake_cuda.log == []  # nothing registered, nothing to unregister


# -- 13: every rank's stream waits for the round's lanes ----------------------------------


@pytest.mark.asyncio
async def test_a_non_sender_rank_ends_its_round_with_its_stream_waiting_on_the_lanes(
    fake_cuda: _FakeCuda,
) -> None:
    engine: Any = await trainer_init(
        TcpTrainerInitInfo(rank=1, device="cuda:0"), client=_Client(), source=ModuleSource(_model())
    )
    iterate, pack = engine._iterate_lane.stream, engine._pack_lane.stream
    caller = fake_cuda.current_stream()
    await engine.send_weights()
    # The caller's stream waits for what the round queued on the iterate lane (after
    # its collectives) and the pack lane: the next training step cannot overtake them.
    assert [e.stream for e in caller.waited] == [iterate, pack]
    assert iterate.waited and iterate.waited[0].stream is caller  # the fence, first
    await engine.shutdown()


def test_the_blocking_facade_joins_the_lanes_in_the_training_thread(
    fake_cuda: _FakeCuda,
) -> None:
    with SyncTrainerEngine(
        TcpTrainerInitInfo(rank=1, device="cuda:0"), client=_Client(), source=ModuleSource(_model())
    ) as facade:
        engine: Any = facade.engine
        caller = fake_cuda.current_stream()
        facade.send_weights()
        lanes_ = [engine._iterate_lane.stream, engine._pack_lane.stream]
        assert [e.stream for e in caller.waited] == lanes_
        # The loop thread's stream is not the one that trains: it waits for nothing.
        assert not any(s.waited for s in fake_cuda.currents if s is not caller)


# -- 14: no spinning waits, and no device-wide sync --------------------------------------


class _CudaLike:
    """A source tensor said to be on a GPU, read through a real CPU tensor."""

    is_cuda = True

    def __init__(self, data: torch.Tensor, log: list[tuple[Any, ...]]) -> None:
        self.data = data
        self.log = log

    def reshape(self, *shape: Any) -> torch.Tensor:
        self.log.append(("copy",))
        return self.data.reshape(*shape)

    def record_stream(self, stream: Any) -> None: ...


def test_a_copy_into_pageable_memory_first_sleeps_until_the_gathers_are_done(
    fake_cuda: _FakeCuda,
) -> None:
    lane = DeviceLane(torch.device("cuda", 0))
    gathers = fake_cuda.new_stream()
    ready = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
    ready.record(gathers)
    staging = torch.zeros(64, dtype=torch.uint8)
    data = torch.arange(64, dtype=torch.uint8)
    source = _CudaLike(data, fake_cuda.log)
    copies = [(Slice(param=0, start=0, nbytes=64, offset=0), source)]
    pipeline._copy_into_bulk(staging, copies, lane, ready)  # type: ignore[arg-type]
    assert lane.stream is not None
    assert lane.stream.waited == [ready, ready]  # the gathers, before the copies
    # The thread slept on the lane (past the gathers) before the copy that would spin.
    assert [entry[:2] for entry in fake_cuda.log] == [("sleep", lane.stream.name), ("copy",)]
    assert torch.equal(staging, data)


def test_closing_waits_only_for_the_lanes_asyncwt_owns(
    fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_ipc, "ring_block", lambda device, n: torch.empty(n, dtype=torch.uint8))
    monkeypatch.setattr(cuda_ipc, "_SHELF", {})
    info = cuda_ipc.CudaIpcTrainerInitInfo(rank=0, bucket_bytes=BUCKET_BYTES)
    sender = cuda_ipc.CudaIpcSender(info, _plan(), torch.device("cuda", 0))
    sender.close()
    nccl = torch_dist.TorchDistSender(
        TorchDistTrainerInitInfo(rank=0, group_backend="nccl"), _plan(), torch.device("cuda", 0)
    )
    nccl._staging[0] = torch.empty(8, dtype=torch.uint8)  # a round left device staging
    nccl.close()
    assert nccl._side is not None
    assert fake_cuda.log == [("sleep", nccl._side.name, threading.current_thread())]


@pytest.mark.asyncio
async def test_shutdown_sleeps_on_the_engines_lanes_then_closes_the_transport(
    fake_cuda: _FakeCuda, staging_allocations: list[tuple[int, threading.Thread]]
) -> None:
    transport = _Transport()
    engine: Any = await _engine_class(transport).trainer_init(
        TcpTrainerInitInfo(rank=0, device="cuda:0", bucket_bytes=BUCKET_BYTES),
        client=_Client(),
        source=ModuleSource(_model()),
    )
    await engine.shutdown()
    lanes_ = [engine._iterate_lane.stream.name, engine._pack_lane.stream.name]
    assert fake_cuda.sleeps() == lanes_ and transport.closed == 1
    assert not any(entry[0] == "DEVICE SYNC" for entry in fake_cuda.log)


def test_a_gpu_checksum_reads_through_pinned_memory_sleeping_on_its_stream(
    fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[dict[str, Any]] = []

    class Host:
        def copy_(self, src: Any, non_blocking: bool = False) -> None:
            copies.append({"non_blocking": non_blocking, "stream": fake_cuda.current_stream()})

    pinned: list[bool] = []

    def empty(shape: Any, dtype: Any = None, pin_memory: bool = False) -> Host:
        pinned.append(pin_memory)
        return Host()

    monkeypatch.setattr(torch, "empty", empty)
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), shape=(4,), dtype=torch.float32)
    out = cuda_sync.to_host(on_gpu)  # type: ignore[arg-type]
    assert isinstance(out, Host) and pinned == [True]
    assert copies == [{"non_blocking": True, "stream": fake_cuda.current_stream()}]
    assert fake_cuda.sleeps() == [fake_cuda.current_stream().name]  # slept, did not spin
    assert not any(entry[0] == "DEVICE SYNC" for entry in fake_cuda.log)
    monkeypatch.undo()
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(checksum, "to_host", lambda t: seen.append(t) or t, raising=False)
    checksum.model_checksum(_model())
    assert len(seen) == 4  # every parameter is read through `to_host`


def test_the_fake_cuda_restores_torch(fake_cuda: _FakeCuda) -> None:
    """Sanity of the fixture itself: the lane sees its streams and events."""
    lane = DeviceLane(torch.device("cuda", 0))
    event = lane.record()
    anyio.run(DeviceLane.wait, event)
    assert fake_cuda.sleeps() == [lane.stream.name]  # type: ignore[union-attr]
