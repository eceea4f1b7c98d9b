"""The trainer side of the interface: init info and the asyncio-native engine base."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, ClassVar, Generic, TypeVar

from typing_extensions import Self

from .protocol import AnyWeightSyncClient, check_client
from .source import WeightSource
from .validate import check_non_negative

__all__ = ["TrainerInitInfo", "TrainerWeightTransferEngine"]


@dataclass
class TrainerInitInfo:
    """Base of every backend's trainer-side init info: who this trainer rank is.

    `rank` is given explicitly (never read from a global process group, which is
    ambiguous once FSDP/TP/PP groups coexist) and is keyword-only so that backend
    subclasses can add positional fields. Rank 0 is the sender: it alone opens the
    endpoint and calls the client; every rank still iterates the source.

    Each concrete subclass sets the class-level `backend` string, the key it is
    registered under; `asyncwt.trainer_init` dispatches on it.
    """

    backend: ClassVar[str]

    rank: int = field(kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        backend = getattr(cls, "backend", None)
        if not isinstance(backend, str) or not backend:
            raise TypeError(
                f"{cls.__name__} should set a class-level `backend` string (its registry "
                f"key), got {backend!r}"
            )

    def __post_init__(self) -> None:
        check_non_negative("rank", self.rank)

    @property
    def is_sender(self) -> bool:
        """Whether this rank drives the transfer (rank 0)."""
        return self.rank == 0


TTrainerInitInfo = TypeVar("TTrainerInitInfo", bound=TrainerInitInfo)


class TrainerWeightTransferEngine(ABC, Generic[TTrainerInitInfo]):
    """The trainer's side of a weight transfer, asyncio-native.

    Built with `await Engine.trainer_init(init_info, client=..., source=...)` on every
    trainer rank. `await send_weights()` runs one round (start, update while data
    flows, finish) and is also called on every rank: all ranks iterate the source so
    their collectives line up, and only the sender (rank 0) sends and calls the
    client, which may be a `VLLMWeightSyncClient` (called from a thread, so the loop
    never blocks) or an `AsyncWeightSyncClient` (awaited).

    Subclasses set `init_info_cls`.
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]

    def __init__(
        self,
        *,
        client: AnyWeightSyncClient,
        source: WeightSource | None = None,
        is_sender: bool = True,
        rank: int = 0,
    ) -> None:
        check_client(client)
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.rank = rank

    @classmethod
    @abstractmethod
    async def trainer_init(
        cls,
        init_info: TTrainerInitInfo,
        *,
        client: AnyWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Rendezvous with the inference side and return a ready engine.

        Called on every trainer rank; the sender opens the endpoint and calls
        `client.init_weight_transfer_engine`, the others skip both.
        """

    @abstractmethod
    async def send_weights(self, **kwargs: Any) -> Any:
        """Run one full round: start, update (concurrent with the data), finish.

        Called on every trainer rank.
        """

    async def shutdown(self) -> None:
        """Release the engine's endpoint and resources. Default: nothing to release."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown()
