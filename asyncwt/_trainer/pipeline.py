"""The trainer's round pipeline: iterate → pack → send, joined by bounded channels.

- *iterate* runs the source in a worker thread (it may run collectives and device
  work), checks every yield against the plan, and hands out one `_Work` per bucket
  as soon as every tensor the bucket needs has been yielded;
- *pack* takes a slot from a fixed pool (`num_buffers` of them: the backpressure)
  and turns the work into segments: byte ranges (1-D uint8 tensors) of the source's
  tensors or of a staging buffer, on the host or on a GPU. A contiguous CPU tensor
  is sent in place (no copy); anything else is copied into the slot's staging
  buffer on the pack lane, whose event the next stage waits for. A copy the device
  runs on its own (into device or pinned memory) is queued from the loop; any other
  (a CPU copy, or a device-to-host copy into pageable memory, which waits for the
  device) runs on a thread, so the loop never blocks on it;
- *send* waits for that event without blocking the loop, hands the segments to the
  sink (the transport), then returns the slot. A sink may leave a bucket in flight
  (`send_bucket` returns a `Settle`): its slot and its tensors are then held until
  it settles, and the next bucket goes out meanwhile (`in_flight_buckets`).

One task group owns the three stages: the first failure or a cancellation cancels
the others and re-raises. Slots are per round, so nothing stays held afterwards.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass

import anyio
import anyio.to_thread
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._core.concurrency import single_error
from .._core.errors import SourceMismatchError
from .._core.lanes import DeviceLane, LaneEvent, staging_buffer
from .._core.plan import Bucket, Slice, TransferPlan
from .._core.sched import bulk_work, prompt_wakeups
from .._core.source import WeightSource
from .._core.stats import Progress, StageClock
from .._transports.base import Segment, SenderTransport, Settle

__all__ = [
    "PipelineConfig",
    "StagingPool",
    "iterate_and_check",
    "run_pipeline",
]


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """How the pipeline runs; fixed for an engine's lifetime."""

    num_buffers: int = 2
    """Buckets in flight between pack and send (each may hold one staging buffer)."""
    zero_copy: bool = True
    """Send contiguous CPU tensors in place instead of packing them."""
    read_ahead: int = 4
    """Buckets the iterate stage may run ahead of the pack stage
    (`Tuning.read_ahead`)."""


class StagingPool:
    """`num_buffers` bucket-sized host buffers, kept for reuse.

    Allocating one (pinned where a GPU is involved) and faulting its pages in takes
    a while for a large bucket, so it never happens on the event loop: `allocate`
    (at init, in a thread, for a GPU trainer) or `ensure` (first use, in a thread).
    """

    def __init__(self, count: int, nbytes: int, device: torch.device) -> None:
        self.count = count
        self.nbytes = nbytes
        self.device = device
        self._buffers: list[torch.Tensor | None] = [None] * count

    def buffer(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s buffer, allocated here if it is not yet (blocking: see `ensure`)."""
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = self._buffers[slot] = staging_buffer(self.nbytes, self.device)
        return buffer

    async def ensure(self, slot: int) -> torch.Tensor:
        """Slot `slot`'s buffer; a first allocation runs in a thread, not on the loop."""
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = await anyio.to_thread.run_sync(self.buffer, slot)
        return buffer

    def allocate(self) -> None:
        """Allocate every slot now (blocking: call it in a thread)."""
        for slot in range(self.count):
            self.buffer(slot)

    @property
    def allocated_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers if b is not None)


class _Handoff:
    """Work from the iterate thread to the pack stage, without waiting for the loop.

    `from_thread.run(stream.send, work)` holds the thread until the event loop runs
    the call, and a loop busy pushing a large bucket into a socket answers late: a
    gathering source would stall for nothing. Here the thread waits only for room
    (at most `read_ahead` buckets handed out and not yet taken by the pack stage) and queues the delivery on the loop, which runs
    such callbacks in order, and before it learns that the thread has returned.
    """

    def __init__(
        self,
        stream: MemoryObjectSendStream[_Work],
        read_ahead: int,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._stream = stream
        self._loop = loop
        self._room = threading.Semaphore(read_ahead)
        self._closed = threading.Event()

    def put(self, work: _Work, stop: threading.Event) -> bool:
        """Thread side: hand `work` over; False once the pipeline is stopping."""
        while not self._room.acquire(timeout=0.05):
            if stop.is_set() or self._closed.is_set():
                return False
        if stop.is_set() or self._closed.is_set():
            return False
        self._loop.call_soon_threadsafe(self._deliver, work)
        return True

    def _deliver(self, work: _Work) -> None:
        try:
            self._stream.send_nowait(work)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass  # the pack stage is gone: the pipeline is stopping

    def taken(self) -> None:
        """Loop side: the pack stage took one bucket, so there is room for another."""
        self._room.release()

    def close(self) -> None:
        """Loop side: the pack stage stopped; a waiting thread gives up."""
        self._closed.set()
        self._room.release()


@dataclass
class _Work:
    bucket: Bucket
    tensors: list[torch.Tensor]
    """One contiguous tensor per slice of the bucket."""
    ready: LaneEvent
    """Recorded on the iterate lane after the bucket's last tensor was produced."""


@dataclass
class _Packed:
    bucket: Bucket
    segments: list[Segment]
    slot: int
    ready: LaneEvent
    keepalive: _Work


def _check_yield(
    plan: TransferPlan, expected: list[int], pos: int, name: str, tensor: object
) -> int:
    """Return the plan index of the parameter at `pos`, or raise `SourceMismatchError`."""
    if pos >= len(expected):
        raise SourceMismatchError(
            f"source yielded {name!r} at index {pos}, after all {len(expected)} expected "
            f"parameters; expected the iteration to end"
        )
    meta = plan.params[expected[pos]]
    if name != meta.name:
        raise SourceMismatchError(
            f"source yielded {name!r} at index {pos}, expected {meta.name!r} "
            f"(parameters must come in metadata order)"
        )
    if not isinstance(tensor, torch.Tensor):
        raise SourceMismatchError(
            f"parameter {name!r} (index {pos}): expected a torch.Tensor, got {type(tensor).__name__}"
        )
    if tensor.dtype != meta.dtype:
        raise SourceMismatchError(
            f"parameter {name!r} (index {pos}): dtype should be {meta.dtype}, got {tensor.dtype}"
        )
    if tuple(tensor.shape) != meta.shape:
        raise SourceMismatchError(
            f"parameter {name!r} (index {pos}): shape should be {meta.shape}, "
            f"got {tuple(tensor.shape)}"
        )
    return expected[pos]


def _check_end(plan: TransferPlan, expected: list[int], pos: int) -> None:
    if pos < len(expected):
        missing = plan.params[expected[pos]].name
        raise SourceMismatchError(
            f"source stopped after {pos} parameters, expected {len(expected)}; "
            f"first missing: {missing!r} (index {pos})"
        )


def _iter_pairs(source: WeightSource) -> Generator[tuple[str, torch.Tensor], None, None]:
    with torch.no_grad():
        yield from source.iter_full()


def iterate_and_check(
    plan: TransferPlan,
    expected: list[int],
    source: WeightSource,
    lane: DeviceLane,
    fence: LaneEvent,
) -> None:
    """Run a full pass of `source.iter_full()` and check it, keeping nothing.

    What non-sender ranks do: their collectives must line up with the sender's, and
    like the sender they read the weights only after `fence` (the training step).
    """
    pairs = _iter_pairs(source)
    pos = 0
    try:
        with lane.activate(), prompt_wakeups():
            lane.wait_on(fence)
            for name, tensor in pairs:
                _check_yield(plan, expected, pos, name, tensor)
                pos += 1
        _check_end(plan, expected, pos)
    finally:
        pairs.close()


def _iterate(
    plan: TransferPlan,
    source: WeightSource,
    lane: DeviceLane,
    out: _Handoff,
    stop: threading.Event,
    clock: StageClock,
    fence: LaneEvent,
) -> None:
    """The iterate stage's thread body: yield → check → group by bucket → hand out."""
    expected = list(range(len(plan.params)))
    held: dict[int, torch.Tensor] = {}
    next_bucket = 0
    pos = 0
    pairs = _iter_pairs(source)
    try:
        with lane.activate(), prompt_wakeups():
            lane.wait_on(fence)  # the weights as of the send_weights call
            clock.start()
            for name, tensor in pairs:
                if stop.is_set():
                    return
                index = _check_yield(plan, expected, pos, name, tensor)
                pos += 1
                held[index] = tensor.detach().contiguous()
                while (
                    next_bucket < len(plan.buckets)
                    and plan.buckets[next_bucket].slices[-1].param <= index
                ):
                    bucket = plan.buckets[next_bucket]
                    work = _Work(bucket, [held[s.param] for s in bucket.slices], lane.record())
                    next_bucket += 1
                    for s in bucket.slices:
                        if plan.param_buckets[s.param][-1] == bucket.index:
                            held.pop(s.param, None)
                    clock.stop()
                    if not out.put(work, stop):
                        return
                    clock.start()
            _check_end(plan, expected, pos)
            clock.stop()
    finally:
        pairs.close()
        clock.stop()


def _tensor_bytes(tensor: torch.Tensor, s: Slice) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)[s.start : s.end]


def _copy_into(
    staging: torch.Tensor,
    copies: list[tuple[Slice, torch.Tensor]],
    lane: DeviceLane,
    ready: LaneEvent,
) -> LaneEvent:
    """Copy each slice's bytes into its offset of `staging` on the pack lane."""
    with lane.activate():
        lane.wait_on(ready)
        for s, tensor in copies:
            staging[s.offset : s.offset + s.nbytes].copy_(
                _tensor_bytes(tensor, s), non_blocking=lane.is_async
            )
            if tensor.is_cuda and lane.stream is not None:
                tensor.record_stream(lane.stream)
        return lane.record()


def _copy_into_bulk(
    staging: torch.Tensor,
    copies: list[tuple[Slice, torch.Tensor]],
    lane: DeviceLane,
    ready: LaneEvent,
) -> LaneEvent:
    """`_copy_into` on a pack thread, as bulk work (see `asyncwt._core.sched`).

    A device-to-host copy into pageable memory holds this thread in the driver,
    spinning, until the lane reaches it, which is after the gathers `ready` marks:
    the thread first sleeps until the lane has nothing left ahead of the copy.
    """
    if lane.is_async and any(tensor.is_cuda for _, tensor in copies):
        with lane.activate():
            lane.wait_on(ready)
        lane.drain()
    with bulk_work():
        return _copy_into(staging, copies, lane, ready)


def _runs_on_device(
    staging: torch.Tensor, copies: list[tuple[Slice, torch.Tensor]], lane: DeviceLane
) -> bool:
    """Whether queuing these copies returns at once, the device doing them later:
    device tensors into device or pinned host memory, on an asynchronous lane.
    A CPU copy, and a device-to-host copy into pageable memory (which waits for
    the device), hold the calling thread instead."""
    if not lane.is_async or not all(tensor.is_cuda for _, tensor in copies):
        return False
    return staging.is_cuda or staging.is_pinned()


async def _pack(
    inbox: MemoryObjectReceiveStream[_Work],
    handoff: _Handoff,
    outbox: MemoryObjectSendStream[_Packed],
    free_slots: MemoryObjectReceiveStream[int],
    pool: StagingPool,
    sink: SenderTransport,
    lane: DeviceLane,
    zero_copy: bool,
    clock: StageClock,
    opened: anyio.Event | None,
) -> None:
    try:
        async with inbox, outbox:
            if opened is not None:
                await opened.wait()  # the sink may be touched only once the round is open
            min_view = sink.min_view_bytes if zero_copy else None  # may depend on the round
            await _pack_each(inbox, handoff, outbox, free_slots, pool, sink, lane, min_view, clock)
    finally:
        handoff.close()


async def _pack_each(
    inbox: MemoryObjectReceiveStream[_Work],
    handoff: _Handoff,
    outbox: MemoryObjectSendStream[_Packed],
    free_slots: MemoryObjectReceiveStream[int],
    pool: StagingPool,
    sink: SenderTransport,
    lane: DeviceLane,
    min_view: int | None,
    clock: StageClock,
) -> None:
    async for work in inbox:
        handoff.taken()
        slot = await free_slots.receive()
        clock.start()
        segments: list[Segment] = []
        copies: list[tuple[Slice, torch.Tensor]] = []
        staging: torch.Tensor | None = None
        for s, tensor in zip(work.bucket.slices, work.tensors):
            if min_view is not None and s.nbytes >= min_view and tensor.device.type == "cpu":
                segments.append(_tensor_bytes(tensor, s))
                continue
            if staging is None:
                clock.stop()
                await sink.reclaim(slot)
                clock.start()
                staging = sink.staging(slot)
                if staging is None:
                    staging = await pool.ensure(slot)
            copies.append((s, tensor))
            segments.append(staging[s.offset : s.offset + s.nbytes])
        ready = work.ready
        if copies and staging is not None:
            if _runs_on_device(staging, copies, lane):
                ready = _copy_into(staging, copies, lane, work.ready)
            else:
                ready = await anyio.to_thread.run_sync(
                    functools.partial(_copy_into_bulk, staging, copies, lane, work.ready)
                )
        clock.stop()
        try:
            await outbox.send(_Packed(work.bucket, segments, slot, ready, work))
        except anyio.BrokenResourceError:
            return  # the send stage failed; its error is the one that counts


async def _send(
    inbox: MemoryObjectReceiveStream[_Packed],
    release: MemoryObjectSendStream[int],
    sink: SenderTransport,
    clock: StageClock,
    window: int,
    sent_bytes: Callable[[int], None] | None = None,
) -> int:
    """Send each bucket; keep fewer than `window` in flight while the next is packed.

    `sent_bytes` is told each bucket's payload bytes once the sink took them.

    Every bucket left in flight is settled, once, before this returns, even on an
    error or a cancellation: its bytes may be read until it settles, so settling is
    shielded (the sink bounds it with its own timeouts).
    """
    sent = 0
    in_flight: collections.deque[tuple[Settle, _Packed]] = collections.deque()

    async def settle_oldest() -> None:
        settle, packed = in_flight[0]
        try:
            with anyio.CancelScope(shield=True):  # a cancellation takes effect after it
                await settle()
        finally:
            in_flight.popleft()
        release.send_nowait(packed.slot)

    try:
        async with inbox:
            async for packed in inbox:
                await DeviceLane.wait(packed.ready)
                clock.start()
                settle = await sink.send_bucket(packed.bucket, packed.slot, packed.segments)
                if settle is None:
                    release.send_nowait(packed.slot)
                else:
                    in_flight.append((settle, packed))
                    while len(in_flight) >= window:
                        await settle_oldest()
                clock.stop()
                sent += 1
                if sent_bytes is not None:
                    sent_bytes(packed.bucket.payload_bytes)
            clock.start()
            while in_flight:
                await settle_oldest()
            clock.stop()
    finally:
        with anyio.CancelScope(shield=True):
            for settle, _ in in_flight:
                with contextlib.suppress(Exception):  # the round failed already
                    await settle()
    return sent


def _progress_counter(plan: TransferPlan, progress: Progress) -> Callable[[int], None]:
    """Turn each bucket's bytes into `progress(sent so far, total)` calls."""
    total = sum(bucket.payload_bytes for bucket in plan.buckets)
    sent = 0

    def add(nbytes: int) -> None:
        nonlocal sent
        sent += nbytes
        progress(sent, total)

    return add


async def run_pipeline(
    plan: TransferPlan,
    source: WeightSource,
    sink: SenderTransport,
    *,
    pool: StagingPool,
    iterate_lane: DeviceLane,
    pack_lane: DeviceLane,
    config: PipelineConfig,
    fence: LaneEvent,
    opened: anyio.Event | None = None,
    progress: Progress | None = None,
) -> dict[str, float]:
    """Stream every bucket of `plan` from `source` into `sink`; return stage busy seconds.

    `progress(sent, total)`, where given, is called on the loop after each bucket the
    sink took, with the payload bytes sent so far and in all (see `Progress`).

    The source is read only after `fence` (the caller's training step, see
    `PipelinedTrainerEngine.fence`), on the device.

    With `opened`, the source is iterated at once but the sink is used only once the
    event is set: the caller opens the round on the transport meanwhile, and the
    first gathers (at most `read_ahead` buckets of them) overlap that round trip.

    Cancellation: every stage stops; the iterate thread stops at its next yield (a
    running collective finishes first); buckets already handed to the sink are
    the sink's business (the caller aborts the round on the transport).
    """
    clocks = {name: StageClock() for name in ("iterate", "pack", "send")}
    work_send, work_recv = anyio.create_memory_object_stream[_Work](config.read_ahead)
    packed_send, packed_recv = anyio.create_memory_object_stream[_Packed](config.num_buffers)
    slot_send, slot_recv = anyio.create_memory_object_stream[int](config.num_buffers)
    for slot in range(config.num_buffers):
        slot_send.send_nowait(slot)
    stop = threading.Event()
    handoff = _Handoff(work_send, config.read_ahead, asyncio.get_running_loop())

    async def iterate() -> None:
        async with work_send:
            try:
                await anyio.to_thread.run_sync(
                    _iterate,
                    plan,
                    source,
                    iterate_lane,
                    handoff,
                    stop,
                    clocks["iterate"],
                    fence,
                )
            finally:
                stop.set()

    with single_error(), slot_send, slot_recv:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(iterate)
                tg.start_soon(
                    _pack,
                    work_recv,
                    handoff,
                    packed_send,
                    slot_recv,
                    pool,
                    sink,
                    pack_lane,
                    config.zero_copy,
                    clocks["pack"],
                    opened,
                )
                window = min(sink.in_flight_buckets, config.num_buffers)
                tg.start_soon(
                    _send,
                    packed_recv,
                    slot_send,
                    sink,
                    clocks["send"],
                    window,
                    None if progress is None else _progress_counter(plan, progress),
                )
        finally:
            stop.set()
    return {name: clock.busy_s for name, clock in clocks.items()}
