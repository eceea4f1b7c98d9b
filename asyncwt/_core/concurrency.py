"""Structured-concurrency helpers shared by the engines and clients."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any

import anyio

if sys.version_info < (3, 11):  # pragma: no cover - the builtin arrived in 3.11
    from exceptiongroup import BaseExceptionGroup

__all__ = ["fan_out", "single_error", "unwrap_group"]


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def _cancelled_class() -> type[BaseException]:
    """anyio's cancellation class; outside a loop (a command line reporting a failed
    `anyio.run`), asyncio's, the backend asyncwt runs on."""
    try:
        return anyio.get_cancelled_exc_class()
    except RuntimeError:  # anyio.NoEventLoopError: no loop is running
        return asyncio.CancelledError


def unwrap_group(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first real error of `group`, with the others added as notes.

    Cancellations of siblings are consequences, not causes, and are dropped. When a
    leaf is neither an `Exception` nor a cancellation (KeyboardInterrupt, ...) the
    group itself is returned, so that nothing is hidden.
    """
    leaves = [exc for exc in _leaves(group) if not isinstance(exc, _cancelled_class())]
    if not leaves or not all(isinstance(exc, Exception) for exc in leaves):
        return group
    first, *others = leaves
    add_note = getattr(first, "add_note", None)  # absent before 3.11
    if add_note is not None:
        for other in others:
            add_note(f"also failed concurrently: {type(other).__name__}: {other}")
    return first


@contextlib.contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a task group's failure as its first real error, not as a group.

    anyio wraps every task-group failure in an exception group; a caller of
    `send_weights` should see the `TransferError` that ended the round.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        error = unwrap_group(group)
        if error is group:
            raise
        try:
            raise error from error.__cause__
        finally:
            del error  # break the frame <-> traceback cycle


async def fan_out(calls: Sequence[Callable[[], Coroutine[Any, Any, object]]]) -> None:
    """Await every call concurrently; the first failure cancels the rest and is re-raised.

    Concurrency is required, not an optimisation: a worker's `update_weights` returns
    only once it received the whole round, and the trainer sends to every worker at
    once, so calling them one after the other would deadlock.

    Cancellation: every call is cancelled (a call running in a thread is waited for,
    since a thread cannot be interrupted) before this returns.
    """
    with single_error():
        async with anyio.create_task_group() as tg:
            for call in calls:
                tg.start_soon(call)
