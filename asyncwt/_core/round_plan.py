"""The round as data: who sends which pieces to whom, by which route and codec (sans-I/O).

A `RoundPlan` is built once, at init, from the metadata and a few settings values
(`RoundChoices`), identically on every trainer rank; the engines run it and read no
mode from an init info or a transport. It says:

- *pieces*: the parameter boxes in wire dtype (`plan`: each parameter whole);
- *senders*: which trainer rank sends which pieces (`shares`: rank 0 the whole plan,
  or with owner senders each rank its `OwnersLayout` share);
- *needs*: which boxes each receiver needs (`needs`: every receiver every parameter
  whole, or with receiver layouts each receiver the box of each parameter it
  declared; then `pairs` says what each sender sends each receiver);
- *route*: each byte straight from its sender to every receiver (`"star"`), or once
  to the first receiver and on through each receiver's predecessor (`"chain"`);
  `edges(n)` lists a round's edges, each with what its two ends present to admit
  each other for that round (`Admission`); with receiver layouts, one edge per
  (sender, receiver) pair that shares any byte;
- *codec*: raw bytes, or a lossless delta against the previous round (`"delta"`).

Build it by composing steps: `rank0_senders` or `owner_senders` (the pieces and
who sends them), then `with_receiver_layouts`, `via_chain` and `with_delta` where
chosen; `build_round_plan` does this from `RoundChoices`. A step refuses a
combination that cannot work, naming both settings, so no such plan exists.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .meta import ParamMeta
from .modes import Mode, check_modes
from .owners import Box, OwnersLayout
from .pairs import PairPlans, rank0_pieces
from .plan import TransferPlan
from .receiver_layout import ReceiverLayout, whole_box

__all__ = [
    "Admission",
    "BackendFeatures",
    "Codec",
    "Endpoint",
    "Need",
    "ReceiversKind",
    "RoundChoices",
    "RoundPlan",
    "RouteEdge",
    "RouteKind",
    "SenderShare",
    "SendersKind",
    "build_round_plan",
    "check_choices",
    "dropping_workers",
    "owner_senders",
    "rank0_senders",
    "refuse",
    "via_chain",
    "whole_boxes",
    "with_delta",
    "with_receiver_layouts",
]

ROUND_PLAN_FORMAT = 1

SendersKind = Literal["rank0", "owners"]
RouteKind = Literal["star", "chain"]
Codec = Literal["raw", "delta"]
ReceiversKind = Literal["whole", "sliced"]
FailurePolicy = Literal["fail", "drop"]

EVERY_RECEIVER = -1
"""`Need.receiver` for the need of every receiver not named on its own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundChoices:
    """The settings values a plan is built from (what a trainer init info chose)."""

    senders: SendersKind = "rank0"
    """`"rank0"`: rank 0 gathers and sends everything; `"owners"`: every rank sends
    what it holds."""
    route: RouteKind = "star"
    codec: Codec = "raw"
    receivers: ReceiversKind = "whole"
    """`"whole"`: every receiver holds every parameter whole; `"sliced"`: each
    receiver declares the box of each parameter it holds (`ReceiverLayout`) and
    receives only those bytes."""
    on_worker_failure: FailurePolicy = "fail"
    """Not a property of a round's bytes, but it rules some plans out (a dropped
    worker's round runs again on rank 0 alone, and delta needs every worker's base)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendFeatures:
    """What a backend can run: a plan asking for more is refused naming the backend."""

    senders: tuple[SendersKind, ...] = ("rank0",)
    routes: tuple[RouteKind, ...] = ("star",)
    codecs: tuple[Codec, ...] = ("raw",)
    receivers: tuple[ReceiversKind, ...] = ("whole",)


_WHERE = {
    "senders": ("owners", "senders='owners' is supported by the tcp and shm backends"),
    "fanout": ("chain", "fanout=Chain() is supported by the tcp backend"),
    "delta": ("delta", "delta rounds run on tcp and shm"),
    "receivers": ("sliced", "no backend runs receivers that declare their slices yet"),
}


def choice_modes(choices: RoundChoices) -> dict[str, Mode]:
    """`choices` as the settings' modes, spelled as a user writes them (`fanout=Chain()`,
    `delta=Delta()`): what `asyncwt._core.modes.REFUSED`, the one table, is checked on."""
    return {
        "senders": Mode(choices.senders, repr(choices.senders)),
        "fanout": Mode(choices.route, "Chain()" if choices.route == "chain" else "Star()"),
        "delta": Mode(
            "on" if choices.codec == "delta" else "off",
            "Delta()" if choices.codec == "delta" else "None",
        ),
        "on_worker_failure": Mode(choices.on_worker_failure, repr(choices.on_worker_failure)),
        "receivers": Mode(choices.receivers, repr(choices.receivers)),
    }


def refuse(choices: RoundChoices) -> None:
    """Raise a `ValueError` naming both settings if `choices` holds a pair that
    `asyncwt._core.modes.REFUSED` lists (the init infos check the same table when
    they are built; a plan built by hand meets it here)."""
    check_modes(choice_modes(choices))


def check_choices(
    choices: RoundChoices, features: BackendFeatures | None = None, backend: str = "this"
) -> None:
    """Refuse `choices` that cannot work (see `refuse`), or that the backend cannot
    run (`features`), naming the settings and the backend. Pure: run it first."""
    if features is not None:
        if choices.senders not in features.senders:
            raise ValueError(f"{_WHERE['senders'][1]}, got backend={backend!r}")
        if choices.route not in features.routes:
            raise ValueError(
                f"fanout should be Star() for the {backend} backend "
                f"({_WHERE['fanout'][1]}), got Chain()"
            )
        if choices.codec not in features.codecs:
            raise ValueError(
                f"delta should be False for the {backend} backend ({_WHERE['delta'][1]}), got True"
            )
        if choices.receivers not in features.receivers:
            raise ValueError(
                f"receivers should be 'whole' for the {backend} backend "
                f"({_WHERE['receivers'][1]}), got {choices.receivers!r}"
            )
    refuse(choices)


@dataclass(frozen=True, kw_only=True, slots=True)
class SenderShare:
    """What one trainer rank sends each round."""

    rank: int
    plan: TransferPlan
    """The plan its own pipeline and links carry (rank 0 with `"rank0"`: the full plan)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Need:
    """The boxes one receiver needs, one per parameter of the full plan."""

    receiver: int
    """The receiver's index, or `EVERY_RECEIVER` for every receiver not named."""
    boxes: tuple[Box, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Endpoint:
    """One end of a route edge: trainer rank `index`, or receiver `index` (its place
    in the round's order of receivers)."""

    role: Literal["sender", "receiver"]
    index: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission:
    """What an edge's two ends present to admit each other for a round.

    `"init-token"`: the shared token of the init, proven by HMAC over a challenge
    and the plan digest (a star edge, and every control link). `"round-edge-key"`:
    a key fresh for this edge and round, handed in ROUTE to its two ends only, so a
    relay admits only the predecessor named for the round (a chain edge).
    """

    kind: Literal["init-token", "round-edge-key"]


INIT_TOKEN = Admission(kind="init-token")
ROUND_EDGE_KEY = Admission(kind="round-edge-key")


@dataclass(frozen=True, kw_only=True, slots=True)
class RouteEdge:
    """Bytes flow from `source` to `target`, admitted as `admission` says."""

    source: Endpoint
    target: Endpoint
    admission: Admission


def whole_boxes(params: Sequence[ParamMeta]) -> tuple[Box, ...]:
    """Every parameter whole: one box per parameter covering its full shape."""
    return tuple(whole_box(m) for m in params)


@dataclass(frozen=True, kw_only=True, slots=True)
class RoundPlan:
    """One round as data (see the module docstring); build it with the steps below."""

    plan: TransferPlan
    """The full plan: every piece of a round, as every receiver lands it."""
    senders: SendersKind
    shares: tuple[SenderShare, ...]
    """One per sending trainer rank, by rank; a rank absent here sends nothing."""
    layout: OwnersLayout | None
    """Who holds which box, with owner senders; None when rank 0 sends everything."""
    world_size: int
    """Trainer ranks the plan was built for."""
    needs: tuple[Need, ...]
    pairs: PairPlans | None
    """With receiver layouts, what each sender sends each receiver (`needs` are the
    layouts' boxes); None when every receiver needs every parameter whole."""
    route: RouteKind
    codec: Codec
    on_worker_failure: FailurePolicy
    round_digest: str
    """What every round's update info names as its plan, and the receivers check:
    the full plan's digest, or the owner layout's (which covers every share)."""
    digest: str
    """This plan's digest: the pieces, senders, needs, pairs, route and codec."""

    def __post_init__(self) -> None:
        refuse(self.choices)  # no plan holds a pair of choices that cannot work

    @property
    def choices(self) -> RoundChoices:
        """The choices this plan was built with."""
        return RoundChoices(
            senders=self.senders,
            route=self.route,
            codec=self.codec,
            receivers="whole" if self.pairs is None else "sliced",
            on_worker_failure=self.on_worker_failure,
        )

    def share(self, rank: int) -> TransferPlan | None:
        """What trainer rank `rank` sends each round, or None: nothing."""
        for share in self.shares:
            if share.rank == rank:
                return share.plan
        return None

    @property
    def total_bytes(self) -> int:
        """Payload bytes of a round, from every sending rank together."""
        return sum(share.plan.total_bytes for share in self.shares)

    @property
    def receiver_plan(self) -> TransferPlan:
        """The full plan as a receiver checks rounds against it (named by `round_digest`)."""
        if self.round_digest == self.plan.digest:
            return self.plan
        return dataclasses.replace(self.plan, digest=self.round_digest)

    def need(self, receiver: int) -> tuple[Box, ...]:
        """The boxes receiver `receiver` needs (its own need, else every receiver's)."""
        fallback: tuple[Box, ...] = ()
        for need in self.needs:
            if need.receiver == receiver:
                return need.boxes
            if need.receiver == EVERY_RECEIVER:
                fallback = need.boxes
        return fallback

    def edges(self, receivers: int) -> tuple[RouteEdge, ...]:
        """A round's edges over `receivers` receivers (in the round's order)."""
        if receivers < 0:
            raise ValueError(f"receivers should be >= 0, got {receivers}")
        into = [Endpoint(role="receiver", index=i) for i in range(receivers)]
        if self.route == "chain":
            feeders = [Endpoint(role="sender", index=0), *into[:-1]]
            return tuple(
                RouteEdge(source=src, target=dst, admission=ROUND_EDGE_KEY)
                for src, dst in zip(feeders, into)
            )
        if self.pairs is not None:
            if receivers != len(self.pairs.layouts):
                raise ValueError(
                    f"receivers should be the {len(self.pairs.layouts)} receivers whose "
                    f"layouts the plan was built with, got {receivers}"
                )
            return tuple(
                RouteEdge(
                    source=Endpoint(role="sender", index=pair.sender),
                    target=into[pair.receiver],
                    admission=INIT_TOKEN,
                )
                for pair in self.pairs.pairs
            )
        return tuple(
            RouteEdge(
                source=Endpoint(role="sender", index=share.rank), target=dst, admission=INIT_TOKEN
            )
            for share in self.shares
            for dst in into
        )

    def _digested(self) -> RoundPlan:
        h = hashlib.sha256(f"asyncwt-round/{ROUND_PLAN_FORMAT}|{self.round_digest}\n".encode())
        h.update(f"senders|{self.senders}|{self.world_size}\n".encode())
        for share in self.shares:
            h.update(f"share|{share.rank}|{share.plan.digest}\n".encode())
        for need in self.needs:
            h.update(f"need|{need.receiver}".encode())
            for box in need.boxes:
                h.update(f"|{box.start}:{box.size}".encode())
            h.update(b"\n")
        if self.pairs is not None:  # absent otherwise: the digests of whole plans stay
            h.update(f"pairs|{self.pairs.digest}\n".encode())
        h.update(f"route|{self.route}\ncodec|{self.codec}\n".encode())
        h.update(f"failure|{self.on_worker_failure}\n".encode())
        return dataclasses.replace(self, digest=h.hexdigest())


def _whole_needs(plan: TransferPlan) -> tuple[Need, ...]:
    return (Need(receiver=EVERY_RECEIVER, boxes=whole_boxes(plan.params)),)


def rank0_senders(plan: TransferPlan, *, world_size: int = 1) -> RoundPlan:
    """Rank 0 sends every piece (gathered), straight to every receiver, raw."""
    return RoundPlan(
        plan=plan,
        senders="rank0",
        shares=(SenderShare(rank=0, plan=plan),),
        layout=None,
        world_size=world_size,
        needs=_whole_needs(plan),
        pairs=None,
        route="star",
        codec="raw",
        on_worker_failure="fail",
        round_digest=plan.digest,
        digest="",
    )._digested()


def owner_senders(plan: TransferPlan, *, world_size: int) -> RoundPlan:
    """Every trainer rank sends the boxes it holds (`OwnersLayout`), straight, raw."""
    layout = OwnersLayout.build(plan, world_size)
    return RoundPlan(
        plan=plan,
        senders="owners",
        shares=tuple(
            SenderShare(rank=rank, plan=share) for rank, share in enumerate(layout.share_plans)
        ),
        layout=layout,
        world_size=world_size,
        needs=_whole_needs(plan),
        pairs=None,
        route="star",
        codec="raw",
        on_worker_failure="fail",
        round_digest=layout.digest,
        digest="",
    )._digested()


def _step(rp: RoundPlan, **changes: str) -> RoundPlan:
    """`rp` with `changes`; a pair that cannot work is refused (`RoundPlan.__post_init__`)."""
    return dataclasses.replace(rp, **changes)._digested()  # type: ignore[arg-type]


def via_chain(rp: RoundPlan) -> RoundPlan:
    """Route every byte once to the first receiver and on through each predecessor."""
    return _step(rp, route="chain")


def with_delta(rp: RoundPlan) -> RoundPlan:
    """Code every bucket as a lossless delta against the previous round's bytes."""
    return _step(rp, codec="delta")


def with_receiver_layouts(rp: RoundPlan, layouts: Sequence[ReceiverLayout]) -> RoundPlan:
    """Send each receiver only the box of each parameter it declared (`layouts`, one
    per receiver index, in the round's order): each sender sends each receiver the
    intersection of what it holds and what the receiver holds (`PairPlans`).

    Refused with a relay chain (a relay forwards the whole stream) and with delta
    (its base is the whole tensor on every receiver), naming both settings.
    """
    held = rp.layout.pieces if rp.layout is not None else rank0_pieces(rp.plan)
    shares = [rp.share(rank) for rank in range(len(held))]
    pairs = PairPlans.build(rp.plan, shares, held, layouts, digest=rp.round_digest)
    needs = tuple(Need(receiver=i, boxes=layout.boxes) for i, layout in enumerate(pairs.layouts))
    return dataclasses.replace(rp, needs=needs, pairs=pairs)._digested()


def dropping_workers(rp: RoundPlan) -> RoundPlan:
    """Let a round drop a dead worker and run again on the survivors (rank 0 alone)."""
    return _step(rp, on_worker_failure="drop")


def build_round_plan(
    metadata: Sequence[ParamMeta],
    *,
    bucket_bytes: int,
    alignment: int,
    choices: RoundChoices,
    world_size: int = 1,
    features: BackendFeatures | None = None,
    backend: str = "this",
    layouts: Sequence[ReceiverLayout] | None = None,
) -> RoundPlan:
    """The round plan for `choices` over `metadata` and `world_size` trainer ranks.

    `features` (when given) refuses what the backend cannot run, naming it.
    `layouts`, one per receiver, may be given only when `choices.receivers` is
    `"sliced"`; without them the receivers declare theirs at init, and the engine
    records them then (`with_receiver_layouts`).
    """
    check_choices(choices, features, backend)
    if layouts is not None and choices.receivers != "sliced":
        raise ValueError(
            f"layouts should be given only with receivers='sliced', got "
            f"receivers={choices.receivers!r} with {len(layouts)} layouts"
        )
    plan = TransferPlan.build(metadata, bucket_bytes=bucket_bytes, alignment=alignment)
    if choices.senders == "owners":
        rp = owner_senders(plan, world_size=world_size)
    else:
        rp = rank0_senders(plan, world_size=world_size)
    if layouts is not None:
        rp = with_receiver_layouts(rp, layouts)
    if choices.on_worker_failure == "drop":
        rp = dropping_workers(rp)
    if choices.route == "chain":
        rp = via_chain(rp)
    if choices.codec == "delta":
        rp = with_delta(rp)
    return rp
