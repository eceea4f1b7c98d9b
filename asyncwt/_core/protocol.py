"""The control plane as the trainer sees it: vLLM's four weight-sync calls."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Protocol, TypeAlias, runtime_checkable

import anyio.to_thread

__all__ = [
    "AsyncWeightSyncClient",
    "VLLMWeightSyncClient",
    "WeightTransferUpdatePayload",
    "call_client",
    "round_keywords",
]

WeightTransferUpdatePayload = dict[str, Any]
"""What `update_weights` carries: a plain, JSON-serialisable dict."""


@runtime_checkable
class VLLMWeightSyncClient(Protocol):
    """The inference side's weight-sync control plane, synchronous (vLLM's protocol).

    Four methods taking plain dicts, as vLLM's HTTP routes, engine client or Ray
    actors accept them. Structural: any object with these methods complies, no import
    needed. Concurrency a transport needs (receiving while the trainer sends) is the
    engine's job: it calls these from a thread, never on the event loop.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: WeightTransferUpdatePayload) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


@runtime_checkable
class AsyncWeightSyncClient(Protocol):
    """The same four calls as `VLLMWeightSyncClient`, as coroutines.

    The engine awaits them directly on its event loop.
    """

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    async def start_weight_update(self) -> None: ...

    async def update_weights(self, update_info: WeightTransferUpdatePayload) -> None: ...

    async def finish_weight_update(self, weight_version: str | None = None) -> None: ...


AnyWeightSyncClient: TypeAlias = VLLMWeightSyncClient | AsyncWeightSyncClient

_METHODS = (
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)


def check_client(client: object) -> None:
    """Raise `TypeError` unless `client` has the four control-plane methods."""
    missing = [m for m in _METHODS if not callable(getattr(client, m, None))]
    if missing:
        raise TypeError(
            f"client should implement VLLMWeightSyncClient or AsyncWeightSyncClient; "
            f"{type(client).__name__} lacks {', '.join(missing)}"
        )


def round_keywords(client: object, method: str, **ids: object) -> dict[str, object]:
    """The round-identity keywords (`round_id`, `trainer_id`) that `client.method` takes.

    vLLM's protocol methods take none; asyncwt's clients accept them optionally, so
    that the worker can tie `start_weight_update` and `finish_weight_update` to one
    round of one trainer. A client that takes none gets none (and the worker ties
    the round by its update infos alone).
    """
    try:
        parameters = inspect.signature(getattr(client, method)).parameters
    except (TypeError, ValueError):  # a callable without a readable signature
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(ids)
    keyword = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return {
        name: value
        for name, value in ids.items()
        if name in parameters and parameters[name].kind in keyword
    }


async def call_client(client: object, method: str, *args: Any, **kwargs: Any) -> None:
    """Call `client.method(*args, **kwargs)`: awaited if it is a coroutine function, else
    in a thread.

    A synchronous client call may block for a whole round (`update_weights` returns
    when the worker has received everything), so it must never run on the loop.
    Cancellation: a coroutine is cancelled; a thread cannot be interrupted, so it is
    abandoned: the cancelled caller returns at once and the thread finishes in the
    background, its result dropped. The caller should still make the remote side
    return (abort the round), or the thread lingers until the client's own timeout.
    """
    bound = getattr(client, method)
    if inspect.iscoroutinefunction(bound):
        await bound(*args, **kwargs)
        return
    result = await anyio.to_thread.run_sync(
        functools.partial(bound, *args, **kwargs), abandon_on_cancel=True
    )
    if inspect.isawaitable(result):
        await result
