"""Delta rounds over the link: which worker gets which frame, and what went on the wire.

A sender that streams buckets over the link (`"tcp"`) hands each bucket here when
`delta=True`. A worker that holds the copy's round gets a DELTA frame (the
bucket coded by `DeltaSender`, with its digest); any other worker gets the plain
bucket frame the sender would send without deltas, so it lands in place as in a
full round. The copy is updated in both cases (in a thread, while the frames go
out when nothing is coded).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import anyio
import anyio.to_thread

from .._core.bytes import byte_view
from .._core.concurrency import single_error
from .._core.plan import Bucket, TransferPlan
from .._transports.base import Segment
from .._transports.link import Peer, TrainerLinks
from .._transports.wire import FrameKind
from .sender import DeltaSender

__all__ = ["DeltaLinks"]


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

    def begin_round(self, round_id: int) -> None:
        """Choose, from every worker's READY, who gets deltas this round."""
        peers = self.links.peers
        chosen = self.state.begin(round_id, [p.base for p in peers])
        self._deltas = [p for p, c in zip(peers, chosen) if c]
        self._fulls = [p for p, c in zip(peers, chosen) if not c]
        self._wire = 0
        self.round_encode_s = 0.0

    async def send_bucket(self, bucket: Bucket, segments: Sequence[Segment]) -> None:
        """Send `bucket` to every worker, coded to those that hold the copy's round."""
        links = self.links
        views = [byte_view(s) for s in segments]
        raw = links.frame(FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes)
        raw_frame = [memoryview(raw.pack()), *views]
        what = f"bucket {bucket.index}"
        state = self.state
        if self._deltas:
            started = time.perf_counter()
            coded = await anyio.to_thread.run_sync(state.encode, bucket, segments)
            self.round_encode_s += time.perf_counter() - started
            header = coded.header
            body = (
                [byte_view(s) for s in coded.body]
                if isinstance(coded.body, list)
                else [memoryview(coded.body)]
            )
            nbytes = len(header.pack()) + header.body_bytes
            frame = links.frame(FrameKind.DELTA, index=bucket.index, nbytes=nbytes)
            delta_frame = [memoryview(frame.pack()), memoryview(header.pack()), *body]
            started = time.perf_counter()
            with single_error():
                async with anyio.create_task_group() as tg:
                    if self._fulls:
                        tg.start_soon(
                            functools.partial(
                                links.each, links.send_frame, raw_frame, what, among=self._fulls
                            )
                        )
                    await links.each(links.send_frame, delta_frame, what, among=self._deltas)
            if isinstance(coded.body, list):
                state.sent_raw(bucket.payload_bytes, time.perf_counter() - started)
            self._wire += nbytes * len(self._deltas) + bucket.payload_bytes * len(self._fulls)
            return
        started = time.perf_counter()
        if state.keeps_nothing:  # a full round that keeps no copy: as without deltas
            await links.each(links.send_frame, raw_frame, what)
            state.sent_raw(bucket.payload_bytes, time.perf_counter() - started)
        else:
            with single_error():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(anyio.to_thread.run_sync, state.keep, bucket, segments)
                    await links.each(links.send_frame, raw_frame, what)
                    state.sent_raw(bucket.payload_bytes, time.perf_counter() - started)
        self._wire += bucket.payload_bytes * len(links.peers)

    def end_round(self, round_id: int) -> None:
        """Every bucket went out: the copy is of `round_id`."""
        self.state.end(round_id)
        self.round_wire_bytes = self._wire // max(1, len(self.links.peers))

    def abort_round(self) -> None:
        """The round stopped part way: the copy is a mix; the next round is full."""
        self.state.abort()
        self.round_wire_bytes = self._wire // max(1, len(self.links.peers))
