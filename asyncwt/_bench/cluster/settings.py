"""The cluster bench's settings and the names every part of it shares."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .._util import Rounds
from .layouts import Layout

__all__ = [
    "GLOO_PORT",
    "WORKER_PORT",
    "ClusterSettings",
    "Log",
    "MiB",
    "format_rate",
    "format_ratio",
    "format_seconds",
    "rate_label",
]

MiB = 1 << 20
WORKER_PORT = 8000
"""Every worker listens on this port of its own host (each host is its own namespace)."""
GLOO_PORT = 29500
"""The trainer ranks' rendezvous, on rank 0's host."""

Log = Callable[[str], None]


def format_rate(rate_bps: int | None) -> str:
    """`250 Mbit/s`, `1 Gbit/s`, `uncapped`."""
    if rate_bps is None:
        return "uncapped"
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:g} {unit}"
    return f"{rate_bps} bit/s"


def format_seconds(value: float | None) -> str:
    """`0.530`, or `-` for none (an uncapped row's ideal)."""
    return "-" if value is None else f"{value:.3f}"


def format_ratio(value: float | None) -> str:
    """`1.18x`, or `-` for none."""
    return "-" if value is None else f"{value:.2f}x"


def rate_label(rate_bps: int | None) -> str:
    """`format_rate` without spaces or slashes: `1Gbits`, for file names and labels."""
    return format_rate(rate_bps).replace(" ", "").replace("/", "")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSettings:
    """Everything one cluster run needs; `cluster.cli` builds it from the command line."""

    preset: str = "default"
    model_mib: float = 32
    """Target model size (bf16)."""
    bucket_bytes: int = 4 * MiB
    num_buffers: int = 2
    workers: tuple[int, ...] = (1, 2, 4, 8)
    """Worker counts N of the one-trainer scenarios."""
    topologies: tuple[str, ...] = ("star",)
    """The tcp topologies of the one-trainer scenarios (`"star"`, `"chain"`), each
    measured at every N."""
    ranks: tuple[int, ...] = (1, 2, 4)
    """Trainer rank counts M of the FSDP2 scenarios (each to N = M workers)."""
    layouts: tuple[str, ...] = ()
    """Receiving engines of the M:N scenarios (`tp2`, `tp4`, `2xtp2`: see `layouts`)."""
    layout_ranks: tuple[int, ...] = (1, 2, 4)
    """Trainer rank counts M of the M:N scenarios."""
    senders: tuple[str, ...] = ("rank0",)
    """Who sends in the FSDP2 scenarios: `"rank0"` (gathered), `"owners"`, or both."""
    rates_bps: tuple[int | None, ...] = (250 * 10**6, 10**9, 10 * 10**9, None)
    """Link rates, bits per second; None is uncapped."""
    rounds: Rounds = field(default_factory=Rounds)
    out: Path = Path("bench-out/cluster")
    torch_threads: int = 1
    cpu_bound_cores: float = 0.85 * (os.cpu_count() or 1)
    """A row whose processes kept at least this many cores busy in all is bound by
    the machine's CPU, not by its links."""
    cpu_bound_process: float = 0.95
    """...as is one whose busiest process kept this much of one core busy."""
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["rounds"] = asdict(self.rounds)
        data["out"] = str(self.out)
        return data

    @property
    def host_numbers(self) -> dict[str, int]:
        """Host name → host number in the subnet: trainers from .1, workers from .101."""
        receivers = [Layout.parse(name).receivers for name in self.layouts]
        layout_ranks = self.layout_ranks if self.layouts else ()
        trainers = max([1, *self.ranks, *layout_ranks])
        workers = max([1, *self.workers, *(m for m in self.ranks if m > 1), *receivers])
        numbers = {f"t{i}": 1 + i for i in range(trainers)}
        numbers.update({f"w{i}": 101 + i for i in range(workers)})
        return numbers
