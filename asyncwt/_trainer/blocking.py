"""A blocking façade over the async trainer engine, for plain (non-async) trainers.

The async engine runs on one private event loop thread (uvloop when installed);
`send_weights` submits the round there and blocks until it ends. There is no
second copy of the pipeline: this module only crosses the thread boundary.

What belongs to the caller's thread is taken there, before crossing: the device
(a bare `"cuda"` is the caller's current CUDA device, not the loop thread's) and
each round's fence (the work queued on the caller's current stream, which the
round must wait for before it reads the weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import anyio.from_thread
from typing_extensions import Self

from .._core.device import resolve_device
from .._core.protocol import AnyWeightSyncClient
from .._core.registry import trainer_init
from .._core.settings import PipelineSettings
from .._core.source import WeightSource
from .._core.stats import Progress, RoundStats
from .._core.trainer_api import TrainerInitInfo, TrainerWeightTransferEngine

__all__ = ["SyncTrainerEngine"]

_CANCEL_GRACE_S = 60.0
_SIGNAL_POLL_S = 0.05


def _refuse_inside_event_loop(what: str) -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        f"SyncTrainerEngine.{what} was called from inside a running event loop, where it "
        f"would block the loop; use the async engine instead: "
        f"`engine = await asyncwt.trainer_init(...)` and `await engine.send_weights()`"
    )


@contextlib.contextmanager
def _sigint_handler(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Route SIGINT to `handler` while inside, if Python's default handler is in place.

    A program that installed its own SIGINT handler keeps it; so does a call made
    outside the main thread (only the main thread can set handlers).
    """
    in_main = threading.current_thread() is threading.main_thread()
    if not in_main or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return False
    return True


class SyncTrainerEngine:
    """The trainer engine for a plain `for step in ...` loop; call it on every rank.

    Built from the same arguments as `asyncwt.trainer_init`; `send_weights` blocks
    and returns the same `RoundStats`. Ctrl-C during `send_weights` cancels the
    round cleanly (the workers are told to abort, nothing is published) and then
    raises `KeyboardInterrupt`; the next call starts a clean round.

    Use it as a context manager, or call `shutdown()` when done. An async client
    (e.g. `HttpClient`) lives on the engine's private loop, so shutdown closes it
    too (its `close()` coroutine), before that loop ends.
    """

    def __init__(
        self,
        init_info: TrainerInitInfo,
        *,
        client: AnyWeightSyncClient,
        source: WeightSource | None = None,
    ) -> None:
        _refuse_inside_event_loop("__init__")
        if isinstance(init_info, PipelineSettings):
            device = resolve_device(init_info.device, source)  # in the caller's thread
            init_info = dataclasses.replace(init_info, device=str(device))  # type: ignore[call-arg]
        self._portal_cm = anyio.from_thread.start_blocking_portal(
            "asyncio", {"use_uvloop": _uvloop_available()}
        )
        self._portal = self._portal_cm.__enter__()
        self._client = client
        try:
            self.engine: TrainerWeightTransferEngine[Any] = self._run(
                functools.partial(trainer_init, init_info, client=client, source=source)
            )
        except BaseException:
            self._close_loop()
            raise
        self._closed = False

    async def _close_client(self) -> None:
        close = getattr(self._client, "close", None)
        if close is not None and asyncio.iscoroutinefunction(close):
            await close()

    def _close_loop(self) -> None:
        try:
            self._portal.call(self._close_client)
        finally:
            self._portal_cm.__exit__(None, None, None)

    def _run(self, fn: Any) -> Any:
        """Run coroutine function `fn` on the engine's loop; Ctrl-C cancels it there.

        While it runs, SIGINT (when Python's default handler is installed) cancels
        the task instead of raising at an arbitrary point of this thread; once the
        cancelled task has finished (the round aborted on the workers),
        `KeyboardInterrupt` is raised here.
        """
        finished = threading.Event()
        interrupted = threading.Event()
        future: Future[Any] | None = None

        async def run() -> Any:
            try:
                return await fn()
            finally:
                finished.set()

        def on_sigint(signum: int, frame: object) -> None:
            interrupted.set()
            if future is not None:
                future.cancel()

        with _sigint_handler(on_sigint):
            future = self._portal.start_task_soon(run)
            if interrupted.is_set():
                future.cancel()
            # Wait in short slices: Python runs a signal handler only when this
            # thread gets back to bytecode, not inside a blocked wait.
            while not finished.wait(_SIGNAL_POLL_S) and not future.done():
                pass
            if interrupted.is_set():
                finished.wait(_CANCEL_GRACE_S)
                raise KeyboardInterrupt
        return future.result()

    def send_weights(
        self, *, weight_version: str | None = None, progress: Progress | None = None
    ) -> RoundStats:
        """Run one round (blocking) and return its stats; see the async `send_weights`.

        `progress(sent_bytes, total_bytes)` is called from the engine's loop thread,
        not the caller's."""
        _refuse_inside_event_loop("send_weights")
        if self._closed:
            raise RuntimeError("send_weights called after shutdown()")
        fence = getattr(self.engine, "fence", None)
        join = getattr(self.engine, "join_caller", None)
        kwargs: dict[str, Any] = {"weight_version": weight_version}
        if progress is not None:
            kwargs["progress"] = progress
        if fence is not None:
            kwargs["after"] = fence()  # the caller's stream, in the caller's thread
        if join is not None:
            kwargs["join"] = False  # joined below, on the caller's stream
        try:
            stats: RoundStats = self._run(functools.partial(self.engine.send_weights, **kwargs))
        finally:
            if join is not None:
                join()  # the caller's stream waits for the round's lanes
        return stats

    def shutdown(self) -> None:
        """Shut the engine down and stop its loop thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.engine.shutdown)
        finally:
            self._close_loop()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()
