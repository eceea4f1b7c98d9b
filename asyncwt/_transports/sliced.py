"""Sliced receivers, trainer side: a layer around a linked sender.

Each worker declares, once after its handshake, the box of each parameter it
holds (a LAYOUT frame, see `asyncwt._core.slices`), always over the full plan.
From then on every bucket's frame to that worker carries only the bytes of its
boxes that this sender holds: the sender's segments, cut to the worker's picks,
without a copy. A worker that holds all this sender holds gets the bucket as the
sender under this layer sends it.

The sender's own plan carries `held`, one box of a full parameter per parameter
(by name): rank 0 sends the full plan, each parameter whole; an owner rank its
share plan, its pieces (`asyncwt._core.pairs`). Its picks for a worker are
`select(plan, held, the worker's box of each parameter)`, as the worker derives them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import anyio

from .._core.bytes import byte_view
from .._core.concurrency import single_error
from .._core.errors import ProtocolError, TransferTimeoutError
from .._core.owners import Box
from .._core.plan import Bucket, TransferPlan
from .._core.receiver_layout import ReceiverLayout
from .._core.slices import layout_nbytes, select, unpack_layout, wants_of
from .base import InitWorkers, Segment, SenderTransport
from .layer import SenderLayer
from .link import LinkedSender, Peer
from .sockio import async_recv_exact
from .wire import FRAME_SIZE, Frame, FrameKind

__all__ = ["SlicedSender", "cut"]

logger = logging.getLogger("asyncwt")

Picks = tuple[tuple[tuple[int, int], ...], ...]


def cut(views: list[memoryview], ranges: tuple[tuple[int, int], ...]) -> list[memoryview]:
    """The bytes at `ranges` (`(offset, nbytes)` of the payload `views` make, in
    order, increasing) as views of the views."""
    out: list[memoryview] = []
    index, base = 0, 0  # the segment at `index` starts at payload byte `base`
    for offset, nbytes in ranges:
        while nbytes:
            while base + len(views[index]) <= offset:
                base += len(views[index])
                index += 1
            lo = offset - base
            take = min(nbytes, len(views[index]) - lo)
            out.append(views[index][lo : lo + take])
            offset += take
            nbytes -= take
    return out


class SlicedSender(SenderLayer):
    """See the module docstring. `inner` sends `plan`, which carries `held` of `full`'s
    parameters, whole to the workers that hold all of it."""

    def __init__(
        self, inner: LinkedSender, full: TransferPlan, plan: TransferPlan, held: Sequence[Box]
    ) -> None:
        super().__init__(inner)
        self.full = full
        """The plan the workers declare their boxes over."""
        self.plan = plan
        self.held = tuple(held)
        self.picks: dict[Peer, Picks] = {}
        """Per sliced worker: the ranges of each bucket it gets."""
        self.needs: dict[Peer, tuple[Box, ...]] = {}
        """Per worker: the boxes it declared, one per parameter of `full`."""
        self.round_wire_bytes: int | None = None
        """Payload bytes a round carries to each worker (the mean over workers)."""

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        await self.inner.rendezvous({**worker_fields, "slices": True}, init_workers)
        try:
            with single_error():
                async with anyio.create_task_group() as tg:
                    for peer in self.links.peers:
                        tg.start_soon(self._read_layout, peer)
        except BaseException:
            self.inner.close()
            raise
        per_worker = []
        for peer, boxes in self.needs.items():
            wants = wants_of(self.full, boxes, self.plan)
            if all(w.intersection(h) == h for w, h in zip(wants, self.held)):
                per_worker.append(self.plan.total_bytes)  # it holds all this sender sends
                continue
            selection = select(self.plan, self.held, wants, digest=self.plan.digest)
            self.picks[peer] = selection.picks
            per_worker.append(selection.total_bytes)
        self.round_wire_bytes = sum(per_worker) // max(1, len(per_worker))
        logger.info(
            "asyncwt: %d of %d worker(s) hold slices; a round carries %d of %d bytes to each "
            "on average",
            len(self.picks),
            len(self.needs),
            self.round_wire_bytes,
            self.plan.total_bytes,
        )

    def receiver_layouts(self) -> list[ReceiverLayout]:
        """What each worker declared, in the order of the links' peers."""
        return [ReceiverLayout(self.full.params, self.needs[peer]) for peer in self.links.peers]

    async def _read_layout(self, peer: Peer) -> None:
        """Read `peer`'s LAYOUT, at the size the plan fixes, before anything is sent."""
        timeout = self.links.settings.handshake_timeout
        expected = layout_nbytes(self.full)
        try:
            with anyio.fail_after(timeout):
                frame = Frame.unpack(await async_recv_exact(peer.sock, FRAME_SIZE))
                if (
                    frame.kind != FrameKind.LAYOUT
                    or frame.digest != self.links.digest
                    or frame.nbytes != expected
                ):
                    raise ProtocolError(
                        f"worker {peer.address} should declare its layout with LAYOUT "
                        f"({expected} bytes for this plan), got {frame}"
                    )
                data = await async_recv_exact(peer.sock, expected)
        except TimeoutError:
            peer.close("did not declare its layout")
            raise TransferTimeoutError(
                f"worker {peer.address} did not declare its layout within "
                f"timeouts.handshake={timeout}s"
            ) from None
        try:
            self.needs[peer] = unpack_layout(self.full, data, where=f"worker {peer.address}")
        except ValueError as exc:
            peer.close(str(exc))
            raise ProtocolError(str(exc)) from None

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[Segment]) -> None:
        sliced = [p for p in self.links.peers if p in self.picks]
        whole = [p for p in self.links.peers if p not in self.picks]

        async def to_slices() -> None:
            views = [byte_view(segment) for segment in segments]  # once for every worker
            await self.links.each(self._send_picks, bucket, views, among=sliced)

        async def to_whole() -> None:
            await self.inner.send_bucket_to(bucket, slot, segments, whole)

        if not sliced:
            await to_whole()
            return
        with single_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(to_slices)
                tg.start_soon(to_whole)

    async def _send_picks(self, peer: Peer, bucket: Bucket, views: list[memoryview]) -> None:
        ranges = self.picks[peer][bucket.index]
        nbytes = sum(n for _, n in ranges)
        header = self.links.frame(FrameKind.BUCKET, index=bucket.index, nbytes=nbytes)
        frame = [memoryview(header.pack()), *cut(views, ranges)]
        await self.links.send_frame(peer, frame, f"bucket {bucket.index}")


def sliced_sender(
    transport: SenderTransport, full: TransferPlan, plan: TransferPlan, held: Sequence[Box]
) -> SlicedSender:
    """`transport`, which sends `plan` carrying `held` of `full`'s parameters (rank 0:
    `full` itself, each parameter whole), with sliced receivers (it must be a linked
    sender)."""
    if not isinstance(transport, LinkedSender):
        raise ValueError(
            f"slices need a sender over worker links (tcp's star), got {type(transport).__name__}"
        )
    return SlicedSender(transport, full, plan, held)
