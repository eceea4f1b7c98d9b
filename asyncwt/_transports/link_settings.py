"""Settings of the backends that run on the authenticated link (tcp, shm, torch_dist,
cuda_ipc): the trainer's listener and admission limits, and what each worker is
told at init to reach it."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, fields
from typing import Any

from .._core.round_plan import Codec, RoundChoices
from .._core.settings import PipelineSettings, WorkerPlanInfo
from .._core.validate import (
    check_bool,
    check_host,
    check_int_in,
    check_port,
    check_positive,
    check_str,
    check_timeout,
)
from .link import LinkSettings

__all__ = ["LinkedTrainerInfo", "LinkedWorkerInfo"]


@dataclass
class LinkedTrainerInfo(PipelineSettings):
    """Trainer-side settings of every backend whose workers connect back to rank 0
    over the authenticated link (`asyncwt._transports.link`): where rank 0 listens,
    the token, and how many connections it admits."""

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
    senders: str = "rank0"
    """Which trainer ranks send: `"rank0"` gathers every parameter on rank 0 and sends
    it from there; `"owners"` (tcp and shm) has every rank send the bytes it holds
    (`iter_local`), no gather, each rank over its own links; rank 0 keeps the control
    plane. Needs `torch.distributed` initialised (the ranks exchange endpoints at init)."""
    handshake_timeout: float = 10.0
    """Seconds a connection has to complete its handshake (the worker's HELLO and
    PROOF) before the trainer drops it: an idle connection holds a handshake slot at
    most this long."""
    delta: bool = False
    """Send each round as a lossless delta against the bytes the workers hold for the
    previous round, where that pays (`"tcp"` and `"shm"`; see `asyncwt._delta`). The
    trainer keeps a host copy of the payload it last sent; a worker keeps a shadow
    of what its model does not hold as wire bytes."""
    delta_full_every: int = 0
    """With `delta`: send a full round every this many rounds (0: only when needed)."""
    delta_policy: str = "auto"
    """With `delta`: `"auto"` keeps the host copy only once the measured wire and
    encoder predict a delta round at most half a full one (so a fast local link
    gets plain full rounds and no copy; the first round keeps nothing) and sends
    a delta round only where the rates say it is faster than a full one;
    `"always"` keeps the copy from the first round and sends every round it can
    as a delta."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool("delta", self.delta)
        check_int_in("delta_full_every", self.delta_full_every, 0, 2**31)
        if self.delta_policy not in ("auto", "always"):
            raise ValueError(
                f"delta_policy should be 'auto' or 'always', got {self.delta_policy!r}"
            )
        check_host("host", self.host)
        check_port("port", self.port, allow_zero=True)
        if self.advertise_host is not None:
            check_host("advertise_host", self.advertise_host)
        check_str("token", self.token, min_chars=16, secret=True)
        check_positive("max_workers", self.max_workers)
        check_positive("max_pending_handshakes", self.max_pending_handshakes)
        check_timeout("handshake_timeout", self.handshake_timeout)
        if self.senders not in ("rank0", "owners"):
            raise ValueError(f"senders should be 'rank0' or 'owners', got {self.senders!r}")
        if self.senders == "owners" and self.delta:
            raise ValueError(
                "delta should be False with senders='owners' (delta rounds are sent from "
                "rank 0's full tensors), got True"
            )

    def round_choices(self) -> RoundChoices:
        return RoundChoices(
            senders="owners" if self.senders == "owners" else "rank0",
            codec="delta" if self.delta else "raw",
        )

    def worker_fields(self) -> dict[str, Any]:
        fields_ = super().worker_fields()
        if self.delta:
            fields_["delta"] = True
        return fields_

    def link_settings(self) -> LinkSettings:
        """What the trainer side of the links reads of these settings."""
        return LinkSettings(**{f.name: getattr(self, f.name) for f in fields(LinkSettings)})


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
