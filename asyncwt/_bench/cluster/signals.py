"""Signals during a cluster run: SIGTERM and SIGHUP unwind like Ctrl-C; cleanup is not
interrupted.

`interrupts_unwind()` turns SIGTERM and SIGHUP into `KeyboardInterrupt` (as Ctrl-C's
SIGINT already is), so every `finally` runs on every signal a user or a supervisor
sends. `deferred_signals()` holds those three off while the processes are stopped and
the namespaces removed: a second Ctrl-C cannot cut the cleanup short; it is raised
once the cleanup finished.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["UNWIND_SIGNALS", "deferred_signals", "interrupts_unwind"]

UNWIND_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@contextlib.contextmanager
def interrupts_unwind() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP raise `KeyboardInterrupt`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in UNWIND_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def deferred_signals() -> Iterator[None]:
    """Within the block, SIGINT, SIGTERM and SIGHUP are only recorded; the first one
    is raised as `KeyboardInterrupt` when the block ends (unless the block raised)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def record(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, record) for sig in UNWIND_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise KeyboardInterrupt(f"stopped by {signal.Signals(received[0]).name} (after cleanup)")
