"""What one round did, as `send_weights` reports it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Progress", "RoundStats", "StageClock"]

Progress = Callable[[int, int], object]
"""`progress(sent_bytes, total_bytes)`: told after each bucket of a round went to the
transport (`send_weights(progress=...)`), on the event loop, so it must be quick (log,
update a bar, set a gauge). `total_bytes` is this rank's payload for the round."""


class StageClock:
    """Accumulates the seconds a pipeline stage spent working (not waiting)."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self._since: float | None = None

    def start(self) -> None:
        self._since = time.perf_counter()

    def stop(self) -> None:
        if self._since is not None:
            self.busy_s += time.perf_counter() - self._since
            self._since = None


@dataclass(frozen=True, kw_only=True)
class RoundStats:
    """One round, measured on the trainer rank that ran it."""

    round_id: int
    """Rounds are numbered from 1 per engine."""
    weight_version: str | None
    """The version handed to `finish_weight_update`."""
    bytes: int
    """Payload bytes this rank sent to each worker (0 on non-sender ranks; with
    `senders="owners"`, this rank's share)."""
    wire_bytes: int = 0
    """Bytes that went on the wire to each worker: `bytes` in a full round, less in a
    delta round (the mean when workers got different frames; frame headers aside)."""
    buckets: int
    """Buckets sent to each worker."""
    workers: int
    """Workers that received the round."""
    wall_s: float
    """From `send_weights` entry to `finish_weight_update` returned."""
    stage_busy_s: dict[str, float] = field(default_factory=dict)
    """Seconds each stage (`iterate`, `pack`, `send`) spent working."""
    total_bytes: int | None = None
    """With `senders="owners"`: payload bytes each worker received from every rank
    together (the round's total; `bytes` is this rank's share). `None` otherwise."""
    dropped: tuple[str, ...] = ()
    """Workers cut out during this round (`on_worker_failure="drop"`), by name (a
    worker's URL where the client names one); they no longer take part."""
    paused_s: float | None = None
    """Seconds the client kept generation paused around this round (`HttpClient(...,
    pause="keep")`, say); None when it paused nothing."""

    @property
    def throughput_gbps(self) -> float:
        """Payload GB/s (1e9 bytes) per worker over the whole round."""
        return self.bytes / self.wall_s / 1e9 if self.wall_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["throughput_gbps"] = self.throughput_gbps
        return data

    def summary(self) -> str:
        """One log line (the bytes on the wire only where a delta round made them fewer)."""
        stages = " ".join(f"{k}={v:.3f}s" for k, v in self.stage_busy_s.items())
        wire = (
            f" ({self.wire_bytes / 2**20:.1f} MiB on the wire)"
            if 0 < self.wire_bytes < self.bytes
            else ""
        )
        dropped = f"; dropped {', '.join(self.dropped)}" if self.dropped else ""
        if self.paused_s is not None:
            dropped += f"; generation paused {self.paused_s:.3f}s"
        return (
            f"round {self.round_id} (version {self.weight_version}): {self.bytes / 2**20:.1f} MiB"
            f"{wire} in {self.buckets} buckets to {self.workers} worker(s) in {self.wall_s:.3f}s, "
            f"{self.throughput_gbps:.2f} GB/s; busy {stages}{dropped}"
        )
