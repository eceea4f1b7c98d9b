"""Who sends a round, trainer side: what the engine is handed for its round plan's senders.

A `SenderSide` builds the `RoundPlan` for this rank (it knows how many ranks send),
gives the engine the source its pipeline reads and the plan it sends, and opens
the transport at init. `RankZero` is rank 0 gathering everything (`senders="rank0"`);
`asyncwt._trainer.owners.OwnerRanks` is every rank sending what it holds. The engine
picks one by the plan's senders and runs it; it reads no mode itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.to_thread

from .._core.concurrency import single_error
from .._core.owners import Box
from .._core.plan import TransferPlan
from .._core.round_plan import RoundChoices, RoundPlan, build_round_plan, whole_boxes
from .._core.source import WeightSource
from .._delta.links import delta_sender
from .._transports.base import InitWorkers, SenderTransport
from .._transports.sliced import sliced_sender

__all__ = ["RankZero", "SenderSide", "round_plan_for", "share_round"]


class SenderSide(ABC):
    """This rank's part in sending rounds of `round_plan` (see the module docstring)."""

    def __init__(self, round_plan: RoundPlan, source: WeightSource, rank: int) -> None:
        self.round_plan = round_plan
        self.source = source
        """What this rank's pipeline reads."""
        self.rank = rank

    @classmethod
    @abstractmethod
    def build(cls, info: Any, source: WeightSource | None, choices: RoundChoices) -> SenderSide:
        """Check `source`, build the round plan for `choices`; raise `ValueError` if
        this rank cannot send it (naming the setting and the source)."""

    @property
    def plan(self) -> TransferPlan:
        """What this rank's pipeline and transport carry (its share, or the full plan)."""
        share = self.round_plan.share(self.rank)
        return share if share is not None else self.round_plan.plan

    @property
    def held(self) -> tuple[Box, ...]:
        """The box of its full parameter each of `plan`'s parameters carries (this
        rank's pieces with owner senders; every parameter whole from rank 0)."""
        layout = self.round_plan.layout
        if layout is None:
            return whole_boxes(self.plan.params)
        return tuple(piece.box for piece in layout.pieces[self.rank])

    @abstractmethod
    def opens_transport(self, is_sender: bool) -> bool:
        """Whether this rank opens a transport of its own."""

    @abstractmethod
    async def open(
        self,
        make: Callable[[], SenderTransport],
        prepare: Callable[[SenderTransport], None],
        fields: dict[str, Any],
        init_all: InitWorkers,
    ) -> SenderTransport:
        """Make this rank's transport, prepare its staging (in a thread) and meet the
        workers, who are initialised with `fields` through `init_all`.

        Cancellation or failure: whatever was opened is closed, and it is raised.
        """


def round_plan_for(info: Any, source: WeightSource, choices: RoundChoices, world: int) -> RoundPlan:
    """The round plan `info`'s settings choose for `source`'s parameters over `world` ranks."""
    return build_round_plan(
        source.metadata,
        bucket_bytes=info.bucket_bytes,
        alignment=info.tuning.alignment,
        choices=choices,
        world_size=world,
    )


class RankZero(SenderSide):
    """Rank 0 gathers (`iter_full`) and sends every piece; other ranks only iterate,
    so that their collectives line up with rank 0's."""

    @classmethod
    def build(cls, info: Any, source: WeightSource | None, choices: RoundChoices) -> RankZero:
        if source is None or not source.implements_iter_full():
            raise ValueError(
                f"source should be a WeightSource implementing iter_full (rank 0 sends full "
                f"tensors), got {type(source).__name__}"
            )
        round_plan = round_plan_for(info, source, choices, 1)
        if info.is_sender:
            owned = set(source.owned_names(0))
            for meta in round_plan.plan.params:
                if meta.name not in owned:
                    raise ValueError(
                        f"parameter {meta.name!r} is not owned by rank 0 (owners {meta.owners}); "
                        f"the {info.backend} backend sends every full tensor from rank 0"
                    )
        return cls(round_plan, source, info.rank)

    def opens_transport(self, is_sender: bool) -> bool:
        return is_sender

    async def open(
        self,
        make: Callable[[], SenderTransport],
        prepare: Callable[[SenderTransport], None],
        fields: dict[str, Any],
        init_all: InitWorkers,
    ) -> SenderTransport:
        transport = make()
        try:
            await anyio.to_thread.run_sync(prepare, transport)
            await transport.rendezvous(fields, init_all)
        except BaseException:
            transport.close()
            raise
        return transport


async def share_round(
    transport: SenderTransport,
    round_id: int,
    rank: int,
    stream: Callable[[anyio.Event], Awaitable[dict[str, float]]],
) -> dict[str, float]:
    """One round on a rank that sends its share without the control plane (a rank
    other than 0 with owner senders): its links only.

    Waits for every worker's READY (rank 0 opens the round on the control plane),
    streams this rank's share (`stream(opened)`), ends the round on its links; on
    any failure it aborts the round on them, so the workers' `update_weights` fails
    and rank 0 publishes nothing.
    """
    opened = anyio.Event()

    async def open_round() -> None:
        await transport.begin_round(round_id)
        opened.set()

    try:
        with single_error():
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(open_round)
                busy = await stream(opened)
        await transport.end_round()
    except BaseException as exc:
        with anyio.CancelScope(shield=True):
            await transport.abort_round(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    return busy


SenderLayer = Callable[[SenderTransport], SenderTransport]


def sender_layers(choices: RoundChoices, info: Any, side: SenderSide) -> list[SenderLayer]:
    """The layers a round plan's choices put around `side`'s sender, innermost
    first: each worker's own slice (`"sliced"` receivers), then the codec (delta)."""
    layers: list[SenderLayer] = []
    if choices.receivers == "sliced":
        full, plan, held = side.round_plan.plan, side.plan, side.held
        layers.append(lambda transport: sliced_sender(transport, full, plan, held))
    if choices.codec == "delta":
        layers.append(lambda transport: delta_sender(transport, info))
    return layers
