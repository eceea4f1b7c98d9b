"""An async control-plane client over worker engines living in this process."""

from __future__ import annotations

import functools
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from .._core.concurrency import fan_out
from .._core.protocol import WeightTransferUpdatePayload
from .._core.worker_api import WeightTransferEngine
from .._worker.round_driver import RoundDriver, finish_engine_round

__all__ = ["LocalClient", "finish_engine_round"]

Engine = WeightTransferEngine[Any, Any]


class LocalClient:
    """An `AsyncWeightSyncClient` over worker engines in this process.

    Each call runs on every engine concurrently, each in its own worker thread (engine
    calls block: `update_weights` returns only when that engine received all the
    data). The first failure is re-raised as itself (see `fan_out`).

    Each engine is driven under its own round state machine, as the worker server
    drives its engine (see `RoundDriver`): a call out of order, for another round
    or from another trainer is refused with a `RoundConflictError`, and a version
    is published only by the finish that closes a round that fully succeeded.

    Args:
        engines: the worker engines to drive, e.g. one per TP rank in the process.
    """

    def __init__(self, engines: Sequence[Engine]) -> None:
        if isinstance(engines, WeightTransferEngine):
            raise TypeError("engines should be a sequence of engines; wrap a single one: [engine]")
        if not engines:
            raise ValueError("engines should hold at least one WeightTransferEngine, got none")
        self.engines: tuple[Engine, ...] = tuple(engines)
        self._drivers = tuple(RoundDriver(engine) for engine in self.engines)

    def split(self) -> list[LocalClient]:
        """One client per engine, each driving it under this client's own round state
        machine: to address the engines one by one."""
        parts = []
        for engine, driver in zip(self.engines, self._drivers):
            part = LocalClient([engine])
            part._drivers = (driver,)
            parts.append(part)
        return parts

    async def _on_each(self, fn: Callable[[RoundDriver], Coroutine[Any, Any, None]]) -> None:
        await fan_out([functools.partial(fn, driver) for driver in self._drivers])

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Parse `init_info` and set up every engine's transport.

        Cancellation: waits for the engine threads to return (they cannot be
        interrupted); the engines may be left initialised.
        """
        await self._on_each(lambda driver: driver.init(init_info))

    async def start_weight_update(
        self, *, round_id: int | None = None, trainer_id: str | None = None
    ) -> None:
        """Start a round on every engine; `round_id` and `trainer_id` (both optional)
        name it, so that only the finish naming it can close it.

        Cancellation: waits for the engine threads; the round may have started.
        """
        await self._on_each(lambda driver: driver.start(round_id=round_id, trainer_id=trainer_id))

    async def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        """Receive the round's weights on every engine; returns when all received them.

        Cancellation: waits for the engine threads, which return only when their
        transport finishes or aborts the round: the caller must abort the round on
        the sending side (the trainer engine does).
        """
        await self._on_each(lambda driver: driver.update(update_info))

    async def finish_weight_update(
        self,
        weight_version: str | None = None,
        *,
        round_id: int | None = None,
        trainer_id: str | None = None,
    ) -> None:
        """Drain every engine and publish `weight_version` (see `finish_engine_round`).

        Cancellation: waits for the engine threads; versions may have been published.
        """
        await self._on_each(
            lambda driver: driver.finish(weight_version, round_id=round_id, trainer_id=trainer_id)
        )

    async def shutdown(self) -> None:
        """Release every engine's transfer resources (`engine.shutdown()`), concurrently.

        Cancellation: waits for the engine threads; engines may be shut down.
        """
        await self._on_each(lambda driver: driver.shutdown(drop=False))
