"""Small shared pieces: round timing with medians, and blocking socket helpers."""

from __future__ import annotations

import socket
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = [
    "IO_TIMEOUT_S",
    "Rounds",
    "gbps",
    "recv_exact",
    "recv_into_all",
    "run_async",
    "summarize",
]

IO_TIMEOUT_S = 300.0
"""Seconds any single benchmark socket operation may block before the run fails."""


def run_async(fn: Callable[[], Awaitable[T]]) -> T:
    """Run an async callable on a fresh event loop (uvloop when installed)."""
    import anyio

    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        options = {}
    return anyio.run(fn, backend="asyncio", backend_options=options)


def gbps(nbytes: int, seconds: float) -> float:
    """Throughput in GB/s (1e9 bytes per second)."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def summarize(times: list[float], nbytes: int, warmup: list[float], **extra: Any) -> dict[str, Any]:
    """The JSON record of one measurement: every round, the median and its throughput."""
    median = statistics.median(times)
    return {
        "bytes": nbytes,
        "rounds_s": times,
        "warmup_s": warmup,
        "median_s": median,
        "min_s": min(times),
        "max_s": max(times),
        "gbps": gbps(nbytes, median),
        **extra,
    }


@dataclass(frozen=True, kw_only=True, slots=True)
class Rounds:
    """How many rounds each figure takes: `warmup` discarded, then `rounds` timed."""

    rounds: int = 3
    """Timed rounds; each figure is their median."""
    warmup: int = 1
    """Untimed rounds first (page faults, lazy allocations, connection ramp-up)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rounds, int) or self.rounds < 3:
            raise ValueError(
                f"rounds should be an int >= 3 (figures are medians), got {self.rounds!r}"
            )
        if not isinstance(self.warmup, int) or self.warmup < 1:
            raise ValueError(f"warmup should be an int >= 1, got {self.warmup!r}")

    @property
    def total(self) -> int:
        return self.rounds + self.warmup

    def measure(self, one: Callable[[], float], nbytes: int, **extra: Any) -> dict[str, Any]:
        """Run `one()` (which returns its own elapsed seconds) warmup + rounds times."""
        times = [one() for _ in range(self.total)]
        return summarize(times[self.warmup :], nbytes, times[: self.warmup], **extra)

    async def ameasure(
        self, one: Callable[[], Awaitable[float]], nbytes: int, **extra: Any
    ) -> dict[str, Any]:
        """`measure` for an async round."""
        times = [await one() for _ in range(self.total)]
        return summarize(times[self.warmup :], nbytes, times[: self.warmup], **extra)


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Blocking receive of exactly `nbytes`; EOF is a `ConnectionError`."""
    buffer = bytearray(nbytes)
    recv_into_all(sock, memoryview(buffer), max(nbytes, 1))
    return bytes(buffer)


def recv_into_all(sock: socket.socket, view: memoryview, chunk: int) -> None:
    """Fill `view` from `sock`, asking for at most `chunk` bytes per call."""
    got, total = 0, len(view)
    while got < total:
        n = sock.recv_into(view[got : got + chunk])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {total} bytes")
        got += n
