"""The `"tcp"` backend, worker side: receive each bucket straight into place."""

from __future__ import annotations

from collections.abc import Iterator

from ..._core.plan import TransferPlan
from ..._transports.backend import ReceiveContext
from ..._transports.base import LandingTarget, ReceivedBucket, ReceiverTransport
from ..._transports.link import LinkedReceiver, WorkerLink, connect_link
from ..._transports.pool import ReceivePool
from .receive import receive_buckets
from .relay import ChainReceiver, announce
from .settings import TcpWorkerInitInfo

__all__ = ["TcpReceiver", "make_receiver"]


class TcpReceiver(LinkedReceiver):
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
        self.link = WorkerLink(sock, self.plan, info.recv_timeout, codec=self.codec)
        self.send_declaration(self.link)
        if info.member >= 0:  # a tracked member: pair this connection with it
            announce(self.link, info.member, "", 0)

    @property
    def usable(self) -> bool:
        return self.link is not None and not self.link.broken

    def receive_round(self, round_id: int, target: LandingTarget) -> Iterator[ReceivedBucket]:
        link = self.link
        assert link is not None
        yield from receive_buckets(link, self.plan, self.pool, round_id, target)

    def close(self) -> None:
        if self.link is not None:
            self.link.close()


def make_receiver(
    info: TcpWorkerInitInfo, plan: TransferPlan, ctx: ReceiveContext
) -> ReceiverTransport:
    """A tcp worker's receiving side: from its predecessor, forwarding to its
    successor, when the trainer's `fanout=Chain()` (`ChainReceiver`, listening on
    the worker's `relay_host`); else straight from the trainer (`TcpReceiver`)."""
    pool = ctx.receive_pool(info, plan)
    if info.topology == "chain":
        return ChainReceiver(info, plan, pool, ctx.relay_host)
    return TcpReceiver(info, plan, pool)
