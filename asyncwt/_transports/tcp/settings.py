"""Init infos of the `"tcp"` backend, both sides."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import ClassVar

from ..._core.settings import PipelineSettings, RoundUpdateInfo, WorkerPlanInfo
from ..._core.validate import check_host, check_port, check_positive, check_str, check_timeout
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
    """Connections that may be in their handshake at once during init. Past it the
    listener stops accepting (newcomers wait in the kernel's backlog) until one
    finishes, so a flood of idle connections cannot exhaust the trainer's file
    descriptors or memory."""
    handshake_timeout: float = 10.0
    """Seconds a connection has to complete its handshake (the worker's HELLO and
    PROOF) before the trainer drops it: an idle connection holds a handshake slot at
    most this long."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_host("host", self.host)
        check_port("port", self.port, allow_zero=True)
        if self.advertise_host is not None:
            check_host("advertise_host", self.advertise_host)
        check_str("token", self.token, min_chars=16, secret=True)
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
        check_port("port", self.port)
        check_str("token", self.token, min_chars=1, secret=True)
