"""An async control-plane client over Ray actor handles: vLLM's actors or asyncwt's.

Ray is an optional dependency (`pip install 'asyncwt[ray]'`): this module imports it
only when a `RayClient` is constructed, so `import asyncwt` never needs it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import anyio

from .._core.concurrency import fan_out
from .._core.errors import ControlPlaneError
from .._core.optional import import_ray
from .._core.protocol import WeightTransferUpdatePayload
from .._core.worker_api import WeightTransferInitRequest, WeightTransferUpdateRequest
from .pause import PauseMode, RoundPause

__all__ = ["RayClient", "import_ray"]

_ASYNCWT_MARKER = "weights_status"
"""The method that marks an actor as asyncwt's worker actor (it takes round ids)."""


def describe_actor(handle: Any) -> str:
    """`ClassName actor <id>`: what an error names (Ray's own text adds the actor's name)."""
    descriptor = getattr(handle, "_ray_actor_creation_function_descriptor", None)
    class_name = (getattr(descriptor, "class_name", None) or "Ray").rsplit(".", 1)[-1]
    actor_id: Any = getattr(handle, "_actor_id", None)
    ident = actor_id.hex() if actor_id is not None else "?"
    return f"{class_name} actor {ident}"


class RayClient:
    """An `AsyncWeightSyncClient` over one or more Ray actor handles.

    Each call goes to every actor concurrently and returns when all answered (see
    `fan_out`): an actor's `update_weights` returns only once it received the whole
    round, so the calls must overlap. The trainer awaits Ray's object refs on its
    event loop (never `ray.get`), so the loop keeps streaming the round meanwhile; it
    works the same under `SyncTrainerEngine`, whose loop runs on a thread of its own.
    The weights themselves never go through Ray: they travel on the trainer engine's
    transport (tcp by default), as with `HttpClient`.

    Two kinds of actor are spoken to, with the payloads each expects:

    - asyncwt's worker actor (`asyncwt._worker.ray_actor.WorkerActor`, recognised by
      its `weights_status` method): a request object for init and update, and the
      round's `round_id` and `trainer_id` with start and finish, so that its round
      state machine ties them to one round of one trainer (as over HTTP).
    - vLLM's `LLM` / `AsyncLLM` actors: exactly what vLLM's own Ray client sends, a
      `WeightTransferInitRequest(init_info=...)` / `WeightTransferUpdateRequest(
      update_info=...)` (asyncwt's classes of the same shape; asyncwt is installed
      there anyway for its backends), `finish_weight_update()` then
      `update_weight_version(version)`.

    Args:
        actors: the actor handles, or one handle.
        timeout: seconds a single call may take on all actors together;
            `update_weights` lasts a whole round, so keep it generous.
        pause: vLLM actors only (asyncwt's have nothing to pause): call
            `pause_generation(mode=pause, clear_cache=True)` on each before
            `start_weight_update`, and `resume_generation()` after
            `finish_weight_update` or as soon as the round failed; the modes and the
            default (None) are `HttpClient`'s.

    Raises:
        ImportError: at construction, when Ray is not installed.
        ControlPlaneError: from every call, when an actor died (killed, crashed, its
            node lost), a call raised in the actor, or no answer came within
            `timeout`; the message names the actor and the method. The remote call
            itself is not cancelled: the trainer engine aborts the round on its
            transport, and nothing is published.
    """

    def __init__(
        self,
        actors: Any | Sequence[Any],
        *,
        timeout: float = 300.0,
        pause: PauseMode | None = None,
    ) -> None:
        ray = import_ray()
        handles = list(actors) if isinstance(actors, Sequence) else [actors]
        if not handles:
            raise ValueError("actors should hold at least one Ray actor handle, got none")
        for handle in handles:
            if not isinstance(handle, ray.actor.ActorHandle):
                raise TypeError(
                    f"actors should be Ray actor handles (from ActorClass.remote()), "
                    f"got {type(handle).__name__}"
                )
        if not timeout > 0:
            raise ValueError(f"timeout should be > 0 seconds, got {timeout!r}")
        self.actors: tuple[Any, ...] = tuple(handles)
        self.timeout = timeout
        self._ray_error: type[BaseException] = ray.exceptions.RayError
        self._task_error: type[BaseException] = ray.exceptions.RayTaskError
        self._pause = RoundPause(pause, self._pause_all, self._resume_all)

    @property
    def paused_s(self) -> float | None:
        """Seconds generation was paused in the last round (None without `pause`)."""
        return self._pause.paused_s

    async def _on_vllm(self, method: str, **kwargs: Any) -> None:
        await fan_out(
            [
                functools.partial(self._call, h, method, **kwargs)
                for h in self.actors
                if not self.speaks_rounds(h)
            ]
        )

    async def _pause_all(self, mode: PauseMode) -> None:
        await self._on_vllm("pause_generation", mode=mode, clear_cache=True)

    async def _resume_all(self) -> None:
        await self._on_vllm("resume_generation")

    async def round_failed(self) -> None:
        """The trainer engine's call after a failed round: resume generation if this
        client paused it (errors are logged, not raised). Without `pause`, a no-op."""
        await self._pause.end_quietly()

    def speaks_rounds(self, handle: Any) -> bool:
        """Whether `handle` is asyncwt's worker actor (sent round ids) or another (vLLM's)."""
        return hasattr(handle, _ASYNCWT_MARKER)

    async def _call(self, handle: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        """`handle.method.remote(...)`, awaited: its result, or a `ControlPlaneError`."""
        where = f"{method} on {describe_actor(handle)}"
        try:
            with anyio.fail_after(self.timeout):
                return await getattr(handle, method).remote(*args, **kwargs)
        except TimeoutError:
            raise ControlPlaneError(f"{where} failed: no answer within {self.timeout} s") from None
        except self._ray_error as exc:
            raise ControlPlaneError(f"{where} failed: {_reason(exc, self._task_error)}") from exc

    async def _on_each(self, method: str, *args: Any, **kwargs: Any) -> None:
        await fan_out(
            [functools.partial(self._call, h, method, *args, **kwargs) for h in self.actors]
        )

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Init every actor's transfer engine with `init_info` (connect to the trainer).

        Cancellation: the calls are abandoned; an actor may still complete its init.
        """
        await self._on_each("init_weight_transfer_engine", WeightTransferInitRequest(init_info))

    async def start_weight_update(
        self, *, round_id: int | None = None, trainer_id: str | None = None
    ) -> None:
        """Start a round on every actor; asyncwt's actors also get `round_id` and
        `trainer_id` (optional; the trainer engine sends them).

        Cancellation: the calls are abandoned; an actor may still start the round.
        """
        ids = _round_ids(round_id, trainer_id)

        async def start(handle: Any) -> None:
            keywords = ids if self.speaks_rounds(handle) else {}
            await self._call(handle, "start_weight_update", **keywords)

        await self._pause.begin()
        try:
            await fan_out([functools.partial(start, h) for h in self.actors])
        except BaseException:
            await self._pause.end_quietly()
            raise

    async def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        """Receive the round on every actor; returns when all received it.

        Cancellation: the calls are abandoned; each actor keeps receiving until its
        transport finishes or aborts, so the sender must abort the round (the
        trainer engine does).
        """
        try:
            await self._on_each("update_weights", WeightTransferUpdateRequest(update_info))
        except BaseException:
            await self._pause.end_quietly()
            raise

    async def finish_weight_update(
        self,
        weight_version: str | None = None,
        *,
        round_id: int | None = None,
        trainer_id: str | None = None,
    ) -> None:
        """Every actor drains and publishes `weight_version`.

        An asyncwt actor closes the round `round_id` and `trainer_id` name (refusing
        any other) and publishes only if the whole round succeeded. A vLLM actor is
        sent `finish_weight_update()`, then `update_weight_version(weight_version)`.

        Cancellation: the calls are abandoned; actors may still publish.
        """
        ids = _round_ids(round_id, trainer_id)

        async def finish(handle: Any) -> None:
            if self.speaks_rounds(handle):
                await self._call(handle, "finish_weight_update", weight_version, **ids)
                return
            await self._call(handle, "finish_weight_update")
            if weight_version is not None:
                await self._call(handle, "update_weight_version", weight_version)

        try:
            await fan_out([functools.partial(finish, h) for h in self.actors])
        finally:
            await self._pause.end()

    async def shutdown(self) -> None:
        """`shutdown_weight_transfer_engine` on every actor: release its transport.

        The actors keep running (a later init sets the transport up again).
        Cancellation: actors may still shut their transport down.
        """
        await self._on_each("shutdown_weight_transfer_engine")

    async def weights_status(self, *, checksum: bool = False) -> list[dict[str, Any]]:
        """Every asyncwt actor's status, concurrently, in `actors` order.

        The same dicts as the worker server's `GET /weights_status`: `weight_version`,
        `weights_incomplete`, `checksum` (see `model_checksum`; None unless `checksum`
        is true: it hashes every weight), `backend`, `initialized`. Cancellation: the
        calls are abandoned; nothing changes.

        Raises:
            TypeError: an actor is not asyncwt's worker actor (it has no status).
        """
        for handle in self.actors:
            if not self.speaks_rounds(handle):
                raise TypeError(
                    f"{describe_actor(handle)} has no weights_status method: only "
                    "asyncwt's worker actor reports a status"
                )
        results: list[dict[str, Any]] = [{} for _ in self.actors]

        async def fetch(index: int) -> None:
            results[index] = await self._call(
                self.actors[index], "weights_status", checksum=checksum
            )

        await fan_out([functools.partial(fetch, i) for i in range(len(self.actors))])
        return results


def _round_ids(round_id: int | None, trainer_id: str | None) -> dict[str, Any]:
    ids: dict[str, Any] = {}
    if round_id is not None:
        ids["round_id"] = round_id
    if trainer_id is not None:
        ids["trainer_id"] = trainer_id
    return ids


def _reason(exc: BaseException, task_error: type[BaseException]) -> str:
    """What went wrong in the actor: the remote error's type and message, or Ray's
    account of the actor's death (which names the actor, its pid and node)."""
    if isinstance(exc, task_error):
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            return f"{type(cause).__name__}: {cause}"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}"
