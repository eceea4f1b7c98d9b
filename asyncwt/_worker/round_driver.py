"""One worker engine driven under the round state machine: the worker server's and
`LocalClient`'s shared path to an engine.

Each control call asks `RoundState` first (a refusal is a `RoundConflictError` and
changes nothing), runs the engine call in a worker thread, then reports the outcome.
Start and finish run one at a time; an update runs for a whole round, so it holds
no lock, and the state machine keeps a late one out of the next round.
"""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import anyio
import anyio.to_thread
import torch

from .._core.checksum import model_checksum
from .._core.errors import PlanMismatchError, RoundConflictError, StaleRoundError, TransferError
from .._core.worker_api import WeightTransferEngine
from .metrics import WorkerMetrics
from .rounds import RoundState

__all__ = ["InvalidInfoError", "RoundDriver", "finish_engine_round", "weights_status"]

logger = logging.getLogger("asyncwt.worker")

T = TypeVar("T")
Engine = WeightTransferEngine[Any, Any]

_REFUSALS = (PlanMismatchError, StaleRoundError, RoundConflictError)
"""Engine errors that mean "not this update" before anything changed."""


class InvalidInfoError(ValueError):
    """The engine's `parse_*_info` rejected an info (its `ValueError`/`TypeError`)."""


async def _in_thread(fn: Callable[[], T]) -> T:
    return await anyio.to_thread.run_sync(fn)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _optional_str(info: object, name: str) -> str | None:
    value = getattr(info, name, None)
    return value if isinstance(value, str) and value else None


def _optional_int(info: object, name: str) -> int | None:
    value = getattr(info, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _round_bytes(engine: Engine | None) -> int | None:
    """The payload bytes of one of the engine's rounds, where it says (asyncwt's do)."""
    return None if engine is None else engine.round_bytes


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


class RoundDriver:
    """Drives one engine's rounds under a `RoundState` (see the module docstring).

    At INFO it logs each init (a trainer connected), each round's update received
    and each publish, with the round's bytes and seconds, and each failed call.

    Args:
        engine: the engine, or None to build one with `create` at the first init.
        create: builds a new engine after `shutdown(drop=True)` (the server's way).
        metrics: counters to update as rounds go (the server's `GET /metrics`).
    """

    def __init__(
        self,
        engine: Engine | None,
        *,
        create: Callable[[], Engine] | None = None,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.engine = engine
        self._create = create
        self.metrics = metrics
        self._started_at = 0.0
        """`perf_counter` when the open round started (its seconds, at the publish)."""
        self.state = RoundState()
        self._init_lock = anyio.Lock()
        self._transition = anyio.Lock()
        """Held around the engine's start and finish: they never overlap."""
        self.untouched_params: tuple[str, ...] = ()
        """The parameters the published version left as they were (see
        `DeferredWorkerEngine.untouched_params`); outlives the engine."""

    @property
    def weights_incomplete(self) -> bool:
        """Whether the weights may be a mix: recorded, or the engine says so right now."""
        return self.state.weights_incomplete or self._engine_flag(self.engine) is True

    def ready_engine(self, route: str) -> Engine:
        """The initialised engine, or a `RoundConflictError` saying to init first."""
        if self.engine is None or not self.state.initialized:
            raise RoundConflictError(
                f"{route} needs an initialised transfer engine: "
                "POST /init_weight_transfer_engine first"
            )
        return self.engine

    async def init(self, init_info: dict[str, Any]) -> None:
        """Parse `init_info` and init the engine (a second init re-initialises).

        Abandons the open round. Cancellation: waits for the engine's thread.
        """
        async with self._init_lock:
            if self.engine is None:
                if self._create is None:
                    raise RuntimeError("this engine was shut down; create a new one")
                self.engine = await _in_thread(self._create)
            engine = self.engine
            parsed = await self._parse(functools.partial(engine.parse_init_info, init_info))
            async with self._transition:
                self.state.begin_init()
                try:
                    await _in_thread(functools.partial(engine.init_transfer_engine, parsed))
                except BaseException as exc:
                    self._failed("init", "init_weight_transfer_engine", exc)
                    raise
                finally:
                    self._note_engine(engine)
                if self.engine is not engine:
                    raise RoundConflictError("the transfer engine was shut down during its init")
                trainer = _optional_str(parsed, "trainer_id")
                self.state.end_init(trainer)
                if self.metrics is not None:
                    self.metrics.connected()
                logger.info(
                    "trainer %s connected: %s initialised for %s bytes a round",
                    trainer or "(unnamed)",
                    type(engine).__name__,
                    _round_bytes(engine) or "?",
                )

    async def start(self, *, round_id: int | None = None, trainer_id: str | None = None) -> None:
        """Open a round (abandoning an open one) and start it on the engine."""
        engine = self.ready_engine("start_weight_update")
        async with self._transition:
            opened = self.state.start(round_id=round_id, trainer_id=trainer_id)
            self._started_at = time.perf_counter()
            try:
                await _in_thread(engine.start_weight_update)
            except BaseException as exc:
                self.state.start_failed(opened, _describe(exc))
                self._failed("start", opened.name, exc)
                raise
            finally:
                self._note_engine(engine)

    async def update(self, update_info: dict[str, Any]) -> None:
        """Receive one update of the open round (see `RoundState.begin_update`)."""
        engine = self.ready_engine("update_weights")
        # Parsed here, not in a thread: an update info is a few fields, and with no
        # checkpoint before the engine's thread starts, a client driving several
        # engines at once (LocalClient) has them all receiving before one failure
        # cancels the rest.
        try:
            parsed = engine.parse_update_info(update_info)
        except (ValueError, TypeError) as exc:
            raise InvalidInfoError(str(exc)) from exc
        ticket = self.state.begin_update(
            round_id=_optional_int(parsed, "round_id"),
            trainer_id=_optional_str(parsed, "trainer_id"),
            carries_ids=hasattr(parsed, "round_id") and hasattr(parsed, "trainer_id"),
        )
        try:
            await _in_thread(functools.partial(engine.update_weights, update_info))
        except _REFUSALS:
            self.state.end_update(ticket, refused=True)
            raise
        except BaseException as exc:
            self.state.end_update(ticket, error=_describe(exc))
            self._note_engine(engine, default=True)
            self._failed("update", f"round {_optional_int(parsed, 'round_id') or '?'}", exc)
            raise
        self.state.end_update(ticket)
        self._note_engine(engine)
        logger.info(
            "round %s received: %s bytes in %.3f s",
            _optional_int(parsed, "round_id") or "?",
            _round_bytes(engine) or "?",
            time.perf_counter() - self._started_at,
        )

    async def finish(
        self,
        weight_version: str | None,
        *,
        round_id: int | None = None,
        trainer_id: str | None = None,
    ) -> None:
        """Close the open round: drain the engine, then publish `weight_version` if the
        whole round succeeded; else raise (a `TransferError` when only the state knew)."""
        engine = self.ready_engine("finish_weight_update")
        async with self._transition:
            closing = self.state.begin_finish(round_id=round_id, trainer_id=trainer_id)
            try:
                await _in_thread(functools.partial(finish_engine_round, engine, weight_version))
            except BaseException as exc:
                self.state.end_finish(closing, weight_version, error=_describe(exc))
                self._note_engine(engine, default=True)
                self._failed("finish", closing.name, exc)
                raise
            reason = self.state.end_finish(closing, weight_version, error=None)
            if reason is not None:
                self._note_engine(engine, default=True)
                error = TransferError(
                    f"{closing.name} did not complete, so version {weight_version!r} is not "
                    f"published: {reason}"
                )
                self._failed("finish", closing.name, error)
                raise error
            self._note_engine(engine)
            self.untouched_params = engine.untouched_params
            seconds = time.perf_counter() - self._started_at
            nbytes = _round_bytes(engine)
            if self.metrics is not None:
                self.metrics.published(weight_version, nbytes, seconds)
            logger.info(
                "%s published as version %s: %s bytes in %.3f s from its start",
                closing.name,
                weight_version,
                nbytes if nbytes is not None else "?",
                seconds,
            )

    async def shutdown(self, *, drop: bool) -> None:
        """Shut the engine down (in a thread); `drop` it so the next init builds a new one.

        Takes no lock on purpose: a shutdown must reach an engine stuck in its init.
        The published version and `weights_incomplete` outlive the engine.
        """
        engine = self.engine
        self._note_engine(engine)
        self.state.shut_down()
        if drop:
            self.engine = None
        if engine is not None:
            await _in_thread(engine.shutdown)

    def _failed(self, stage: str, what: str, exc: BaseException) -> None:
        """Count and log a failed call (a cancellation is neither: nothing failed)."""
        if not isinstance(exc, Exception):
            return
        if self.metrics is not None:
            self.metrics.failed(stage)
        logger.info("%s: %s failed: %s", what, stage, _describe(exc))

    def _note_engine(self, engine: Engine | None, *, default: bool = False) -> None:
        """Record the engine's own `weights_incomplete`; `default` where it has none."""
        flag = self._engine_flag(engine)
        self.state.note_incomplete(default if flag is None else flag)

    @staticmethod
    def _engine_flag(engine: Engine | None) -> bool | None:
        return None if engine is None else engine.weights_incomplete

    @staticmethod
    async def _parse(fn: Callable[[], T]) -> T:
        try:
            return await _in_thread(fn)
        except (ValueError, TypeError) as exc:
            raise InvalidInfoError(str(exc)) from exc


async def weights_status(
    driver: RoundDriver, model: torch.nn.Module, backend: str, *, checksum: bool = False
) -> dict[str, Any]:
    """What a worker reports about its weights (the server's `GET /weights_status`).

    `weight_version` (the last round that completed), `weights_incomplete`, `backend`
    and `initialized` cost nothing: poll them, or use them as a health probe.
    `checksum` is None unless asked for: `model_checksum` hashes every weight (in a
    worker thread), seconds on a 1 GiB model and minutes on a 70B one.
    `untouched_params` lists the model's parameters that version left as they were (the
    trainer opted in to a partial update; empty otherwise).
    """
    digest = await _in_thread(functools.partial(model_checksum, model)) if checksum else None
    return {
        "weight_version": driver.state.weight_version,
        "weights_incomplete": driver.weights_incomplete,
        "checksum": digest,
        "backend": backend,
        "initialized": driver.state.initialized,
        "untouched_params": list(driver.untouched_params),
    }
