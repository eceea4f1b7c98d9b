"""Delta rounds as a layer around a linked sender: which worker gets which frame,
and what went on the wire.

`DeltaLinks` wraps the sender of a backend whose workers are linked to it (`"tcp"`,
`"shm"`) and is the engine's transport when `delta=True` (`delta_sender`). A
worker whose READY says it holds the copy's round gets a DELTA frame inline on its
link (the bucket coded by `DeltaSender`, with its digest) where the coding is
smaller than the payload; any other worker, and every worker when the bucket codes
`RAW`, gets the bucket from the wrapped sender (`send_bucket_to`: a BUCKET frame on
the socket for tcp; a ring slot or the bucket's addresses for shm), so it lands
exactly as in a full round. The copy is updated in both cases (in a thread, while
the bucket goes out when nothing is coded and the sender allows it). The link
carries READY's held round and the DELTA frames without reading either.
"""

from __future__ import annotations

import time

import anyio
import anyio.to_thread

from .._core.concurrency import single_error
from .._core.plan import Bucket
from .._transports.base import Segment, SenderTransport, Settle
from .._transports.layer import SenderLayer
from .._transports.link import LinkedSender, Peer
from .._transports.link_settings import SendersAndDelta
from .._transports.wire import FrameKind
from .codec import Encoding
from .sender import DeltaSender

__all__ = ["DeltaLinks", "delta_sender"]


def delta_sender(transport: SenderTransport, info: object) -> DeltaLinks:
    """`transport` sending delta rounds as `info.delta` (a `Delta`) asks for them:
    its delta settings are read here only. `transport` must be a linked
    sender that can send a bucket to some of its workers (tcp's star, shm)."""
    if not isinstance(transport, LinkedSender):
        raise ValueError(
            f"delta should be False for a {type(transport).__name__} (delta rounds go "
            f"over the trainer's links: tcp's star or shm), got True"
        )
    if not isinstance(info, SendersAndDelta) or info.delta_settings is None:
        raise TypeError(
            f"info should be the settings of a backend with delta rounds (tcp, shm) and a "
            f"Delta in info.delta, got {type(info).__name__}"
        )
    delta = info.delta_settings
    return DeltaLinks(transport, full_every=delta.full_every, policy=delta.policy)


class DeltaLinks(SenderLayer):
    """A linked sender's rounds as deltas: per round, the workers that get them; per
    bucket, the frames each gets. Everything else is the wrapped sender's."""

    def __init__(self, inner: LinkedSender, *, full_every: int, policy: str) -> None:
        super().__init__(inner)
        self.links.accept_held()  # READY names the round a worker holds
        self.state = DeltaSender(inner.links.plan, full_every=full_every, policy=policy)
        self._deltas: list[Peer] = []
        self._fulls: list[Peer] = []
        self._wire = 0
        self.round_wire_bytes: int | None = None
        """Bytes that went on the wire to each worker in the last round (frame
        payloads; the mean when workers got different frames)."""
        self.round_encode_s = 0.0
        """Seconds the last round spent coding buckets (before each went out)."""

    # -- rounds --------------------------------------------------------------------------

    async def begin_round(self, round_id: int) -> None:
        """Open the round on the wrapped sender, then choose, from every worker's
        READY, who gets deltas."""
        await super().begin_round(round_id)
        peers = self.links.peers
        chosen = self.state.begin(round_id, [p.held for p in peers])
        self._deltas = [p for p, c in zip(peers, chosen) if c]
        self._fulls = [p for p, c in zip(peers, chosen) if not c]
        self._wire = 0
        self.round_encode_s = 0.0

    async def send_bucket(
        self, bucket: Bucket, slot: int, segments: list[Segment]
    ) -> Settle | None:
        """Send `bucket` to every worker, coded to those that hold the copy's round,
        in full (the wrapped sender) to the others. Where the wrapped sender's
        segments may be rewritten before its send returns (`segments_outlive_send`
        false: a ring slot its readers release), the copy is updated before the
        plain send starts, not beside it."""
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
                    settled[0] = await self.inner.send_bucket_to(
                        bucket, slot, segments, self._fulls
                    )

                what = f"bucket {bucket.index}"
                with single_error():
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(to_fulls)  # with none, the sender lets the bucket go
                        await links.each(links.send_frame, delta_frame, what, among=self._deltas)
                self._wire += nbytes * len(self._deltas) + bucket.payload_bytes * len(self._fulls)
                return settled[0]
        elif not state.keeps_nothing:
            if not self.inner.segments_outlive_send:
                await anyio.to_thread.run_sync(state.keep, bucket, segments)
            else:
                with single_error():
                    async with anyio.create_task_group() as tg:
                        tg.start_soon(anyio.to_thread.run_sync, state.keep, bucket, segments)
                        settle = await self._timed(bucket, slot, segments)
                self._wire += bucket.payload_bytes * len(links.peers)
                return settle
        # Every worker gets it in full: a full round that keeps no copy (as without
        # deltas), a bucket that coded RAW, or a copy already kept.
        settle = await self._timed(bucket, slot, segments)
        self._wire += bucket.payload_bytes * len(links.peers)
        return settle

    async def _timed(self, bucket: Bucket, slot: int, segments: list[Segment]) -> Settle | None:
        """The bucket in full to every worker, measuring the wire's rate from how long
        it took to reach them all (until it settles, when it is left in flight)."""
        state = self.state
        started = time.perf_counter()
        settle = await self.inner.send_bucket_to(bucket, slot, segments, self.links.peers)
        if settle is None:
            state.sent_raw(bucket.payload_bytes, time.perf_counter() - started)
            return None
        left = settle

        async def timed() -> None:
            await left()
            state.sent_raw(bucket.payload_bytes, time.perf_counter() - started)

        return timed

    async def end_round(self) -> None:
        """Every bucket went out: the copy is of this round."""
        await self.inner.end_round()
        self.state.end(self.links.round_id)
        self.round_wire_bytes = self._wire // max(1, len(self.links.peers))

    async def abort_round(self, reason: str) -> None:
        """The round stopped part way: the copy is a mix; the next round is full."""
        self.state.abort()
        self.round_wire_bytes = self._wire // max(1, len(self.links.peers))
        await self.inner.abort_round(reason)
