"""Small structured-concurrency helpers shared by the engines."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import sys

import anyio

if sys.version_info < (3, 11):  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup

__all__ = ["single_error"]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:  # type: ignore[type-arg]
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            leaves.extend(_leaves(exc))
        else:
            leaves.append(exc)
    return leaves


@contextlib.contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a task group's lone real error by itself, not wrapped in a group.

    anyio wraps every task-group failure in an exception group; a user of
    `send_weights` should see the `TransferError` that ended the round. When the
    group holds several real errors (not cancellations), it is re-raised as is.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        real = [e for e in _leaves(group) if not isinstance(e, anyio.get_cancelled_exc_class())]
        if len(real) == 1:
            raise real[0] from None
        raise
