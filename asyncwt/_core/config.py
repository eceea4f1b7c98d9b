"""Grouped trainer settings: the objects a backend's trainer init info takes.

As httpx groups `Timeout` and `Limits`, the settings a user rarely sets one by one
come in small frozen objects, each validated where it is built:

    info = asyncwt.TcpTrainerInitInfo(
        rank=0,
        timeouts=asyncwt.Timeouts(send=30.0, rpc=120.0),
        listen=asyncwt.Listen(host="0.0.0.0", advertise_host="10.0.0.5"),
        delta=asyncwt.Delta(full_every=10),
        fanout=asyncwt.Chain(),
    )

Each error names the setting as the init info spells it (`timeouts.send`), the
expected and the actual value. `MOVED` maps the flat names of 0.1 to these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from .plan import DEFAULT_ALIGNMENT
from .validate import (
    check_at_most,
    check_bool,
    check_host,
    check_int_in,
    check_port,
    check_positive,
    check_timeout,
)

__all__ = [
    "FANOUTS",
    "MAX_NUM_BUFFERS",
    "MOVED",
    "Chain",
    "Delta",
    "Listen",
    "Star",
    "Timeouts",
    "Tuning",
    "check_group",
    "refuse_moved",
]

MAX_NUM_BUFFERS = 64
"""Upper bound on `num_buffers` (each a bucket-sized allocation, on the worker too) and
on `Tuning.read_ahead` (each a bucket of tensors the trainer's source has handed over)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeouts:
    """Every deadline of a round, in seconds (each in `(0, MAX_TIMEOUT_S]`).

    Usage:

        asyncwt.TcpTrainerInitInfo(rank=0, timeouts=asyncwt.Timeouts(send=30.0))

    `connect`, `recv` and `drain` are sent to the workers, which bound their own
    waits by them; the others bound the trainer's.
    """

    connect: float = 60.0
    """Init: the workers connecting and passing the handshake (sent to workers,
    which bound their own connect and handshake by it)."""
    send: float = 300.0
    """One bucket to be taken by every worker."""
    ready: float = 300.0
    """Every worker to start receiving a round."""
    recv: float = 300.0
    """A worker waiting for the next bucket before it gives up (sent to workers)."""
    drain: float = 300.0
    """A worker waiting for its background apply to finish, at
    `finish_weight_update` and before a new round or init (sent to workers). Past it
    the round fails with an `ApplyError` naming the stuck bucket: a transform or
    `load_weights` that never returns."""
    rpc: float = 600.0
    """One control-plane call: `init_weight_transfer_engine`, `start_weight_update`,
    `finish_weight_update` (which includes the worker's drain, so keep it above
    `drain`), and `update_weights` once the last bucket or the abort was sent
    (while data flows, the data-plane timeouts bound the round). A call still
    running past it is abandoned (a synchronous client's thread keeps running in
    the background until the worker answers) and the round fails with a
    `ControlPlaneError`."""
    handshake: float = 10.0
    """A connection completing its handshake (the worker's HELLO and PROOF) before
    the trainer drops it: an idle connection holds a handshake slot at most this long."""

    def __post_init__(self) -> None:
        for name in ("connect", "send", "ready", "recv", "drain", "rpc", "handshake"):
            check_timeout(f"timeouts.{name}", getattr(self, name))


@dataclass(frozen=True, kw_only=True, slots=True)
class Listen:
    """Where rank 0 listens for its workers, and how many connections it admits.

    Usage:

        asyncwt.Listen(host="0.0.0.0", port=29500, advertise_host="10.0.0.5")

    Loopback by default: set `host` (and `advertise_host`) to reach workers on
    other hosts.
    """

    host: str = "127.0.0.1"
    """Address rank 0 listens on."""
    port: int = 0
    """Port to listen on; 0 picks a free one."""
    advertise_host: str | None = None
    """Address workers are told to connect to; defaults to `host`."""
    max_workers: int = 64
    """Connections admitted during init; more are refused."""
    max_pending_handshakes: int = 16
    """Connections that may be in their handshake at once during init. When all are
    taken, a newcomer evicts the handshake that has waited longest on its peer (a
    real worker answers at once), and while every handshake is busy on the
    trainer's side the listener is not read: a flood of idle connections can
    neither exhaust the trainer's file descriptors or memory nor keep a worker out.
    The `torch_dist` rendezvous store admits its connections the same way."""

    def __post_init__(self) -> None:
        check_host("listen.host", self.host)
        check_port("listen.port", self.port, allow_zero=True)
        if self.advertise_host is not None:
            check_host("listen.advertise_host", self.advertise_host)
        check_positive("listen.max_workers", self.max_workers)
        check_positive("listen.max_pending_handshakes", self.max_pending_handshakes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Tuning:
    """Pipeline knobs that rarely need changing (the defaults are measured ones)."""

    alignment: int = DEFAULT_ALIGNMENT
    """Alignment of each slice inside a receive buffer."""
    zero_copy: bool = True
    """Send contiguous CPU tensors in place instead of packing them (transports that can)."""
    read_ahead: int = 4
    """Buckets the source may be iterated ahead of the pack stage, at most
    `MAX_NUM_BUFFERS`. A gathering source (FSDP2) keeps about
    `num_buffers + read_ahead + 2` buckets of gathered tensors alive on rank 0;
    fewer makes a slow gather stall sooner behind the wire."""

    def __post_init__(self) -> None:
        check_positive("tuning.alignment", self.alignment)
        check_bool("tuning.zero_copy", self.zero_copy)
        check_positive("tuning.read_ahead", self.read_ahead)
        check_at_most("tuning.read_ahead", self.read_ahead, MAX_NUM_BUFFERS)


DELTA_POLICIES = ("auto", "always")


@dataclass(frozen=True, kw_only=True, slots=True)
class Delta:
    """Send each round as a lossless delta against the bytes the workers hold for the
    previous round, where that pays (`"tcp"` and `"shm"`; see `asyncwt._delta`).

    The trainer keeps a host copy of the payload it last sent; a worker keeps a
    shadow of what its model does not hold as wire bytes. `delta=True` on an init
    info is shorthand for `delta=Delta()`.
    """

    full_every: int = 0
    """Send a full round every this many rounds (0: only when needed)."""
    policy: str = "auto"
    """`"auto"` keeps the host copy only once the measured wire and encoder predict
    a delta round at most half a full one (so a fast local link gets plain full
    rounds and no copy; the first round keeps nothing) and sends a delta round only
    where the rates say it is faster than a full one; `"always"` keeps the copy from
    the first round and sends every round it can as a delta."""

    def __post_init__(self) -> None:
        check_int_in("delta.full_every", self.full_every, 0, 2**31)
        if self.policy not in DELTA_POLICIES:
            raise ValueError(
                f"delta.policy should be one of {list(DELTA_POLICIES)}, got {self.policy!r}"
            )


@dataclass(frozen=True, slots=True)
class Star:
    """Fan-out: the trainer sends every bucket to every worker over its own connection
    (the trainer's link carries the model once per worker).

    With `slices=True` each worker declares, after its handshake, the part of each
    parameter it holds (a tensor-parallel rank's shard, its model's
    `asyncwt_layout`), and receives exactly those bytes: a TP group of N ranks
    costs the trainer's link one model, not N.
    """

    name: ClassVar[str] = "star"
    slices: bool = False

    def __post_init__(self) -> None:
        check_bool("fanout.slices", self.slices)


@dataclass(frozen=True, slots=True)
class Chain:
    """Fan-out: the trainer sends each byte once, to the first worker; each worker
    forwards what it receives to the next as it arrives, while it applies it (the
    trainer's link carries the model once whatever the number of workers). See
    `asyncwt._backends.tcp.relay`."""

    name: ClassVar[str] = "chain"


FANOUTS: Mapping[str, type[Star | Chain]] = {"star": Star, "chain": Chain}
"""The fan-out choices by name (as a CLI or a job file spells them)."""


def check_group(name: str, value: object, kinds: type | tuple[type, ...]) -> None:
    """`value` is one of the grouped settings `kinds` (built, hence validated)."""
    if not isinstance(value, kinds):
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        expected = " or ".join(kind.__name__ for kind in kinds)
        raise ValueError(f"{name} should be a {expected}, got {value!r}")


MOVED: Mapping[str, str] = {
    "connect_timeout": "timeouts=Timeouts(connect=...)",
    "send_timeout": "timeouts=Timeouts(send=...)",
    "ready_timeout": "timeouts=Timeouts(ready=...)",
    "recv_timeout": "timeouts=Timeouts(recv=...)",
    "drain_timeout": "timeouts=Timeouts(drain=...)",
    "rpc_timeout": "timeouts=Timeouts(rpc=...)",
    "handshake_timeout": "timeouts=Timeouts(handshake=...)",
    "host": "listen=Listen(host=...)",
    "port": "listen=Listen(port=...)",
    "advertise_host": "listen=Listen(advertise_host=...)",
    "max_workers": "listen=Listen(max_workers=...)",
    "max_pending_handshakes": "listen=Listen(max_pending_handshakes=...)",
    "alignment": "tuning=Tuning(alignment=...)",
    "zero_copy": "tuning=Tuning(zero_copy=...)",
    "read_ahead": "tuning=Tuning(read_ahead=...)",
    "delta_full_every": "delta=Delta(full_every=...)",
    "delta_policy": "delta=Delta(policy=...)",
    "topology": "fanout=Star() or fanout=Chain()",
}
"""Trainer settings of asyncwt 0.1 that moved into a group: old name -> new spelling."""


def refuse_moved(cls_name: str, kwargs: Mapping[str, object]) -> None:
    """Fail on a 0.1 flat setting with a `TypeError` that says where it went (instead
    of Python's bare "unexpected keyword argument")."""
    for name in kwargs:
        if name in MOVED:
            raise TypeError(
                f"{cls_name}() got the asyncwt 0.1 setting {name}={kwargs[name]!r}; it "
                f"moved to {MOVED[name]} (see CHANGELOG.md)"
            )
