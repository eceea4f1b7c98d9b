"""The `"tcp"` backend, worker side: receive each bucket straight into place."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..._core.plan import TransferPlan
from ..._delta.receiver import receive_delta
from ..._worker.engine import DeferredWorkerEngine, ReceivePool
from ..base import LandingTarget, ReceivedBucket, ReceiverTransport
from ..link import WorkerLink, connect_link
from ..sockio import recv_segments
from ..wire import FrameKind
from .settings import TcpWorkerInitInfo

__all__ = ["TcpReceiver", "TcpWorkerEngine"]


class TcpReceiver(ReceiverTransport):
    """Receives each bucket with `recvmsg_into`, scattering its slices into place.

    A slice whose parameter can take the bytes as they are (see `LandingTarget`)
    lands in the model directly; the rest land in a pooled receive buffer at their
    plan offsets, for the applier.
    """

    def __init__(self, info: TcpWorkerInitInfo, plan: TransferPlan, pool: ReceivePool) -> None:
        self.info = info
        self.plan = plan
        self.pool = pool
        self.link: WorkerLink | None = None

    def connect(self) -> None:
        info = self.info
        sock = connect_link(info.host, info.port, info.token, self.plan, info.connect_timeout)
        self.link = WorkerLink(sock, self.plan, info.recv_timeout, delta=info.delta)

    @property
    def usable(self) -> bool:
        return self.link is not None and not self.link.broken

    def receive_round(self, round_id: int, target: LandingTarget) -> Iterator[ReceivedBucket]:
        link = self.link
        assert link is not None
        with link.guard(round_id):
            for frame in link.frames(round_id, base=self.delta_base):
                bucket = self.plan.buckets[frame.index]
                if frame.kind == FrameKind.DELTA:
                    yield receive_delta(link.sock, frame, bucket, self.pool, target)
                    continue
                buffer, release, segments = self.pool.landing(bucket, target)
                try:
                    recv_segments(link.sock, segments)
                except BaseException:
                    release()
                    raise
                yield ReceivedBucket(bucket, buffer, release)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()


class TcpWorkerEngine(DeferredWorkerEngine):
    """Worker engine of the `"tcp"` backend (deferred apply; see `DeferredWorkerEngine`)."""

    init_info_cls = TcpWorkerInitInfo

    def make_receiver(self, info: Any, plan: TransferPlan) -> ReceiverTransport:
        return TcpReceiver(info, plan, self.receive_pool(info, plan))
