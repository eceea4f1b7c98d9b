"""Init and update infos of the `"tcp"` backend, both sides."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ._plan import DEFAULT_ALIGNMENT, DEFAULT_BUCKET_BYTES
from ._trainer import TrainerInitInfo
from ._worker import WeightTransferInitInfo, WeightTransferUpdateInfo

__all__ = ["TcpTrainerInitInfo", "TcpUpdateInfo", "TcpWorkerInitInfo"]


def _positive(name: str, value: object, kind: type = int) -> None:
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or not value > 0 or (kind is float and not math.isfinite(float(value))):  # type: ignore[operator,arg-type]
        raise ValueError(f"{name} should be a positive {kind.__name__}, got {value!r}")


@dataclass
class TcpTrainerInitInfo(TrainerInitInfo):
    """Trainer-side settings of the `"tcp"` backend (rank 0 listens, workers connect)."""

    backend: ClassVar[str] = "tcp"

    host: str = "127.0.0.1"
    """Address rank 0 listens on. Loopback by default: set it (and `advertise_host`)
    to reach workers on other hosts."""
    port: int = 0
    """Port to listen on; 0 picks a free one."""
    advertise_host: str | None = None
    """Address workers are told to connect to; defaults to `host`."""
    token: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    """Shared secret for the challenge–response; travels only on the control plane."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Size of one bucket (unit of transfer and of staging memory)."""
    num_buffers: int = 2
    """Buckets in flight on each side; staging memory is at most num_buffers × bucket_bytes."""
    alignment: int = DEFAULT_ALIGNMENT
    """Alignment of each slice inside a receive buffer."""
    zero_copy: bool = True
    """Send contiguous CPU tensors in place instead of packing them first."""
    max_workers: int = 64
    """Connections accepted during init; more are refused."""
    device: str | None = None
    """Device for lanes and staging; `None` picks CUDA when available, else CPU."""
    connect_timeout: float = 60.0
    """Seconds for init: the workers' connect and handshake."""
    send_timeout: float = 300.0
    """Seconds for one bucket to be taken by every worker."""
    ready_timeout: float = 300.0
    """Seconds for every worker to start receiving a round."""
    recv_timeout: float = 300.0
    """Seconds a worker waits for the next frame before it gives up (sent to workers)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host should be a non-empty str, got {self.host!r}")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 <= self.port < 65536:
            raise ValueError(f"port should be an int in [0, 65535], got {self.port!r}")
        if not isinstance(self.token, str) or len(self.token) < 16:
            raise ValueError(
                f"token should be a str of at least 16 characters, got {len(str(self.token))} characters"
            )
        for name in ("bucket_bytes", "num_buffers", "alignment", "max_workers"):
            _positive(name, getattr(self, name))
        for name in ("connect_timeout", "send_timeout", "ready_timeout", "recv_timeout"):
            _positive(name, getattr(self, name), float)


@dataclass
class TcpWorkerInitInfo(WeightTransferInitInfo):
    """What a `"tcp"` worker receives at init: where to connect and the plan."""

    host: str
    port: int
    token: str
    plan: dict[str, Any]
    """`TransferPlan.to_wire()` of the trainer."""
    num_buffers: int = 2
    connect_timeout: float = 60.0
    recv_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host should be a non-empty str, got {self.host!r}")
        if not isinstance(self.port, int) or isinstance(self.port, bool) or not 0 < self.port < 65536:
            raise ValueError(f"port should be an int in [1, 65535], got {self.port!r}")
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("token should be a non-empty str")
        if not isinstance(self.plan, dict):
            raise ValueError(f"plan should be a dict, got {type(self.plan).__name__}")
        _positive("num_buffers", self.num_buffers)
        _positive("connect_timeout", self.connect_timeout, float)
        _positive("recv_timeout", self.recv_timeout, float)


@dataclass
class TcpUpdateInfo(WeightTransferUpdateInfo):
    """One round of the `"tcp"` backend, announced to the worker."""

    round_id: int
    plan_digest: str

    def __post_init__(self) -> None:
        _positive("round_id", self.round_id)
        if not isinstance(self.plan_digest, str) or len(self.plan_digest) != 64:
            raise ValueError(
                f"plan_digest should be a 64-character hex str, got {self.plan_digest!r}"
            )
