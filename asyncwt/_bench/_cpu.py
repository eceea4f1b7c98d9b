"""How many cores a process kept busy over a window, without psutil.

The benchmark's transfers run at one loopback stream's speed; whether that speed is
bound by a process's CPU (a side that stays busy for the whole round) or by waiting
is what `cores_busy` shows: CPU seconds over wall seconds, every thread of the
process counted (user and system time from `/proc/PID/stat`). 1.0 is one core
busy all the time; a machine's cores bound the sum.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CpuMeter", "cpu_times", "machine_cpu_s", "median_cores", "process_cpu_s"]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_UTIME_FIELD = 11
"""Index of `utime` among the fields after the command name (field 14 of `stat`)."""


def cpu_times(stat_path: str) -> tuple[float, float] | None:
    """(user, system) CPU seconds from a `stat` file of `/proc`: a process's
    (`/proc/PID/stat`, all its threads) or one thread's (`/proc/PID/task/TID/stat`);
    `None` where it cannot be read (not Linux, or it is gone)."""
    try:
        with open(stat_path) as stat:
            text = stat.read()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # the command name may hold spaces
    return int(fields[_UTIME_FIELD]) / _TICKS_PER_S, int(fields[_UTIME_FIELD + 1]) / _TICKS_PER_S


def process_cpu_s(pid: int | None = None) -> float | None:
    """User + system CPU seconds `pid` (this process by default) has used, all its
    threads together; `None` where `/proc` cannot tell (not Linux, or it is gone)."""
    times = cpu_times(f"/proc/{os.getpid() if pid is None else pid}/stat")
    return None if times is None else sum(times)


def machine_cpu_s() -> float | None:
    """CPU seconds every core of the machine spent busy since boot (neither idle nor
    waiting for I/O), every process counted, ours and anyone else's; `None` where
    `/proc/stat` cannot tell. On a shared machine, what others left us."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal (guest time is inside user and nice)
    values = [int(v) for v in fields[1:9]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values) - idle) / _TICKS_PER_S


@dataclass(frozen=True, slots=True)
class CpuMeter:
    """Cores busy per named process over a window: `mark()` before, `cores_busy` after."""

    pids: Mapping[str, int | None]
    """Process names (as the report shows them) and their pids (None: this one)."""

    def mark(self) -> dict[str, float | None]:
        return {name: process_cpu_s(pid) for name, pid in self.pids.items()}

    def cores_busy(self, since: Mapping[str, float | None], wall_s: float) -> dict[str, float]:
        """CPU seconds each process used since `since` (a `mark()`), per wall second;
        a process `/proc` could not read at either end is left out."""
        now = self.mark()
        busy: dict[str, float] = {}
        for name, before in since.items():
            after = now.get(name)
            if before is not None and after is not None and wall_s > 0:
                busy[name] = (after - before) / wall_s
        return busy


def median_cores(rounds: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Per process, the median over `rounds` of its cores busy (`CpuMeter.cores_busy`
    of each round); a process missing from every round is left out."""
    names = dict.fromkeys(name for busy in rounds for name in busy)  # in the meter's order
    return {
        name: statistics.median(busy[name] for busy in rounds if name in busy) for name in names
    }
