"""The `"tcp"` backend's receive loop: buckets read off a link into place (a star's
connection or a chain's relay stream read the same way)."""

from __future__ import annotations

from collections.abc import Iterator

from ..._core.plan import TransferPlan
from ..._transports.base import LandingTarget, ReceivedBucket
from ..._transports.link import WorkerLink
from ..._transports.pool import ReceivePool
from ..._transports.sockio import recv_segments

__all__ = ["receive_buckets"]


def receive_buckets(
    link: WorkerLink,
    plan: TransferPlan,
    pool: ReceivePool,
    round_id: int,
    target: LandingTarget,
) -> Iterator[ReceivedBucket]:
    """Yield each bucket of `round_id` read from `link` with `recvmsg_into`, its
    slices scattered into place (the star's connection or a chain's relay stream);
    a codec's frames are read by the link's codec."""
    with link.guard(round_id):
        for frame in link.frames(round_id):
            coded = link.coded(frame, pool, target)
            if coded is not None:
                yield coded
                continue
            bucket = plan.buckets[frame.index]
            buffer, release, segments = pool.landing(bucket, target)
            try:
                recv_segments(link.sock, segments)
            except BaseException:
                release()
                raise
            yield ReceivedBucket(bucket, buffer, release)
