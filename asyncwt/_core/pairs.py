"""Slices to slices: what each sender sends each receiver that declared its layout (sans-I/O).

Each sending trainer rank holds pieces (`SharePiece`: a box of a full parameter,
cut from the rank's local box) and carries them in its own plan: rank 0 every
parameter whole (`rank0_pieces`, the full plan), or with owner senders what
`OwnersLayout` gives each rank (its share plan), every byte held once. Each
receiver holds one box per parameter (`ReceiverLayout`). A (sender, receiver)
pair moves exactly the bytes both hold: the sender picks them from its own
buckets and the receiver lands them by a plan of its local tensors, both as
`asyncwt._core.slices.select` derives them. A pair sharing nothing has no plan
and no edge.

A receiver then gets from all senders together exactly the bytes it holds, each
once: the senders' pieces do not overlap and cover every parameter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .owners import SharePiece
from .plan import TransferPlan
from .receiver_layout import ReceiverLayout, whole_box
from .slices import Selection, select

__all__ = ["PairPlan", "PairPlans", "pair_plan", "rank0_pieces"]

PAIRS_FORMAT = 1


def rank0_pieces(plan: TransferPlan) -> tuple[tuple[SharePiece, ...]]:
    """What rank 0 holds when it sends everything: every parameter whole (the
    sender side of `PairPlans.build` with `senders="rank0"`)."""
    return (tuple(SharePiece(i, 0, whole_box(m), whole_box(m)) for i, m in enumerate(plan.params)),)


@dataclass(frozen=True, slots=True)
class PairPlan:
    """The bytes one sender sends one receiver each round: picked from the sender's
    own buckets, landed by the receiver's plan of its local tensors (`Selection`)."""

    sender: int
    """The sending trainer rank."""
    receiver: int
    """The receiver's index (its place in the round's receivers)."""
    selection: Selection

    @property
    def total_bytes(self) -> int:
        """Payload bytes this pair moves each round."""
        return self.selection.total_bytes

    @property
    def digest(self) -> str:
        """Over the pair, the picks and the receiver's plan (its tensors and slices):
        what the two ends of the pair compare, each having built it (`pair_plan`)."""
        h = hashlib.sha256(f"asyncwt-pair/{PAIRS_FORMAT}|{self.sender}|{self.receiver}\n".encode())
        for index, ranges in enumerate(self.selection.picks):
            h.update(f"picks|{index}|{ranges}\n".encode())
        plan = self.selection.plan
        for meta in plan.params:
            h.update(f"local|{meta.name}|{meta.shape}\n".encode())
        for bucket in plan.buckets:
            h.update(f"bucket|{bucket.index}|{bucket.slices}\n".encode())
        return h.hexdigest()


def pair_plan(
    share: TransferPlan,
    sender: int,
    held: Sequence[SharePiece],
    receiver: int,
    layout: ReceiverLayout,
    *,
    digest: str,
) -> PairPlan | None:
    """What `sender`, whose plan `share` carries `held` (one piece per parameter of
    `share`, in order), sends `receiver`, holding `layout`: `select`'s picks of its
    buckets; None when they share no byte. A receiver builds its own pairs with this
    alone (it needs no other receiver's layout). `digest` names the receiver's plan
    (the round's, as the links check it)."""
    if len(held) != len(share.params):
        raise ValueError(
            f"held should have one piece per parameter of the share ({len(share.params)}), "
            f"got {len(held)}"
        )
    wants = [layout.box(meta.name) for meta in share.params]
    selection = select(share, [piece.box for piece in held], wants, digest=digest)
    if not selection.total_bytes:
        return None
    return PairPlan(sender, receiver, selection)


@dataclass(frozen=True)
class PairPlans:
    """Every (sender, receiver) pair's plan; identical wherever it is built from the
    same plan, sender pieces and receiver layouts. Build it with `PairPlans.build`."""

    plan: TransferPlan
    """The full plan the boxes are of."""
    senders: int
    """Sending trainer ranks (rank 0 alone, or every owner rank)."""
    layouts: tuple[ReceiverLayout, ...]
    """Per receiver index, the layout it declared."""
    pairs: tuple[PairPlan, ...]
    """The pairs that share any byte, by sender then receiver."""
    digest: str
    """Over the full plan, every layout and every pair's pieces and plan."""

    @classmethod
    def build(
        cls,
        plan: TransferPlan,
        shares: Sequence[TransferPlan | None],
        held: Sequence[Sequence[SharePiece]],
        layouts: Sequence[ReceiverLayout],
        *,
        digest: str,
    ) -> PairPlans:
        """The pairs of senders whose plans `shares[rank]` (None: it sends nothing)
        carry `held[rank]` and of
        receivers holding `layouts`; the receivers' plans are named `digest`.

        `held`'s pieces must not overlap (each byte is sent once), as `rank0_pieces`
        and `OwnersLayout.pieces` give them; each layout must be of `plan`'s
        parameters (names and shapes).
        """
        layouts = tuple(layouts)
        for index, layout in enumerate(layouts):
            _check_same_params(plan, layout, index)
        pairs = [
            pair
            for sender, (share, pieces) in enumerate(zip(shares, held))
            if share is not None  # a rank that holds nothing sends nothing
            for receiver, layout in enumerate(layouts)
            if (pair := pair_plan(share, sender, pieces, receiver, layout, digest=digest))
            is not None
        ]
        h = hashlib.sha256(
            f"asyncwt-pairs/{PAIRS_FORMAT}|{plan.digest}|{len(held)}|{len(layouts)}\n".encode()
        )
        for layout in layouts:
            h.update(f"layout|{layout.digest}\n".encode())
        for pair in pairs:
            h.update(f"pair|{pair.digest}\n".encode())
        return cls(
            plan=plan, senders=len(held), layouts=layouts, pairs=tuple(pairs), digest=h.hexdigest()
        )

    def pair(self, sender: int, receiver: int) -> PairPlan | None:
        """What `sender` sends `receiver` each round, or None: nothing."""
        for pair in self.pairs:
            if (pair.sender, pair.receiver) == (sender, receiver):
                return pair
        return None

    def to_receiver(self, receiver: int) -> tuple[PairPlan, ...]:
        """Every pair that brings receiver `receiver` bytes, by sender."""
        return tuple(pair for pair in self.pairs if pair.receiver == receiver)

    def from_sender(self, sender: int) -> tuple[PairPlan, ...]:
        """Every pair trainer rank `sender` sends, by receiver."""
        return tuple(pair for pair in self.pairs if pair.sender == sender)

    @property
    def total_bytes(self) -> int:
        """Payload bytes of a round, over every pair."""
        return sum(pair.total_bytes for pair in self.pairs)


def _check_same_params(plan: TransferPlan, layout: ReceiverLayout, index: int) -> None:
    ours = [(m.name, m.shape) for m in plan.params]
    theirs = [(m.name, m.shape) for m in layout.params]
    if ours != theirs:
        diff = next(
            (f"{a} here, {b} in the layout" for a, b in zip(ours, theirs) if a != b),
            f"{len(ours)} parameters here, {len(theirs)} in the layout",
        )
        raise ValueError(
            f"layouts[{index}] should be of the plan's parameters (names and shapes): {diff}"
        )
