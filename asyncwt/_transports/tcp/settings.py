"""Init infos of the `"tcp"` backend, both sides."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import ClassVar

from ..._core.settings import (
    PipelineSettings,
    RoundUpdateInfo,
    WorkerPlanInfo,
    check_host,
    check_positive,
    check_timeout,
)
from ..._trainer.base import TrainerInitInfo
from ..link import LinkSettings

__all__ = ["LinkedTrainerInfo", "TcpTrainerInitInfo", "TcpUpdateInfo", "TcpWorkerInitInfo"]

TcpUpdateInfo = RoundUpdateInfo


@dataclass
class LinkedTrainerInfo(PipelineSettings):
    """Settings of backends whose workers connect back to rank 0 over TCP (tcp, shm)."""

    host: str = "127.0.0.1"
    """Address rank 0 listens on. Loopback by default: set it (and `advertise_host`)
    to reach workers on other hosts."""
    port: int = 0
    """Port to listen on; 0 picks a free one."""
    advertise_host: str | None = None
    """Address workers are told to connect to; defaults to `host`."""
    token: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    """Shared secret for the challenge–response; travels only on the control plane."""
    max_workers: int = 64
    """Connections admitted during init; more are refused."""
    max_pending_handshakes: int = 16
    """Connections that may be in their handshake at once during init. When all are
    taken, a newcomer evicts the handshake that has waited longest on its peer (a
    real worker answers at once), and while every handshake is busy on the
    trainer's side the listener is not read: a flood of idle connections can
    neither exhaust the trainer's file descriptors or memory nor keep a worker out.
    The `torch_dist` rendezvous store admits its connections the same way."""
    handshake_timeout: float = 10.0
    """Seconds a connection has to complete its handshake (the worker's HELLO and
    PROOF) before the trainer drops it: an idle connection holds a handshake slot at
    most this long."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_host("host", self.host)
        if (
            not isinstance(self.port, int)
            or isinstance(self.port, bool)
            or not 0 <= self.port < 65536
        ):
            raise ValueError(f"port should be an int in [0, 65535], got {self.port!r}")
        if not isinstance(self.token, str) or len(self.token) < 16:
            raise ValueError(
                f"token should be a str of at least 16 characters, got {len(str(self.token))} characters"
            )
        check_positive("max_workers", self.max_workers)
        check_positive("max_pending_handshakes", self.max_pending_handshakes)
        check_timeout("handshake_timeout", self.handshake_timeout)

    def link_settings(self) -> LinkSettings:
        return LinkSettings(
            host=self.host,
            port=self.port,
            advertise_host=self.advertise_host,
            token=self.token,
            max_workers=self.max_workers,
            max_pending_handshakes=self.max_pending_handshakes,
            handshake_timeout=self.handshake_timeout,
            connect_timeout=self.connect_timeout,
            send_timeout=self.send_timeout,
            ready_timeout=self.ready_timeout,
        )


@dataclass
class TcpTrainerInitInfo(LinkedTrainerInfo, TrainerInitInfo):
    """Trainer-side settings of the `"tcp"` backend: rank 0 listens, workers connect,
    and every bucket streams over each worker's connection."""

    backend: ClassVar[str] = "tcp"


@dataclass
class TcpWorkerInitInfo(WorkerPlanInfo):
    """What a `"tcp"` worker receives at init: where to connect, the token, the plan."""

    host: str = ""
    port: int = 0
    token: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_host("host", self.host)
        if (
            not isinstance(self.port, int)
            or isinstance(self.port, bool)
            or not 0 < self.port < 65536
        ):
            raise ValueError(f"port should be an int in [1, 65535], got {self.port!r}")
        if not isinstance(self.token, str) or not self.token:
            raise ValueError("token should be a non-empty str")
