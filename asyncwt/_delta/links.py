"""Delta rounds over the link: which worker gets which frame, and what went on the wire.

A sender whose workers are linked to it (`"tcp"`, `"shm"`) hands each bucket here
when `delta=True`, with its own way to send the bucket in full to some workers
(`Plain`: a BUCKET frame on the socket for tcp; a ring slot or the bucket's
addresses for shm). A worker that holds the copy's round gets a DELTA frame
inline on its link (the bucket coded by `DeltaSender`, with its digest) where the
coding is smaller than the payload; any other worker, and every worker when the
bucket codes `RAW`, gets the bucket the plain way, so it lands exactly as in a
full round. The copy is updated in both cases (in a thread, while the bucket goes
out when nothing is coded and the sender allows it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from .._core.bytes import byte_view
from .._core.concurrency import single_error
from .._core.plan import Bucket, TransferPlan
from .._transports.base import Segment, Settle
from .._transports.link import Peer, TrainerLinks
from .._transports.wire import FrameKind
from .codec import Encoding
from .sender import DeltaSender

if TYPE_CHECKING:
    from .._transports.link_settings import SendersAndDelta

__all__ = ["DeltaLinks", "Plain"]

Plain = Callable[[list[Peer]], Awaitable[Settle | None]]
"""Send the bucket in full to these workers, the backend's usual way; may leave it
in flight (a `Settle`, see `SenderTransport.send_bucket`)."""


class DeltaLinks:
    """Per round: the workers that get deltas; per bucket: the frames each gets."""

    def __init__(
        self, links: TrainerLinks, plan: TransferPlan, *, full_every: int, policy: str
    ) -> None:
        self.links = links
        self.links.delta = True
        self.state = DeltaSender(plan, full_every=full_every, policy=policy)
        self._deltas: list[Peer] = []
        self._fulls: list[Peer] = []
        self._wire = 0
        self.round_wire_bytes: int | None = None
        """Bytes that went on the wire to each worker in the last round (frame
        payloads; the mean when workers got different frames)."""
        self.round_encode_s = 0.0
        """Seconds the last round spent coding buckets (before each went out)."""

    @classmethod
    def of(
        cls, links: TrainerLinks, plan: TransferPlan, info: SendersAndDelta
    ) -> DeltaLinks | None:
        """Delta rounds over `links` as `info` asks for them (None without `delta`)."""
        delta = info.delta_settings
        if delta is None:
            return None
        return cls(links, plan, full_every=delta.full_every, policy=delta.policy)

    def begin_round(self, round_id: int) -> None:
        """Choose, from every worker's READY, who gets deltas this round."""
        peers = self.links.peers
        chosen = self.state.begin(round_id, [p.base for p in peers])
        self._deltas = [p for p, c in zip(peers, chosen) if c]
        self._fulls = [p for p, c in zip(peers, chosen) if not c]
        self._wire = 0
        self.round_encode_s = 0.0

    async def send_bucket(
        self,
        bucket: Bucket,
        segments: Sequence[Segment],
        plain: Plain | None = None,
        *,
        keep_beside: bool = True,
    ) -> Settle | None:
        """Send `bucket` to every worker, coded to those that hold the copy's round.

        `plain` sends it in full (default: a BUCKET frame on each link). With
        `keep_beside=False` the copy is updated before the plain send starts, not
        beside it: for a sender whose `segments` may be rewritten as soon as the
        workers have them (a ring slot they release).
        """
        send = plain if plain is not None else self._send_frames(bucket, segments)
        links = self.links
        state = self.state
        if self._deltas:
            started = time.perf_counter()
            coded = await anyio.to_thread.run_sync(state.encode, bucket, segments)
            self.round_encode_s += time.perf_counter() - started
            header = coded.header
            if header.encoding != Encoding.RAW:
                assert isinstance(coded.body, bytes)
                nbytes = len(header.pack()) + header.body_bytes
                frame = links.frame(FrameKind.DELTA, index=bucket.index, nbytes=nbytes)
                delta_frame = [
                    memoryview(frame.pack()),
                    memoryview(header.pack()),
                    memoryview(coded.body),
                ]
                settled: list[Settle | None] = [None]

                async def to_fulls() -> None:
                    settled[0] = await send(self._fulls)

                what = f"bucket {bucket.index}"
                with single_error():
                    async with anyio.create_task_group() as tg:
                        if self._fulls:
                            tg.start_soon(to_fulls)
                        await links.each(links.send_frame, delta_frame, what, among=self._deltas)
                self._wire += nbytes * len(self._deltas) + bucket.payload_bytes * len(self._fulls)
                return settled[0]
        elif not state.keeps_nothing:
            if not keep_beside:
                await anyio.to_thread.run_sync(state.keep, bucket, segments)
            else:
                with single_error():
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(anyio.to_thread.run_sync, state.keep, bucket, segments)
                        settle = await self._timed(send, bucket)
                self._wire += bucket.payload_bytes * len(links.peers)
                return settle
        # Every worker gets it in full: a full round that keeps no copy (as without
        # deltas), a bucket that coded RAW, or a copy already kept.
        settle = await self._timed(send, bucket)
        self._wire += bucket.payload_bytes * len(links.peers)
        return settle

    def _send_frames(self, bucket: Bucket, segments: Sequence[Segment]) -> Plain:
        """The plain send of a bucket over the links: a BUCKET frame with its bytes."""
        links = self.links
        header = links.frame(FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes)
        frame = [memoryview(header.pack()), *map(byte_view, segments)]

        async def send(peers: list[Peer]) -> Settle | None:
            await links.each(links.send_frame, frame, f"bucket {bucket.index}", among=peers)
            return None

        return send

    async def _timed(self, send: Plain, bucket: Bucket) -> Settle | None:
        """`send` to every worker, measuring the wire's rate from how long the bucket
        took to reach them all (until it settles, when it is left in flight)."""
        state = self.state
        started = time.perf_counter()
        settle = await send(self.links.peers)
        if settle is None:
            state.sent_raw(bucket.payload_bytes, time.perf_counter() - started)
            return None
        left = settle

        async def timed() -> None:
            await left()
            state.sent_raw(bucket.payload_bytes, time.perf_counter() - started)

        return timed

    def end_round(self, round_id: int) -> None:
        """Every bucket went out: the copy is of `round_id`."""
        self.state.end(round_id)
        self.round_wire_bytes = self._wire // max(1, len(self.links.peers))

    def abort_round(self) -> None:
        """The round stopped part way: the copy is a mix; the next round is full."""
        self.state.abort()
        self.round_wire_bytes = self._wire // max(1, len(self.links.peers))
