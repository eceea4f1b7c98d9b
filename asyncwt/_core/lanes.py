"""Device lanes: one stream per pipeline stage, on a GPU and (as no-ops) on the CPU.

A lane owns a stream created once per engine (per-call streams strand allocator
memory). Work enqueued inside `lane.activate()` runs on it; `lane.record()` marks
the point a later stage must wait for, and `await lane.wait(event)` waits without
blocking the event loop. On the CPU work is synchronous, so an event is complete
the moment it is recorded and the same code path costs nothing.

Every CUDA event here is made with `blocking=True`: a host that waits for it
sleeps in the driver instead of spinning a core (a spin per bucket would take a
core from the trainer for the whole round). `lane.device` always has its index
(see `asyncwt._core.device`), so the events and streams belong to the right GPU whatever
thread records or waits on them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import anyio
import anyio.to_thread
import torch

from .cuda_sync import blocking_event, wait_for_stream

__all__ = ["DeviceLane", "LaneEvent", "blocking_event", "staging_buffer", "wait_for_stream"]


class LaneEvent(Protocol):
    """What a lane's `record()` returns: something that can be queried and waited on."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _DoneEvent:
    """The CPU's event: complete when recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


_DONE = _DoneEvent()


class DeviceLane:
    """An ordered queue of device work: a CUDA stream on a GPU, nothing on the CPU."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            if self.device.index is None:
                raise ValueError(
                    f"device should be a CUDA device with its index (see resolve_device), "
                    f"got {self.device}"
                )
            self.stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]

    @property
    def is_async(self) -> bool:
        """Whether work on this lane completes later than it is enqueued."""
        return self.stream is not None

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Make this lane's stream current for the enclosed work (this thread only)."""
        if self.stream is None:
            yield
        else:
            with torch.cuda.stream(self.stream):
                yield

    def record(self) -> LaneEvent:
        """Mark everything enqueued on the lane so far."""
        if self.stream is None:
            return _DONE
        event = blocking_event()
        event.record(self.stream)
        return event

    def record_caller(self) -> LaneEvent:
        """Mark the work the calling thread has enqueued on its current stream so far
        (e.g. the optimizer step), for this lane to wait on before reading weights."""
        if self.stream is None:
            return _DONE
        event = blocking_event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def join_caller(self) -> None:
        """Make later work on the calling thread's current stream wait for everything
        enqueued on this lane so far (device-side, no host block): the training step
        after a round must not overwrite weights a lane still reads."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(self.record())  # type: ignore[arg-type]

    def drain(self) -> None:
        """Block this thread, sleeping, until the lane's queued work is done (this
        lane only: other streams of the device, the trainer's included, run on)."""
        if self.stream is not None:
            wait_for_stream(self.stream)

    def wait_on(self, event: LaneEvent) -> None:
        """Make later work on this lane wait for `event` (device-side, no host block)."""
        if self.stream is not None and isinstance(event, torch.cuda.Event):
            self.stream.wait_event(event)

    @staticmethod
    async def wait(event: LaneEvent) -> None:
        """Wait for `event` without blocking the loop.

        Cancellation: safe; the device work still completes, only the wait stops.
        """
        if event.query():
            return
        await anyio.to_thread.run_sync(event.synchronize, abandon_on_cancel=True)


def staging_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A host buffer for device↔socket staging: pinned when a GPU is involved."""
    pin = device.type == "cuda"
    buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    buffer.zero_()  # fault the pages in now, not during the first round
    return buffer
