"""The worker's side of delta rounds: the bytes it keeps, receiving and decoding deltas.

A coded bucket is rebuilt from the bytes of the previous version. Where the model
holds a parameter's wire bytes as they are (`ModelTarget.direct` with no
transform: a CPU parameter of the wire dtype, or a staged copy of one), those
bytes are the parameter itself and cost nothing (behind a ring, which lands nothing
in place, a plain bucket's bytes are copied into such a parameter here rather than
by the applier, the same one copy). A GPU parameter of the wire dtype that the
applier copies into as it is (no transform, no `load_weights`) is its own base
too: a coded bucket's changed units are uploaded and scattered into it on the
device, and no host copy of it is kept (only the digest reads its bytes back,
into pinned memory, once per bucket). Every other slice is kept in a shadow
copy: one bucket-sized host buffer per bucket that has such a slice
(`shadow_bytes`), filled by every round, full or delta.

Two targets come out of `adapt`: the one receivers land into (a GPU parameter is
never landed in, its bytes arrive in a buffer), and `applied(...)`, the one the
applier and `prepare` use, where every base parameter counts as direct (this
side writes it; the applier leaves it alone).

Decoding runs on the applier's threads (`DeferredApplier.submit`'s `prepare`):
the body is decompressed, the changed units are written into the live
parameter or the shadow, and the digest of the resulting payload is checked
against the trainer's before the bucket counts as applied; a mismatch fails the
round's `finish_weight_update`, so its version is not published. The worker then
holds no round (READY says 0) and the trainer sends it a full round next.
"""

from __future__ import annotations

import dataclasses
import hmac
import socket
import threading
from collections.abc import Callable

import torch

from .._core.bytes import byte_view
from .._core.cuda_sync import to_host
from .._core.meta import ParamMeta
from .._core.plan import Bucket, Slice, TransferPlan
from .._delta.codec import (
    DELTA_HEADER_SIZE,
    DeltaHeader,
    Encoding,
    apply_sparse,
    payload_digest,
    sparse_chunks,
    unit_of,
)
from .._transports.base import LandingTarget, ReceiveBuffers, ReceivedBucket, ReceiverTransport
from .._transports.link import LinkedReceiver
from .._transports.sockio import recv_exact, recv_segments
from .._transports.wire import Frame, FrameKind
from .applier import ModelTarget

__all__ = ["DeltaDigestError", "DeltaFrames", "WorkerDelta", "delta_receiver", "receive_delta"]


class DeltaDigestError(ValueError):
    """A bucket rebuilt from a delta does not match the trainer's digest."""


def receive_delta(
    sock: socket.socket,
    frame: Frame,
    bucket: Bucket,
    pool: ReceiveBuffers,
    target: LandingTarget,
) -> ReceivedBucket:
    """Read a DELTA frame's header and body (its header checked first): a `RAW` body
    lands like a plain bucket (in place where it can), a coded one in a pool buffer."""
    header = DeltaHeader.unpack(
        recv_exact(sock, DELTA_HEADER_SIZE),
        bucket,
        unit_of(bucket),
        frame.nbytes - DELTA_HEADER_SIZE,
    )
    if header.encoding == Encoding.RAW:
        buffer, release, views = pool.landing(bucket, target)
    else:
        buffer, release = pool.take()
        views = [byte_view(buffer)[: header.body_bytes]]
    try:
        recv_segments(sock, views)
    except BaseException:
        release()
        raise
    return ReceivedBucket(bucket, buffer, release, header=header)


def delta_receiver(receiver: ReceiverTransport, plan: TransferPlan) -> WorkerDelta:
    """Turn delta rounds on for `receiver` (before its `connect`): DELTA frames may
    come on its link and its READY names the round this worker holds. Returns the
    worker's side of the rounds, which the engine drives (`adapt`, `begin_receive`,
    `prepare`, `published`)."""
    if not isinstance(receiver, LinkedReceiver):
        raise ValueError(
            f"delta should be False for a {type(receiver).__name__} (delta rounds come "
            f"over a worker link: tcp's star or shm), got True"
        )
    delta = WorkerDelta(plan)
    receiver.add_codec(DeltaFrames(delta))
    return delta


class DeltaFrames:
    """The link's codec for delta rounds (`asyncwt._transports.link.FrameCodec`):
    DELTA frames, and READY naming the round the worker holds."""

    kind = FrameKind.DELTA
    overhead = DELTA_HEADER_SIZE

    def __init__(self, delta: WorkerDelta) -> None:
        self.delta = delta

    def held(self) -> int:
        return self.delta.announced

    def receive(
        self,
        sock: socket.socket,
        frame: Frame,
        bucket: Bucket,
        buffers: ReceiveBuffers,
        target: LandingTarget,
    ) -> ReceivedBucket:
        return receive_delta(sock, frame, bucket, buffers, target)


class WorkerDelta:
    """The previous version's bytes on a worker, and the decoding of each bucket."""

    def __init__(self, plan: TransferPlan) -> None:
        self.plan = plan
        self.base_round = 0
        """The round whose bytes this worker holds completely (0: none)."""
        self.announced = 0
        """The round the current round's READY says this worker holds (see
        `begin_receive`)."""
        self._shadow: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._units = [unit_of(b) for b in plan.buckets]
        self._fill: tuple[bool, ...] = (False,) * len(plan.params)
        """Per parameter: whether it keeps the wire bytes though a plain bucket does
        not land in it (a ring slot's receiver): this side copies it in then."""
        self._on_device: tuple[bool, ...] = (False,) * len(plan.params)
        """Per parameter: a GPU parameter that is its own base: nothing lands in it,
        this side copies or scatters every bucket's bytes into it."""
        self._adapted: ModelTarget | None = None
        self._applied: ModelTarget | None = None

    def adapt(self, target: ModelTarget) -> ModelTarget:
        """`target` with direct landing exactly where the parameter keeps the wire
        bytes: those are the base, the rest is shadowed. A transform rewrites them
        (nothing is kept); a receiver that lands nothing in place (a ring) still
        leaves them in a host parameter of the wire dtype, so those count as direct
        and a plain bucket's bytes are copied into them here (`prepare`), not by the
        applier. A new target forgets the base."""
        self.base_round = 0
        count = len(target.direct)
        if target.transform is not None:
            self._fill = self._on_device = (False,) * count
            adapted = dataclasses.replace(target, direct=(False,) * count)
        else:
            holds = tuple(
                direct or _keeps_wire_bytes(target, meta, "cpu")
                for direct, meta in zip(target.direct, self.plan.params)
            )
            self._fill = tuple(h and not d for h, d in zip(holds, target.direct))
            self._on_device = tuple(
                not h and _keeps_wire_bytes(target, meta, "cuda")
                for h, meta in zip(holds, self.plan.params)
            )
            adapted = dataclasses.replace(target, direct=holds) if any(self._fill) else target
        self._adapted = adapted
        self._applied = adapted
        if any(self._on_device):
            self._applied = dataclasses.replace(
                adapted, direct=tuple(d or g for d, g in zip(adapted.direct, self._on_device))
            )
        return adapted

    def applied(self, target: ModelTarget) -> ModelTarget:
        """The target the applier and `prepare` use for `target` (what `adapt`
        returned): GPU base parameters count as direct there (see the module
        docstring)."""
        if target is self._adapted and self._applied is not None:
            return self._applied
        return target

    @property
    def shadow_bytes(self) -> int:
        """Host memory this worker pays for delta rounds beyond the model: its shadows."""
        with self._lock:
            return sum(t.numel() for t in self._shadow.values())

    def begin_receive(self) -> int:
        """A round starts writing: return the round held until now (which its READY
        announces), and forget it."""
        self.announced, self.base_round = self.base_round, 0
        return self.announced

    def published(self, round_id: int) -> None:
        """Round `round_id` is applied completely: its bytes are the base now."""
        self.base_round = round_id

    def prepare(
        self, target: ModelTarget, received: ReceivedBucket
    ) -> Callable[[], torch.Tensor | None] | None:
        """The applier's first step for `received`: rebuild and check it, keep it as
        the next base; returns the buffer to apply from. `None`: nothing to do (a
        plain bucket that landed in place entirely)."""
        bucket = received.bucket
        header = received.header
        assert header is None or isinstance(header, DeltaHeader)
        kept = [target.direct[s.param] for s in bucket.slices]
        if (
            header is None
            and all(kept)
            and not any(self._fill[s.param] or self._on_device[s.param] for s in bucket.slices)
        ):
            return None

        def run() -> torch.Tensor | None:
            return self._rebuild(target, bucket, received.buffer, header, kept)

        return run

    def _shadow_of(self, bucket: Bucket) -> torch.Tensor:
        with self._lock:
            shadow = self._shadow.get(bucket.index)
            if shadow is None:
                shadow = self._shadow[bucket.index] = torch.empty(
                    bucket.buffer_bytes, dtype=torch.uint8
                )
            return shadow

    def _destination(
        self, target: ModelTarget, s: Slice, kept: bool, shadow: torch.Tensor | None
    ) -> torch.Tensor:
        if kept:
            meta = self.plan.params[s.param]
            return target.params[meta.name].data.reshape(-1).view(torch.uint8)[s.start : s.end]
        assert shadow is not None
        return shadow[s.offset : s.offset + s.nbytes]

    def _rebuild(
        self,
        target: ModelTarget,
        bucket: Bucket,
        buffer: torch.Tensor | None,
        header: DeltaHeader | None,
        kept: list[bool],
    ) -> torch.Tensor | None:
        shadow = None if all(kept) else self._shadow_of(bucket)
        destinations = [
            self._destination(target, s, k, shadow) for s, k in zip(bucket.slices, kept)
        ]
        if header is None or header.encoding == Encoding.RAW:
            assert buffer is not None or all(kept)
            for s, k, destination in zip(bucket.slices, kept, destinations):
                landed = (
                    k
                    and not self._on_device[s.param]
                    and (header is not None or not self._fill[s.param])
                )
                if not landed and buffer is not None:
                    destination.copy_(buffer[s.offset : s.offset + s.nbytes])
        else:
            assert buffer is not None
            unit = self._units[bucket.index]
            body = byte_view(buffer)[: header.body_bytes]
            units = bucket.payload_bytes // unit
            for positions, values in sparse_chunks(header, body, units, unit):
                apply_sparse(destinations, positions, values, unit)
        if header is not None and not hmac.compare_digest(
            payload_digest([to_host(d) for d in destinations]), header.digest
        ):
            raise DeltaDigestError(
                f"bucket {bucket.index} rebuilt from the delta does not match the trainer's "
                f"digest: this worker's previous bytes differ from the trainer's (changed "
                f"outside the rounds?); the round is not published and the next one is full"
            )
        return shadow if shadow is not None else buffer


def _keeps_wire_bytes(target: ModelTarget, meta: ParamMeta, device_type: str) -> bool:
    """Whether applying `meta`'s bytes leaves them as they are in `target`'s parameter
    (a contiguous tensor of the wire dtype on a `device_type` device, written by a
    plain copy)."""
    param = target.params.get(meta.name)
    return (
        target.load_weights is None
        and param is not None
        and param.device.type == device_type
        and param.dtype == meta.dtype
        and param.is_contiguous()
    )
