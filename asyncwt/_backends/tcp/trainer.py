"""The `"tcp"` backend, trainer side: every bucket streams over each worker's connection
(star), or once down a chain of workers (see `asyncwt._backends.tcp.chain`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from typing_extensions import Self

from ..._core.errors import ControlPlaneError, TransferError
from ..._core.lanes import LaneEvent
from ..._core.plan import TransferPlan
from ..._core.protocol import AnyWeightSyncClient
from ..._core.round_plan import BackendFeatures
from ..._core.source import WeightSource
from ..._core.stats import Progress, RoundStats
from ..._trainer.calls import bounded_call
from ..._trainer.engine import PipelinedTrainerEngine
from ..._transports.base import SenderTransport
from ..._transports.link import Peer
from .chain import SENDERS, FleetSender
from .members import Members
from .sender import TcpSender
from .settings import TcpTrainerInitInfo

__all__ = ["TcpTrainerEngine"]

logger = logging.getLogger("asyncwt")


class TcpTrainerEngine(PipelinedTrainerEngine[TcpTrainerInitInfo]):
    """Trainer engine of the `"tcp"` backend.

    Rank 0 listens during `trainer_init` only; each worker connects and proves the
    token while its `init_weight_transfer_engine` call runs. Each round, every worker
    receives every bucket over its own connection, all concurrently (`"star"`), or
    the trainer sends each bucket once and the workers pass it on (`"chain"`).

    With `fanout=Chain()` or `on_worker_failure="drop"` the workers are tracked
    one by one (the client is split per worker where it can be, see `Members`):
    a worker that dies mid-round is dropped and the round runs again on the
    survivors (`"drop"`), and `add_workers` admits new ones between rounds.
    """

    init_info_cls = TcpTrainerInitInfo
    features = BackendFeatures(
        senders=("rank0", "owners"), routes=("star", "chain"), codecs=("raw", "delta")
    )
    members: Members | None = None
    """The workers one by one, when tracked (else None)."""

    @classmethod
    def make_transport(
        cls, info: TcpTrainerInitInfo, plan: TransferPlan, device: torch.device
    ) -> SenderTransport:
        if info.tracks_members:
            return SENDERS[info.fanout.name](info, plan)
        return TcpSender(info, plan)

    @classmethod
    async def trainer_init(
        cls,
        init_info: TcpTrainerInitInfo,
        *,
        client: AnyWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """See `PipelinedTrainerEngine.trainer_init`; a tracked fleet's client is split
        into its workers first."""
        if not (
            isinstance(init_info, TcpTrainerInitInfo)
            and init_info.tracks_members
            and init_info.is_sender
        ):
            return await super().trainer_init(init_info, client=client, source=source)
        if init_info.on_worker_failure == "drop" and source is not None:
            _check_single_rank(source)
        members = Members()
        members.add(client)
        try:
            engine = await super().trainer_init(init_info, client=members, source=source)
        except BaseException:
            await members.close()
            raise
        engine.members = members
        return engine

    def _fleet(self) -> tuple[FleetSender, Members] | None:
        if isinstance(self.transport, FleetSender) and self.members is not None:
            return self.transport, self.members
        return None

    async def send_weights(  # type: ignore[override]
        self,
        *,
        weight_version: str | None = None,
        after: LaneEvent | None = None,
        join: bool = True,
        progress: Progress | None = None,
    ) -> RoundStats:
        """See `PipelinedTrainerEngine.send_weights`. With `on_worker_failure="drop"`,
        a round that fails with workers gone (their connection closed or broken, or,
        on one more try, their start unanswered within `rpc_timeout`: stalled) drops
        them and runs again on the survivors; the stats name the dropped. Each try is
        bounded by the usual timeouts; with nobody gone the round's error is raised."""
        fleet = self._fleet()
        if fleet is None or self.round_plan.on_worker_failure != "drop":
            return await super().send_weights(
                weight_version=weight_version, after=after, progress=progress, join=join
            )
        transport, members = fleet
        fence = after if after is not None else self.fence()
        dropped: list[str] = []
        probed = False
        while True:
            try:
                stats = await super().send_weights(
                    weight_version=weight_version, after=fence, progress=progress, join=join
                )
            except (TransferError, ControlPlaneError) as exc:
                lost = await transport.find_lost(min(1.0, self.info.timeouts.ready))
                if not lost:  # stalled: its start (or finish) went unanswered
                    stalled = members.unanswered
                    lost = [p for p, seen in transport.listings.items() if seen.member in stalled]
                if not lost and not probed:
                    # Nobody is known gone: a stalled worker shows itself by not answering
                    # the next round's start within rpc_timeout. One probe, then it is
                    # the round's error.
                    probed = True
                    logger.warning(
                        "asyncwt: round failed with no worker known gone (%s: %s); trying "
                        "once more to find a stalled one",
                        type(exc).__name__,
                        exc,
                    )
                    continue
                if not lost or len(lost) >= len(transport.links.peers):
                    raise
                dropped += await _drop(transport, members, lost, exc)
                if not transport.links.peers:
                    raise  # nobody left to complete the round
                continue
            return dataclasses.replace(stats, dropped=tuple(dropped))

    async def add_workers(self, client: AnyWeightSyncClient) -> int:
        """Admit the workers `client` reaches, which were not there at `trainer_init`
        (a new engine, or one restarted); they receive the full weights from the next
        round on while the others carry on. Returns how many connected.

        Needs a tracked fleet (`fanout=Chain()` or `on_worker_failure="drop"`) and
        no round running. Cancellation or failure: nothing is admitted.
        """
        fleet = self._fleet()
        if fleet is None:
            raise ValueError(
                "add_workers needs a tracked fleet: fanout=Chain() or "
                f"on_worker_failure='drop' (got fanout={self.info.fanout!r}, "
                f"on_worker_failure={self.info.on_worker_failure!r})"
            )
        if self._busy:
            raise RuntimeError("add_workers called while a round runs; call it between rounds")
        transport, members = fleet
        numbers = members.add(client)
        fields = self.worker_init_fields()

        async def init_workers(init_info: dict[str, Any]) -> None:
            await bounded_call(
                members,
                "init_members",
                init_info,
                numbers,
                timeout=self.info.timeouts.rpc,
                where="add_workers",
            )

        try:
            peers = await transport.admit(fields, init_workers)
        except BaseException:
            for number in numbers:
                await members.drop(number)
            raise
        return len(peers)

    async def shutdown(self) -> None:
        await super().shutdown()
        if self.members is not None:
            await self.members.close()


async def _drop(
    transport: FleetSender, members: Members, lost: list[Peer], why: BaseException
) -> list[str]:
    """Cut `lost` out of the fleet (with every other worker behind the same member);
    their names, as the stats report them."""
    dropped = []
    for peer in lost:
        listing = transport.drop(peer)
        name = peer.address
        if listing is not None:
            name = members.label(listing.member)
            await members.drop(listing.member)
            # The member's other workers (ranks behind one client) go too: the
            # control plane reaches them only through it.
            for other, seen in list(transport.listings.items()):
                if seen.member == listing.member:
                    transport.drop(other)
        dropped.append(name)
        logger.warning(
            "asyncwt: dropped worker %s after %s: %s; the round runs again on the %d left",
            name,
            type(why).__name__,
            why,
            len(transport.links.peers),
        )
    return dropped


def _check_single_rank(source: WeightSource) -> None:
    """`on_worker_failure="drop"` reruns a round on rank 0 alone, so no other rank may
    hold a parameter (its gathers would wait for a rank that does not run again)."""
    for meta in source.metadata:
        if meta.owners is not None and any(rank != 0 for rank in meta.owners):
            raise ValueError(
                f"on_worker_failure should be 'fail' for a trainer sharded over ranks "
                f"(a dropped worker's round runs again on rank 0 alone), got 'drop' with "
                f"parameter {meta.name!r} owned by ranks {meta.owners}"
            )
