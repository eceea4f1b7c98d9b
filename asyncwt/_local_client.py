"""An async control-plane client over worker engines living in this process."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import anyio
import anyio.to_thread

from ._client import WeightTransferUpdatePayload
from ._concurrency import fan_out
from ._worker import WeightTransferEngine

__all__ = ["LocalClient", "finish_engine_round"]

Engine = WeightTransferEngine[Any, Any]


def finish_engine_round(engine: Engine, weight_version: str | None) -> None:
    """Call `engine.finish_weight_update`, passing `weight_version` when one is given.

    vLLM's base signature takes no argument; asyncwt's engines accept an optional
    `weight_version` that they publish after the drain. Without a version the call
    is the plain spec one, so both kinds of engine work; an engine that cannot take
    a version it is given fails with a `TypeError` saying so.
    """
    finish = engine.finish_weight_update
    if weight_version is None:
        finish()
        return
    try:
        inspect.signature(finish).bind(weight_version)
    except TypeError:
        raise TypeError(
            f"{type(engine).__name__}.finish_weight_update takes no weight_version; "
            f"got {weight_version!r}"
        ) from None
    cast(Any, finish)(weight_version)


class LocalClient:
    """An `AsyncWeightSyncClient` over worker engines in this process.

    Each call runs on every engine concurrently, each in its own worker thread (engine
    calls block: `update_weights` returns only when that engine received all the
    data). The first failure is re-raised as itself (see `fan_out`).

    Args:
        engines: the worker engines to drive, e.g. one per TP rank in the process.
    """

    def __init__(self, engines: Sequence[Engine]) -> None:
        if isinstance(engines, WeightTransferEngine):
            raise TypeError("engines should be a sequence of engines; wrap a single one: [engine]")
        if not engines:
            raise ValueError("engines should hold at least one WeightTransferEngine, got none")
        self.engines: tuple[Engine, ...] = tuple(engines)

    async def _on_each(self, fn: Callable[[Engine], object]) -> None:
        await fan_out(
            [
                functools.partial(anyio.to_thread.run_sync, functools.partial(fn, engine))
                for engine in self.engines
            ]
        )

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Parse `init_info` and set up every engine's transport.

        Cancellation: waits for the engine threads to return (they cannot be
        interrupted); the engines may be left initialised.
        """
        await self._on_each(
            lambda engine: engine.init_transfer_engine(engine.parse_init_info(init_info))
        )

    async def start_weight_update(self) -> None:
        """Start a round on every engine.

        Cancellation: waits for the engine threads; the round may have started.
        """
        await self._on_each(lambda engine: engine.start_weight_update())

    async def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        """Receive the round's weights on every engine; returns when all received them.

        Cancellation: waits for the engine threads, which return only when their
        transport finishes or aborts the round: the caller must abort the round on
        the sending side (the trainer engine does).
        """
        await self._on_each(lambda engine: engine.update_weights(update_info))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Drain every engine and publish `weight_version` (see `finish_engine_round`).

        Cancellation: waits for the engine threads; versions may have been published.
        """
        await self._on_each(lambda engine: finish_engine_round(engine, weight_version))

    async def shutdown(self) -> None:
        """Release every engine's transfer resources (`engine.shutdown()`), concurrently.

        Cancellation: waits for the engine threads; engines may be shut down.
        """
        await self._on_each(lambda engine: engine.shutdown())
