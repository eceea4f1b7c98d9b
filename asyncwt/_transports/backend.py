"""A backend as data: how to make its sender and receiver, and what rounds it runs.

The engines take a transport; they are not subclassed. A backend hands them a
`TransportBackend`: its init info classes, a factory for the trainer's sending
side and one for a worker's receiving side, the round plans it supports, and,
where it tracks workers one by one, a `Fleet` layer around its sender (the tcp
backend drops dead workers and admits new ones through it). The engine classes
users name (`TcpTrainerEngine`, ...) are made from it by the engine layer and hold
no code of their own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from .._core.lanes import LaneEvent
from .._core.plan import TransferPlan
from .._core.protocol import AnyWeightSyncClient
from .._core.round_plan import BackendFeatures
from .._core.settings import WorkerPlanInfo
from .._core.source import WeightSource
from .._core.stats import RoundStats
from .._core.trainer_api import TrainerInitInfo
from .base import ReceiverTransport, SenderTransport
from .pool import ReceivePool

__all__ = ["Fleet", "ReceiveContext", "RoundAttempt", "TransportBackend", "bound_class"]

T = TypeVar("T")

RoundAttempt = Callable[[LaneEvent], Awaitable[RoundStats]]
"""One try of a round, reading the weights after the given fence."""


class ReceiveContext(Protocol):
    """What a worker engine offers a backend building its receiver."""

    @property
    def device(self) -> torch.device:
        """The worker's device, resolved."""
        ...

    @property
    def relay_host(self) -> str | None:
        """Where a relaying receiver listens for its successor."""
        ...

    def receive_pool(
        self, info: WorkerPlanInfo, plan: TransferPlan, *, on_device: bool = False
    ) -> ReceivePool:
        """Receive buffers sized for this worker's applier (see the worker engine)."""
        ...


class Fleet(Protocol):
    """A layer around a trainer's sender that tracks the workers one by one.

    It stands between the engine and the user's client (`client` is what the
    engine calls), sees the sender once it is open (`attach`), decides what a
    failed round means (`run_round`: run it again without the dead, say), admits
    workers between rounds, and is closed with the engine.
    """

    @property
    def client(self) -> AnyWeightSyncClient:
        """The control plane the engine calls in place of the user's client."""
        ...

    def attach(self, transport: SenderTransport) -> None:
        """The sender is open: rounds run over it from now on."""
        ...

    async def run_round(self, attempt: RoundAttempt, fence: LaneEvent) -> RoundStats:
        """Run a round by calling `attempt` (once, or again after a failure)."""
        ...

    async def add_workers(
        self, client: AnyWeightSyncClient, worker_fields: dict[str, Any], rpc_timeout: float
    ) -> int:
        """Admit the workers `client` reaches; how many connected."""
        ...

    async def close(self) -> None:
        """Release what the layer holds (the per-worker clients)."""
        ...


OpenFleet = Callable[[Any, AnyWeightSyncClient, WeightSource | None], Fleet | None]
"""`(init_info, client, source)` -> the fleet layer for this engine, or None."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TransportBackend:
    """A backend, for the engines: everything they need of it, and nothing else."""

    name: str
    """The registry name (`init_info.backend`)."""
    trainer_info: type[TrainerInitInfo]
    worker_info: type[WorkerPlanInfo]
    sender: Callable[[Any, TransferPlan, torch.device], SenderTransport]
    """`(init_info, plan, device)` -> rank 0's (or an owner rank's) sending side."""
    receiver: Callable[[Any, TransferPlan, ReceiveContext], ReceiverTransport]
    """`(worker_init_info, plan, context)` -> a worker's receiving side."""
    features: BackendFeatures = field(default_factory=BackendFeatures)
    """The round plans it runs (senders, routes, codecs); rank 0, star, raw by default."""
    fleet: OpenFleet | None = None
    """Where the backend tracks workers one by one: the layer that does it."""

    def open_fleet(
        self, info: Any, client: AnyWeightSyncClient, source: WeightSource | None
    ) -> Fleet | None:
        """This engine's fleet layer, if the backend and `info` ask for one."""
        return self.fleet(info, client, source) if self.fleet is not None else None


def bound_class(
    base: type[T], backend: TransportBackend, *, init_info_cls: type, name: str, module: str
) -> type[T]:
    """`base` (an engine) bound to `backend`, as the class users name: `name`, living
    in `module`, with no code of its own."""
    namespace = {
        "__module__": module,
        "__qualname__": name,
        "__doc__": (
            f"{base.__name__} over the {backend.name!r} backend's transport (see the "
            f"backend's module)."
        ),
        "backend": backend,
        "init_info_cls": init_info_cls,
    }
    return type(name, (base,), namespace)
