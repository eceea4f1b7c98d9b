"""The GPU paths, round two (issue 33, findings 1-7), proved on the CPU as far as the
CPU can prove them.

CUDA streams and events are recording fakes here (`fake_cuda`): each stream has a
name, each thread a current stream (the default one until a `torch.cuda.stream`
block says otherwise), and every wait, record, synchronisation and copy lands in
one log, in order. NCCL is a recording fake of `ProcessGroupNCCL`. What these
cannot show (real kernels, real collectives) is checked on a GPU by
`scripts/_gpu_checks/findings_1_7.py` (`scripts/gpu-check`).
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, ClassVar

import anyio
import pytest
import torch

from asyncwt import Timeouts
from asyncwt._backends import torch_dist
from asyncwt._core.errors import TransferTimeoutError
from asyncwt._core.meta import ParamMeta, Shard
from asyncwt._core.owners import OwnersLayout, row_groups
from asyncwt._core.plan import Slice, TransferPlan
from asyncwt._core.source import ModuleSource
from asyncwt._transports.base import ReceivedBucket
from asyncwt._vllm import worker as vllm_worker
from asyncwt._worker import applier as applier_module
from asyncwt._worker.applier import DeferredApplier, ModelTarget
from asyncwt._worker.owners import OwnersReceiver

# -- a recording fake of torch.cuda ------------------------------------------------------


class _FakeCuda:
    """Streams, events and the current stream of each thread, logging what they do."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.local = threading.local()
        self.names = (f"stream{i}" for i in itertools.count(1))
        self.Stream = self._stream_class()
        self.Event = self._event_class()
        self.default = self.Stream(name="default")

    def current(self) -> Any:
        return getattr(self.local, "stream", self.default)

    def _stream_class(self) -> Any:
        cuda = self

        class Stream:
            def __init__(self, device: Any = None, *, name: str | None = None) -> None:
                self.device = torch.device("cuda", 0) if device is None else torch.device(device)
                self.name = name or next(cuda.names)

            def wait_stream(self, other: Any) -> None:
                cuda.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event: Any) -> None:
                cuda.log.append(("wait_event", self.name, event.stream))

            def synchronize(self) -> None:
                cuda.log.append(("synchronize", self.name))

            def query(self) -> bool:
                return True

        return Stream

    def _event_class(self) -> Any:
        cuda = self

        class Event:
            def __init__(self, **kwargs: Any) -> None:
                self.stream = "?"

            def record(self, stream: Any = None) -> None:
                self.stream = (stream or cuda.current()).name
                cuda.log.append(("record", self.stream))

            def synchronize(self) -> None:
                cuda.log.append(("event_synchronize", self.stream))

            def query(self) -> bool:
                return True

        return Event

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        saved = self.current()
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = saved


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    """torch.cuda as recording fakes; tensors asked for on a GPU are made on the CPU;
    every `Tensor.copy_` is logged with the stream current when it was queued."""
    cuda = _FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", cuda.Stream)
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: cuda.current())
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: cuda.default)
    real_zeros, real_copy = torch.zeros, torch.Tensor.copy_

    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return real_zeros(*size, **kwargs)

    def copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        cuda.log.append(("copy", cuda.current().name))
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch, "zeros", zeros)
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    return cuda


# -- a recording fake of ProcessGroupNCCL ------------------------------------------------


class _Work:
    def __init__(self, group: _FakeNccl) -> None:
        self.group = group

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.group.calls.append(("wait", timeout, _environment()))
        if self.group.fail_wait:
            raise RuntimeError("Work timed out in blocking wait")
        return True

    def is_completed(self) -> bool:
        return True


_NCCL_ENV = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def _environment() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in _NCCL_ENV}


class _FakeNccl:
    """Records its options, the environment it was made in, and every call."""

    made: ClassVar[list[_FakeNccl]] = []
    fail_wait = False
    init_blocks: threading.Event | None = None
    """Set: the first broadcast (where torch makes the communicator) blocks until set."""

    class Options:
        def __init__(self) -> None:
            self._timeout: datetime.timedelta | None = None
            self.config = SimpleNamespace(blocking="torch's default")

    def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
        self.options = options
        self.calls: list[tuple[Any, ...]] = [("made", _environment())]
        self.aborted = False
        _FakeNccl.made.append(self)

    def eager_connect_single_device(self, device: torch.device) -> None:
        self.calls.append(("eager_connect", device))

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> _Work:
        if self.init_blocks is not None:
            self.init_blocks.wait()
        self.calls.append(("broadcast", tensors[0].numel(), torch.cuda.current_stream().name))
        return _Work(self)

    def abort(self) -> None:
        self.aborted = True


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch, fake_cuda: _FakeCuda) -> type[_FakeNccl]:
    monkeypatch.setattr(torch.distributed, "ProcessGroupNCCL", _FakeNccl, raising=False)
    monkeypatch.setattr(_FakeNccl, "made", [])
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    return _FakeNccl


GPU = torch.device("cuda", 2)


# -- 1. the NCCL group: proved by a broadcast, its formation bounded -----------------------


def test_an_nccl_group_is_proved_by_a_one_element_broadcast_not_a_nonblocking_init(
    fake_nccl: type[_FakeNccl], fake_cuda: _FakeCuda
) -> None:
    group: Any = torch_dist._new_group("nccl", object(), 0, 2, 7.5, GPU)
    # torch's own communicator settings (a non-blocking init cannot be waited on from
    # Python), and no eager connect (it proves no peer alive).
    assert group.options.config.blocking == "torch's default"
    assert [c[0] for c in group.calls] == ["made", "broadcast", "wait"]
    assert group.calls[1][1] == 1  # one element
    assert group.calls[1][2] != "default"  # on a stream of its own
    assert group.calls[2][1] == datetime.timedelta(seconds=7.5)  # waited within the timeout
    assert not group.aborted
    with pytest.raises(ValueError, match=r"^device should be a CUDA device with its index"):
        torch_dist._new_group("nccl", object(), 0, 2, 7.5, torch.device("cuda"))


def test_a_probe_that_fails_releases_the_group_and_raises(
    fake_nccl: type[_FakeNccl], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_FakeNccl, "fail_wait", True)
    with pytest.raises(RuntimeError, match=r"^Work timed out in blocking wait$"):
        torch_dist._new_group("nccl", object(), 0, 2, 7.5, GPU)
    (group,) = fake_nccl.made
    assert group.aborted


def test_a_group_that_fails_to_form_fails_its_caller_with_its_own_error() -> None:
    def create() -> Any:
        raise RuntimeError("NCCL error: remote process exited")

    with pytest.raises(RuntimeError, match=r"^NCCL error: remote process exited$"):
        torch_dist._form_within(create, 5.0)


def _nccl_sender(timeout: float) -> torch_dist.TorchDistSender:
    model = torch.nn.Linear(4, 4)
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=4096)
    info = torch_dist.TorchDistTrainerInitInfo(
        rank=0, group_backend="nccl", timeouts=Timeouts(send=timeout), num_workers=1
    )
    sender = torch_dist.TorchDistSender(info, plan, GPU)
    sender.store = torch.distributed.HashStore()
    sender.group_key = "k" * 32
    return sender


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_a_peer_that_never_joins_fails_the_trainers_group_within_its_timeout(
    fake_nccl: type[_FakeNccl], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking communicator init has no timeout: formed in a shielded scope, it
    held the trainer for as long as the peer stayed away (here: until the test lets
    it go, 10 s later)."""
    blocked = threading.Event()
    monkeypatch.setattr(_FakeNccl, "init_blocks", blocked)
    monkeypatch.setattr(torch_dist, "FORM_GRACE_S", 0.0, raising=False)
    release = threading.Timer(10.0, blocked.set)
    release.start()
    sender = _nccl_sender(timeout=0.3)
    try:
        with pytest.raises(
            TransferTimeoutError, match=r"^the torch_dist group did not form within 0.3s"
        ):
            await sender._form_group()
        assert sender.group is None
        assert sender.store is None  # the group's key is spent: trainer_init again
    finally:
        release.cancel()
        blocked.set()
    (group,) = fake_nccl.made
    for _ in range(500):  # its thread returns now, and releases the group given up on
        if group.aborted:
            break
        await anyio.sleep(0.01)
    assert group.aborted


# -- 2. no environment variable set; every wait carries its timeout ------------------------


def test_making_and_using_the_group_leaves_the_environment_alone(
    fake_nccl: type[_FakeNccl],
) -> None:
    before = _environment()
    group: Any = torch_dist._new_group("nccl", object(), 0, 2, 7.5, GPU)
    assert before == {"TORCH_NCCL_BLOCKING_WAIT": None, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    environments = [call[-1] for call in group.calls if call[0] in ("made", "wait")]
    assert environments == [before, before]  # not even while the group was made
    # asyncwt's waits time out first: torch's watchdog (the process's settings) later.
    assert group.options._timeout == datetime.timedelta(seconds=7.5 + torch_dist.WATCHDOG_MARGIN_S)
    works: list[Any] = [_Work(group), _Work(group)]
    torch_dist._wait_all(works, None, 3.0)
    assert [c[1] for c in group.calls[-2:]] == [datetime.timedelta(seconds=3.0)] * 2


@pytest.mark.parametrize(
    ("environ", "tears_down"),
    [
        ({}, True),  # torch's default: the watchdog kills the process on a failure
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, True),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, False),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}, False),
        ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, False),  # no watchdog at all
        ({"TORCH_NCCL_BLOCKING_WAIT": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, True),
    ],
)
def test_which_process_settings_let_the_watchdog_tear_the_process_down(
    environ: dict[str, str], tears_down: bool
) -> None:
    assert torch_dist.watchdog_may_tear_down(environ) is tears_down


def test_a_process_that_a_peers_failure_could_kill_is_told_once_how_to_start(
    fake_nccl: type[_FakeNccl],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(torch_dist, "_TEARDOWN_WARNED", threading.Event())
    with caplog.at_level("WARNING", logger="asyncwt"):
        torch_dist._new_group("nccl", object(), 0, 2, 7.5, GPU)
        torch_dist._new_group("nccl", object(), 0, 2, 7.5, GPU)
    (record,) = caplog.records
    assert "started without TORCH_NCCL_BLOCKING_WAIT=1" in record.getMessage()
    monkeypatch.setattr(torch_dist, "_TEARDOWN_WARNED", threading.Event())
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncwt"):
        torch_dist._new_group("nccl", object(), 0, 2, 7.5, GPU)
    assert not caplog.records


# -- 3. broadcasts start on the side stream ---------------------------------------------------


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_the_trainers_broadcasts_start_and_are_waited_for_on_the_side_stream(
    fake_nccl: type[_FakeNccl], fake_cuda: _FakeCuda
) -> None:
    sender = _nccl_sender(timeout=4.0)
    group = _FakeNccl(None, 0, 2, None)
    sender.group = group  # type: ignore[assignment]
    staging = torch.zeros(sender.plan.bucket_bytes, dtype=torch.uint8)
    sender._staging = [staging, staging]

    async def each(send: Any, *args: Any) -> None:
        return None

    sender.links = SimpleNamespace(  # type: ignore[assignment]
        frame=lambda *a, **k: None, each=each, send_header=None, round_id=1
    )
    bucket = sender.plan.buckets[0]
    settle = await sender.send_bucket(bucket, 0, [staging[:1]] * len(bucket.slices))
    await settle()
    side = sender._side
    assert side is not None
    broadcasts = [c for c in group.calls if c[0] == "broadcast"]
    assert broadcasts and all(c[2] == side.name for c in broadcasts)  # never "default"
    waits = [c for c in group.calls if c[0] == "wait"]
    assert waits and all(c[1] == datetime.timedelta(seconds=4.0) for c in waits)
    assert ("event_synchronize", side.name) in fake_cuda.log  # the host waited for them


def test_the_workers_broadcasts_start_on_the_side_stream(
    fake_nccl: type[_FakeNccl], fake_cuda: _FakeCuda
) -> None:
    model = torch.nn.Linear(8, 8)
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=4096)
    receiver = object.__new__(torch_dist.TorchDistReceiver)
    receiver.info = SimpleNamespace(direct_bytes=None, recv_timeout=6.0)  # type: ignore[assignment]
    receiver.group = group = _FakeNccl(None, 1, 2, None)  # type: ignore[assignment]
    receiver._side = side = fake_cuda.Stream(GPU, name="side")
    buffer = torch.zeros(plan.bucket_bytes, dtype=torch.uint8)
    target: Any = SimpleNamespace(direct=[False] * len(plan.params))
    incoming = receiver._start_bucket(plan.buckets[0], buffer, lambda: None, target)
    incoming.finish(target)
    assert [c[2] for c in group.calls if c[0] == "broadcast"] == ["side"]
    assert [c[1] for c in group.calls if c[0] == "wait"] == [datetime.timedelta(seconds=6.0)]
    assert ("event_synchronize", side.name) in fake_cuda.log


# -- 4. a parameter larger than a bucket is reassembled where it arrived -------------------


def test_a_chunked_parameter_is_reassembled_on_the_receive_buffers_device() -> None:
    """`meta` stands in for a GPU (no bytes on the host): a reassembly buffer on the
    host could not even take the chunks. The buffer is kept for the next round."""
    model = torch.nn.Linear(64, 64, bias=False).to("meta")
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=4096)
    assert len(plan.buckets) == 4  # 16 KiB in 4 chunks
    seen: list[torch.device] = []

    def whole_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tensor.device)
        return tensor

    target = ModelTarget.resolve(model, plan, whole_tensor, in_place=False)
    applier = DeferredApplier(1)
    spares = []
    try:
        for round_id in (1, 2):
            for bucket in plan.buckets:
                buffer = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device="meta")
                applier.submit(target, round_id, bucket, buffer, lambda: None)
            applier.drain(timeout=30)
            spares.append(applier._spare[(plan.params[0].nbytes, torch.device("meta"))])
    finally:
        applier.shutdown()
    assert seen == [torch.device("meta")] * 2
    assert spares[0] == spares[1] and len(spares[0]) == 1  # one buffer, reused


# -- 5. vLLM's own copy: pinned host memory, after vLLM's stream ----------------------------


def test_vllms_own_copy_is_pinned_and_ordered_after_vllms_stream(
    fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned: list[bool] = []
    real_empty = torch.empty

    def empty(*size: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        pinned.append(pin_memory)
        return real_empty(*size, **kwargs)  # no pinned memory without a GPU

    monkeypatch.setattr(torch, "empty", empty)
    received = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    apply_stream = fake_cuda.Stream(name="apply")
    with fake_cuda.stream(apply_stream):
        copy = vllm_worker._own_copy("w", received)
    assert pinned == [True]
    assert torch.equal(copy, received) and copy.data_ptr() != received.data_ptr()
    assert fake_cuda.log == [("wait_stream", "apply", "default"), ("copy", "apply")]


def test_vllms_own_copy_is_a_plain_clone_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    received = torch.arange(4.0)
    copy = vllm_worker._own_copy("w", received)
    assert torch.equal(copy, received) and copy.data_ptr() != received.data_ptr()


# -- 6. a staged commit is over before the round is published -------------------------------


def test_a_staged_commit_returns_only_once_its_copies_are_done(
    fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=4096)
    from asyncwt._core.lanes import DeviceLane as real_lane

    # The model's device as a GPU: the lane's stream is a fake one named "commit".
    monkeypatch.setattr(applier_module, "DeviceLane", lambda device: real_lane(GPU), raising=False)
    target = ModelTarget.resolve(model, plan, None, staged=True)
    assert target.commit is not None
    for shadow in target.params.values():
        shadow.fill_(7.0)
    fake_cuda.log.clear()
    target.commit()
    streams = {entry[1] for entry in fake_cuda.log if entry[0] == "copy"}
    assert len(streams) == 1 and streams != {"default"}  # a stream of its own
    (stream,) = streams
    copies = [("copy", stream)] * len(plan.params)
    assert fake_cuda.log == [
        ("wait_stream", stream, "default"),  # after what the caller queued
        *copies,
        ("record", stream),
        ("event_synchronize", stream),  # and over before commit returns
    ]
    assert all(bool((p == 7.0).all()) for p in model.parameters())


# -- 7. a Shard(1) block lands in one strided copy, not one per row -------------------------


class _Plain(torch.nn.Module):
    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(shape))


class _Loader(_Plain):
    """A model that takes whole tensors by name (as vLLM's do)."""

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            getattr(self, name).data.copy_(tensor)


ROWS, COLS = 3000, 50


@pytest.mark.parametrize("loader", [False, True], ids=["chunks-land", "reassembled"])
def test_a_shard1_block_lands_in_a_few_strided_copies_not_one_per_row(
    loader: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = torch.randn(ROWS, COLS)
    meta = ParamMeta("w", torch.float32, (ROWS, COLS), owners=(0, 1), placements=(Shard(1),))
    plan = TransferPlan.build([meta], bucket_bytes=1 << 16)  # rows of 100 B: cut mid-row
    layout = OwnersLayout.build(plan, 2)
    receiver = OwnersReceiver.of_shares(layout, [])
    model = _Loader((ROWS, COLS)) if loader else _Plain((ROWS, COLS))
    target = ModelTarget.resolve(model, plan, None, in_place=False)
    received = []
    share_slices = 0
    for rank in (0, 1):
        (piece,) = layout.pieces[rank]
        box = tuple(slice(s, s + n) for s, n in zip(piece.box.start, piece.box.size))
        piece_bytes = full[box].contiguous().view(-1).view(torch.uint8)
        for bucket in layout.share_plans[rank].buckets:
            buffer = torch.zeros(plan.bucket_bytes, dtype=torch.uint8)
            for s in bucket.slices:
                buffer[s.offset : s.offset + s.nbytes] = piece_bytes[s.start : s.end]
                share_slices += 1
            received.append(receiver._translate(rank, ReceivedBucket(bucket, buffer, _noop)))
    rows_sent = sum(len(r.bucket.slices) for r in received)
    assert rows_sent >= 2 * ROWS  # a slice per row (two ranks): what used to be a copy each
    copies = [0]
    real_copy = torch.Tensor.copy_

    def counting(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        copies[0] += 1
        return real_copy(self, src, non_blocking)

    applier = DeferredApplier(1)
    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    try:
        for r in received:
            applier.submit(target, 1, r.bucket, r.buffer, r.release)
        applier.drain(timeout=60)
    finally:
        monkeypatch.undo()
        applier.shutdown()
    assert torch.equal(model.w.data, full)
    # A share slice is at most a partial row, a block of whole rows and a partial
    # row: three copies; then one more to load the reassembled tensor.
    assert copies[0] <= 3 * share_slices + 1, (copies[0], share_slices)


def _noop() -> None:
    return None


def test_row_groups_finds_blocks_of_rows_and_nothing_else() -> None:
    def rows(start: int, count: int, nbytes: int, stride: int, offset: int) -> list[Slice]:
        return [Slice(0, start + i * stride, nbytes, offset + i * nbytes) for i in range(count)]

    block = rows(40, 5, 8, 20, 0)
    assert row_groups(block) == [(0, 5, 20)]
    head = [Slice(0, 4, 4, 0)]  # a partial row before the block
    tail = [Slice(0, 140, 3, 44)]
    assert row_groups(head + rows(20, 5, 8, 20, 4) + tail) == [(0, 1, 0), (1, 5, 20), (6, 1, 0)]
    other = [Slice(1, 0, 8, 40)]  # another parameter
    assert row_groups([*block, *other]) == [(0, 5, 20), (5, 1, 0)]
    overlapping = rows(0, 3, 8, 4, 0)  # rows closer than their length are no block
    assert row_groups(overlapping) == [(0, 1, 0), (1, 1, 0), (2, 1, 0)]
    assert row_groups([None, *block[:2], None]) == [(0, 1, 0), (1, 2, 20), (3, 1, 0)]
    assert row_groups([]) == []
