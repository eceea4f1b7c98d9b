"""Peak resident memory of a process over a window, without psutil.

Linux keeps each process's high-water mark of resident memory (`VmHWM` in
`/proc/PID/status`), and writing `5` to `/proc/PID/clear_refs` resets it to the
current RSS. A window is therefore: reset, run, read `VmHWM` — exact, whatever
the peak's duration. Where the reset is refused, a thread samples `VmRSS` every
millisecond instead (a peak shorter than that may be missed; the report says
which method was used).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

__all__ = ["MemoryProbe", "MemoryWindow", "rss_bytes"]


def _status_bytes(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {key} line")


def rss_bytes(pid: int | None = None) -> int:
    """Current resident memory of `pid` (this process by default), in bytes."""
    return _status_bytes(os.getpid() if pid is None else pid, "VmRSS:")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryWindow:
    """What one probe window saw."""

    baseline_bytes: int
    """RSS the caller chose as the zero (taken before the measured work started)."""
    peak_bytes: int
    """Highest RSS during the window."""
    method: str
    """`"hwm"` (kernel high-water mark, exact) or `"sampled"` (1 ms polling)."""

    @property
    def extra_bytes(self) -> int:
        """Peak above the baseline (never negative)."""
        return max(0, self.peak_bytes - self.baseline_bytes)

    def as_dict(self) -> dict[str, int | str]:
        return {
            "baseline_bytes": self.baseline_bytes,
            "peak_bytes": self.peak_bytes,
            "extra_bytes": self.extra_bytes,
            "method": self.method,
        }


class MemoryProbe:
    """Measures one process's peak RSS between `start()` and `stop()`."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self._baseline = 0
        self._sampler: threading.Thread | None = None
        self._stop = threading.Event()
        self._sampled_peak = 0
        self._method = "hwm"

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def start(self, baseline_bytes: int | None = None) -> None:
        """Open a window; the baseline is the current RSS unless one is given."""
        self._baseline = self.rss() if baseline_bytes is None else baseline_bytes
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as refs:
                refs.write("5")
            self._method = "hwm"
        except OSError:
            self._method = "sampled"
            self._sampled_peak = self.rss()
            self._stop.clear()
            self._sampler = threading.Thread(target=self._sample, name="bench-rss", daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            try:
                self._sampled_peak = max(self._sampled_peak, self.rss())
            except (OSError, RuntimeError):
                return  # the process is gone

    def stop(self) -> MemoryWindow:
        """Close the window and return what it saw."""
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
            self._sampler = None
            peak = max(self._sampled_peak, self.rss())
        else:
            peak = _status_bytes(self.pid, "VmHWM:")
        return MemoryWindow(baseline_bytes=self._baseline, peak_bytes=peak, method=self._method)
