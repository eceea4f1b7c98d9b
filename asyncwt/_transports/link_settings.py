"""Settings of the backends that run on the authenticated link (tcp, shm, torch_dist,
cuda_ipc): the trainer's listener and admission limits, and what each worker is
told at init to reach it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from .._core.config import Delta, Listen, check_group
from .._core.modes import Mode
from .._core.round_plan import Codec, RoundChoices
from .._core.settings import PipelineSettings, WorkerPlanInfo
from .._core.validate import (
    check_bool,
    check_host,
    check_port,
    check_str,
)
from .link import LinkSettings

__all__ = ["LinkedTrainerInfo", "LinkedWorkerInfo", "SendersAndDelta"]

SENDERS = ("rank0", "owners")


@dataclass(kw_only=True)
class LinkedTrainerInfo(PipelineSettings):
    """Trainer-side settings of every backend whose workers connect back to rank 0
    over the authenticated link (`asyncwt._transports.link`): where rank 0 listens
    (`Listen`), and the token."""

    listen: Listen = field(default_factory=Listen)
    """Where rank 0 listens and how many connections it admits (`Listen`); loopback
    by default."""
    token: str = field(default_factory=lambda: secrets.token_hex(32), repr=False)
    """Shared secret for the challenge–response; travels only on the control plane."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_group("listen", self.listen, Listen)
        check_str("token", self.token, min_chars=16, secret=True)

    def link_settings(self) -> LinkSettings:
        """What the trainer side of the links reads of these settings."""
        listen, timeouts = self.listen, self.timeouts
        return LinkSettings(
            host=listen.host,
            port=listen.port,
            advertise_host=listen.advertise_host,
            token=self.token,
            max_workers=listen.max_workers,
            connect_timeout=timeouts.connect,
            send_timeout=timeouts.send,
            ready_timeout=timeouts.ready,
            max_pending_handshakes=listen.max_pending_handshakes,
            handshake_timeout=timeouts.handshake,
        )


@dataclass(kw_only=True)
class SendersAndDelta(LinkedTrainerInfo):
    """Settings of the backends whose rounds can be sent by the owner ranks or as
    deltas (`"tcp"` and `"shm"`)."""

    senders: str = "rank0"
    """Which trainer ranks send: `"rank0"` gathers every parameter on rank 0 and sends
    it from there; `"owners"` has every rank send the bytes it holds (`iter_local`),
    no gather, each rank over its own links; rank 0 keeps the control plane. Needs
    `torch.distributed` initialised (the ranks exchange endpoints at init)."""
    delta: Delta | bool | None = None
    """Send each round as a lossless delta against the previous one (`Delta`);
    `True` is shorthand for `Delta()`, `False` for `None` (every round full)."""

    def __post_init__(self) -> None:
        # Own fields first: the base's mode check (`modes()`) reads them.
        if self.senders not in SENDERS:
            raise ValueError(f"senders should be one of {list(SENDERS)}, got {self.senders!r}")
        if isinstance(self.delta, bool):
            self.delta = Delta() if self.delta else None
        if self.delta is not None and not isinstance(self.delta, Delta):
            raise ValueError(f"delta should be a Delta, a bool or None, got {self.delta!r}")
        super().__post_init__()

    @property
    def delta_settings(self) -> Delta | None:
        """`delta` after construction turned `True`/`False` into `Delta()`/`None`."""
        return self.delta if isinstance(self.delta, Delta) else None

    def round_choices(self) -> RoundChoices:
        return RoundChoices(
            senders="owners" if self.senders == "owners" else "rank0",
            codec="raw" if self.delta is None else "delta",
        )

    def modes(self) -> dict[str, Mode]:
        return {
            **super().modes(),
            "senders": Mode(self.senders, repr(self.senders)),
            "delta": Mode("off" if self.delta is None else "on", repr(self.delta)),
        }

    def worker_fields(self) -> dict[str, Any]:
        fields_ = super().worker_fields()
        if self.delta is not None:
            fields_["delta"] = True
        return fields_


@dataclass
class LinkedWorkerInfo(WorkerPlanInfo):
    """What every link-backed worker receives at init: where rank 0 listens, the
    token to prove, and the plan. Each backend's worker init info adds its own."""

    host: str = ""
    port: int = 0
    token: str = ""
    delta: bool = False
    """Whether the trainer may send delta rounds (the worker then keeps what it needs)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool("delta", self.delta)
        check_host("host", self.host)
        check_port("port", self.port)
        check_str("token", self.token, min_chars=1, secret=True)

    @property
    def codec(self) -> Codec:
        return "delta" if self.delta else "raw"
