"""The `"tcp"` backend's fleet layer: workers tracked one by one around the sender.

With `fanout=Chain()` or `on_worker_failure="drop"` the trainer addresses each
worker on its own (the client is split per worker where it can be, see
`Members`). `TcpFleet` stands between the engine and that client: a worker that
dies mid-round is dropped and the round runs again on the survivors (`"drop"`),
and `add_workers` admits new ones between rounds. The engine knows none of this:
it runs rounds through `Fleet.run_round`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..._core.errors import ControlPlaneError, TransferError
from ..._core.lanes import LaneEvent
from ..._core.protocol import AnyWeightSyncClient
from ..._core.source import WeightSource
from ..._core.stats import RoundStats
from ..._trainer.calls import bounded_call
from ..._transports.backend import Fleet, RoundAttempt
from ..._transports.base import SenderTransport
from ..._transports.link import Peer
from .chain import FleetSender
from .members import Members
from .settings import TcpTrainerInitInfo

__all__ = ["TcpFleet", "open_fleet"]

logger = logging.getLogger("asyncwt")


def open_fleet(
    info: TcpTrainerInitInfo, client: AnyWeightSyncClient, source: WeightSource | None
) -> Fleet | None:
    """The fleet layer of a tcp engine that tracks its workers (else None)."""
    if not info.tracks_members:
        return None
    if info.on_worker_failure == "drop" and source is not None:
        _check_single_rank(source)
    members = Members()
    members.add(client)
    return TcpFleet(info, members)


class TcpFleet:
    """See the module docstring; one per trainer engine, on rank 0."""

    def __init__(self, info: TcpTrainerInitInfo, members: Members) -> None:
        self.info = info
        self.members = members
        self.transport: FleetSender | None = None

    @property
    def client(self) -> AnyWeightSyncClient:
        return self.members

    def attach(self, transport: SenderTransport) -> None:
        if not isinstance(transport, FleetSender):
            raise TypeError(f"a tcp fleet runs over a FleetSender, got {type(transport).__name__}")
        self.transport = transport

    async def run_round(self, attempt: RoundAttempt, fence: LaneEvent) -> RoundStats:
        """With `on_worker_failure="drop"`, a round that fails with workers gone
        (their connection closed or broken, or, on one more try, their start
        unanswered within `rpc_timeout`: stalled) drops them and runs again on the
        survivors; the stats name the dropped. Each try is bounded by the usual
        timeouts; with nobody gone the round's error is raised."""
        transport = self.transport
        if transport is None or self.info.on_worker_failure != "drop":
            return await attempt(fence)
        members = self.members
        dropped: list[str] = []
        probed = False
        while True:
            try:
                stats = await attempt(fence)
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

    async def add_workers(
        self, client: AnyWeightSyncClient, worker_fields: dict[str, Any], rpc_timeout: float
    ) -> int:
        """Admit the workers `client` reaches (see `PipelinedTrainerEngine.add_workers`)."""
        transport, members = self.transport, self.members
        if transport is None:
            raise RuntimeError("add_workers called on a rank that sends nothing")
        numbers = members.add(client)

        async def init_workers(init_info: dict[str, Any]) -> None:
            await bounded_call(
                members,
                "init_members",
                init_info,
                numbers,
                timeout=rpc_timeout,
                where="add_workers",
            )

        try:
            peers = await transport.admit(worker_fields, init_workers)
        except BaseException:
            for number in numbers:
                await members.drop(number)
            raise
        return len(peers)

    async def close(self) -> None:
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
