"""The receive buffer pool: bucket-sized buffers a receiver lands buckets in.

Below both engines and every backend (the worker engine sizes it, a backend's
receiver takes from it), so it lives with the transport interface.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

import torch

from .._core.bytes import byte_view
from .._core.errors import TransferError, TransferTimeoutError
from .._core.lanes import staging_buffer
from .._core.plan import Bucket
from .base import LandingTarget

__all__ = ["ReceivePool"]


class ReceivePool:
    """`count` bucket-sized receive buffers; a buffer is reused only once released.

    Device buffers are allocated at once (during init): on a GPU that serves
    inference the memory left after the server's own reservation may be short,
    and that should fail the init, saying how much was asked for, not a round.
    Host buffers come on first use.
    """

    def __init__(
        self, count: int, nbytes: int, device: torch.device, timeout: float, *, on_device: bool
    ) -> None:
        self.nbytes = nbytes
        self.device = device
        self.on_device = on_device
        self.timeout = timeout
        self._buffers: list[torch.Tensor] = []
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for slot in range(count):
            self._free.put(slot)
        if on_device:
            try:
                while len(self._buffers) < count:
                    self._buffers.append(torch.empty(nbytes, dtype=torch.uint8, device=device))
            except torch.OutOfMemoryError as exc:
                self._buffers = []
                raise TransferError(
                    f"the receive buffers ({count} x {nbytes} bytes) do not fit on {device}: "
                    f"lower bucket_bytes or num_buffers on the trainer, or leave the worker "
                    f"more device memory ({exc})"
                ) from None

    def take(self) -> tuple[torch.Tensor, Any]:
        """A free buffer and the function that releases it (blocks while none is free)."""
        try:
            slot = self._free.get(timeout=self.timeout)
        except queue.Empty:
            raise TransferTimeoutError(
                f"no receive buffer came free within {self.timeout}s: background apply is "
                f"stuck (a transform or load_weights that never returns?)"
            ) from None
        return self._lend(slot)

    def try_take(self) -> tuple[torch.Tensor, Any] | None:
        """A free buffer and its release, or `None` when none is free right now."""
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            return None
        return self._lend(slot)

    def _lend(self, slot: int) -> tuple[torch.Tensor, Any]:
        while len(self._buffers) <= slot:
            if self.on_device:
                buffer = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
            else:
                buffer = staging_buffer(self.nbytes, self.device)
            self._buffers.append(buffer)
        return self._buffers[slot], lambda: self._free.put(slot)

    def landing(
        self, bucket: Bucket, target: LandingTarget
    ) -> tuple[torch.Tensor | None, Callable[[], None], list[memoryview]]:
        """Where each slice of `bucket` should be received: straight into the model
        where `target` takes the bytes as they are, else into a buffer of this pool at
        the slice's plan offset. Returns the buffer (None if every slice lands in
        place), its release, and one writable view per slice.
        """
        in_place = all(target.direct[s.param] for s in bucket.slices)
        buffer, release = (None, _nothing) if in_place else self.take()
        staging = byte_view(buffer) if buffer is not None else memoryview(b"")
        views = [
            target.landing_view(s.param)[s.start : s.end]
            if target.direct[s.param]
            else staging[s.offset : s.offset + s.nbytes]
            for s in bucket.slices
        ]
        return buffer, release, views


def _nothing() -> None:
    return None
