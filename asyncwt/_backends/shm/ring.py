"""A ring of shared bucket buffers that workers read in place (shm, CUDA IPC).

The trainer packs each bucket straight into one of `num_buffers` ring slots that
every worker has mapped; the link (the authenticated connection of `"tcp"`)
carries only frame headers naming the slot, and each worker's RELEASE of a slot
once its applier is done with it. A slot is rewritten only after every worker
released it. Subclasses say how the buffers are made, exported and mapped.

A slot is read by every worker and written by the trainer, so user code never
gets it: where the applier would hand a transform or `load_weights` views of the
bucket, the worker first copies the bucket into a receive buffer of its own
(reused from round to round) and releases the slot at once. Otherwise the
applier only copies out of the slot, into the model.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..._core.errors import ProtocolError
from ..._core.plan import Bucket, TransferPlan
from ..._transports.base import (
    InitWorkers,
    LandingTarget,
    ReceivedBucket,
    Segment,
    Settle,
)
from ..._transports.link import LinkedReceiver, LinkedSender, Peer, WorkerLink, connect_link
from ..._transports.link_settings import LinkedTrainerInfo, LinkedWorkerInfo
from ..._transports.pool import ReceivePool
from ..._transports.wire import Frame, FrameKind

__all__ = ["RingReceiver", "RingSender"]


class RingSender(LinkedSender):
    """Packs buckets into the ring and announces each slot over the link."""

    min_view_bytes: int | None = None

    def __init__(self, info: LinkedTrainerInfo, plan: TransferPlan) -> None:
        super().__init__(info.link_settings(), plan)
        self.release_timeout = info.timeouts.send
        self.buffers: list[torch.Tensor] = []
        self.pending: list[set[Peer]] = []
        """Per ring slot, the workers that still read what it holds."""
        self.bound: dict[int, int] = {}
        """Pipeline slot → the ring slot it is packing into (until sent)."""
        self.on_release = self._on_release

    def set_buffers(self, buffers: list[torch.Tensor]) -> None:
        self.buffers = buffers
        self.pending = [set() for _ in buffers]

    @abstractmethod
    def exported(self) -> dict[str, Any]:
        """The init-info fields workers need to map the ring."""

    def after_rendezvous(self) -> None:
        """Every worker has mapped the ring (hook: drop names, say)."""

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        await super().rendezvous({**worker_fields, **self.exported()}, init_workers)
        self.after_rendezvous()

    def staging(self, slot: int) -> torch.Tensor | None:
        return self.buffers[self.bound[slot]]

    def _on_release(self, peer: Peer, frame: Frame) -> None:
        if frame.slot >= len(self.pending):
            raise self.links.protocol_error(
                peer, f"released ring slot {frame.slot}; there are {len(self.pending)}"
            )
        self.pending[frame.slot].discard(peer)

    async def reclaim(self, slot: int) -> None:
        """Bind pipeline slot `slot` to a ring slot that no worker reads any more.

        Any free ring slot will do, so one worker slow to apply one bucket does not
        stall the ring while other slots are free. Waits (reading RELEASE frames)
        while every ring slot is still being read.
        """
        self.bound.pop(slot, None)
        taken = set(self.bound.values())
        while True:
            for ring in range(len(self.buffers)):
                if ring not in taken and not self.pending[ring]:
                    self.bound[slot] = ring
                    return
            peer = next(p for ring in range(len(self.pending)) for p in self.pending[ring])
            frame = await self.links.read_frame(peer, self.release_timeout, "a ring-slot release")
            try:
                if frame.kind != FrameKind.RELEASE:
                    raise self.links.protocol_error(
                        peer, f"sent {frame.kind.name} instead of RELEASE"
                    )
                self._on_release(peer, frame)
            except ProtocolError as exc:
                peer.close(str(exc))
                raise

    async def begin_round(self, round_id: int) -> None:
        self.bound.clear()  # bindings of an aborted round are void
        await super().begin_round(round_id)

    async def send_bucket(
        self, bucket: Bucket, slot: int, segments: list[Segment]
    ) -> Settle | None:
        ring = self.bound.pop(slot)  # from now on `pending` guards the ring slot
        header = self.links.frame(
            FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes, slot=ring
        )
        self.pending[ring] = set(self.links.peers)
        await self.links.each(self.links.send_header, header, f"bucket {bucket.index}")
        return None

    def close(self) -> None:
        super().close()
        self.buffers = []


class RingReceiver(LinkedReceiver):
    """Maps the ring at init; yields each announced slot as the bucket's buffer, in place."""

    lands_in_place = False
    reads_directly = False
    """Whether buckets come as addresses in the trainer's memory (see `asyncwt._backends.shm.backend`)."""

    def __init__(
        self, info: LinkedWorkerInfo, plan: TransferPlan, pool: Callable[[], ReceivePool]
    ) -> None:
        self.info = info
        self.plan = plan
        self.link: WorkerLink | None = None
        self.buffers: list[torch.Tensor] = []
        self.make_copies = pool
        """Makes the receive buffers a bucket is copied into before user code sees it
        (called on the first such bucket)."""
        self.copies: ReceivePool | None = None

    @abstractmethod
    def map_ring(self) -> list[torch.Tensor]:
        """Map every ring slot the trainer exported (bucket_bytes each)."""

    def unmap_ring(self) -> None:
        """Release the mappings (hook)."""

    def connect(self) -> None:
        info = self.info
        try:
            self.buffers = self.map_ring()
            sock = connect_link(info.host, info.port, info.token, self.plan, info.connect_timeout)
        except BaseException:
            self.close()
            raise
        self.link = WorkerLink(
            sock,
            self.plan,
            info.recv_timeout,
            slots=max(1, len(self.buffers)),
            reads_directly=self.reads_directly,
            codec=self.codec,
        )

    @property
    def usable(self) -> bool:
        return self.link is not None and not self.link.broken

    def receive_round(self, round_id: int, target: LandingTarget) -> Iterator[ReceivedBucket]:
        link = self.link
        assert link is not None
        with link.guard(round_id):
            for frame in link.frames(round_id):
                yield self.received(link, round_id, frame, target)

    def received(
        self, link: WorkerLink, round_id: int, frame: Frame, target: LandingTarget
    ) -> ReceivedBucket:
        """The bucket `frame` announces (its header checked by the link): the ring slot."""
        if not 0 <= frame.slot < len(self.buffers):
            raise ProtocolError(
                f"round {round_id}: bucket {frame.index} names ring slot {frame.slot}, "
                f"there are {len(self.buffers)}"
            )
        bucket = self.plan.buckets[frame.index]
        slot, release_slot = self.buffers[frame.slot], self._releaser(link, frame)
        if not target.hands_out_buffers:
            return ReceivedBucket(bucket, slot, release_slot)
        return self._copied(bucket, slot, release_slot)

    def _copied(
        self, bucket: Bucket, slot: torch.Tensor, release_slot: Callable[[], None]
    ) -> ReceivedBucket:
        """`bucket`, copied out of the ring `slot` into a receive buffer of this
        worker; the slot is released once the copy has read it."""
        try:
            if self.copies is None:
                self.copies = self.make_copies()
            buffer, release = self.copies.take()
            try:
                buffer[: bucket.buffer_bytes].copy_(slot[: bucket.buffer_bytes])
                for device in {buffer.device, slot.device}:
                    if device.type == "cuda":  # the slot may be rewritten once released
                        torch.cuda.current_stream(device).synchronize()
            except BaseException:
                release()
                raise
        finally:
            release_slot()
        return ReceivedBucket(bucket, buffer, release)

    @staticmethod
    def _releaser(link: WorkerLink, frame: Frame) -> Any:
        release = Frame(FrameKind.RELEASE, frame.round_id, frame.index, frame.digest, 0, frame.slot)

        def release_slot() -> None:
            with contextlib.suppress(OSError):  # a broken link fails the round anyway
                link.send(release)

        return release_slot

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.buffers = []
        self.unmap_ring()
