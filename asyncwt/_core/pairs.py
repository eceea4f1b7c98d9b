"""Slices to slices: what each sender sends each receiver that declared its layout (sans-I/O).

Each sending trainer rank holds pieces (`SharePiece`: a box of a full parameter,
cut from the rank's local box): rank 0 every parameter whole (`rank0_pieces`), or
with owner senders what `OwnersLayout` gives each rank, every byte held once. Each
receiver holds one box per parameter (`ReceiverLayout`). For each (sender,
receiver) pair, the bytes to move are the intersections of the two, one
`PairPiece` per parameter they share, in parameter order; they travel in a
`TransferPlan` built as the owner ranks' share plans are (`piece_plan`: one
`ParamMeta` per piece). A pair sharing nothing has no plan and no edge.

A receiver then gets from all senders together exactly the bytes it holds, each
once: the senders' pieces do not overlap and cover every parameter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .meta import ParamMeta
from .owners import Box, SharePiece, full_slices, piece_plan
from .plan import Slice, TransferPlan
from .receiver_layout import ReceiverLayout, whole_box

__all__ = ["PairPiece", "PairPlan", "PairPlans", "local_slices", "pair_plan", "rank0_pieces"]

PAIRS_FORMAT = 1


def rank0_pieces(plan: TransferPlan) -> tuple[tuple[SharePiece, ...]]:
    """What rank 0 holds when it sends everything: every parameter whole (the
    sender side of `PairPlans.build` with `senders="rank0"`)."""
    return (tuple(SharePiece(i, 0, whole_box(m), whole_box(m)) for i, m in enumerate(plan.params)),)


@dataclass(frozen=True, slots=True)
class PairPiece:
    """What one sender sends one receiver of one parameter: `box` of the full tensor,
    cut from the sender's `source` box and landed in the receiver's `target` box."""

    param: int
    """Index of the parameter in the full plan."""
    box: Box
    source: Box
    """The block the sender's local tensor holds (`iter_local`'s, or the full tensor)."""
    target: Box
    """The block the receiver's local tensor holds (its `ReceiverLayout` box)."""

    @property
    def cut(self) -> tuple[slice, ...]:
        """Where `box` lies in the sender's local tensor."""
        return self.box.within(self.source)

    @property
    def land(self) -> tuple[slice, ...]:
        """Where `box` lands in the receiver's local tensor."""
        return self.box.within(self.target)


@dataclass(frozen=True, slots=True)
class PairPlan:
    """The bytes one sender sends one receiver each round, and how they are packed."""

    sender: int
    """The sending trainer rank."""
    receiver: int
    """The receiver's index (its place in the round's receivers)."""
    pieces: tuple[PairPiece, ...]
    """In parameter order; a slice's `param` in `plan` indexes these."""
    plan: TransferPlan
    """The buckets the pieces travel in (one `ParamMeta` per piece)."""

    @property
    def total_bytes(self) -> int:
        """Payload bytes this pair moves each round."""
        return self.plan.total_bytes

    @property
    def digest(self) -> str:
        """Over the pair, every piece's boxes and the plan: what the two ends of the
        pair compare, each having built it (`pair_plan`)."""
        h = hashlib.sha256(
            f"asyncwt-pair/{PAIRS_FORMAT}|{self.sender}|{self.receiver}|{self.plan.digest}\n".encode()
        )
        for p in self.pieces:
            h.update(f"{p.param}|{p.box}|{p.source}|{p.target}\n".encode())
        return h.hexdigest()


def pair_plan(
    plan: TransferPlan,
    sender: int,
    held: Sequence[SharePiece],
    receiver: int,
    layout: ReceiverLayout,
) -> PairPlan | None:
    """What `sender`, holding `held`, sends `receiver`, holding `layout`: the
    intersections, one per parameter they share, in parameter order, packed as the
    owner ranks' shares are (`piece_plan`); None when they share no byte. A receiver
    builds its own pairs with this alone (it needs no other receiver's layout)."""
    found = []
    for piece in sorted(held, key=lambda p: (p.param, p.box.start)):
        target = layout.boxes[piece.param]
        box = piece.box.intersection(target)
        if box is not None:
            found.append(PairPiece(piece.param, box, piece.local, target))
    if not found:
        return None
    return PairPlan(
        sender, receiver, tuple(found), piece_plan(plan, [(p.param, p.box) for p in found])
    )


def local_slices(piece: PairPiece, meta: ParamMeta, pair_slice: Slice, param: int) -> list[Slice]:
    """Where the piece bytes of `pair_slice` go in the receiver's local tensor of the
    full parameter `meta` (index `param`): one `Slice` per contiguous run, as
    `full_slices` finds them in a full tensor (its `offset` in the pair bucket's buffer)."""
    target = piece.target
    relative = Box(tuple(b - t for b, t in zip(piece.box.start, target.start)), piece.box.size)
    local = ParamMeta(meta.name, meta.dtype, target.size)
    return full_slices(SharePiece(param, 0, relative, target), local, pair_slice, param)


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
        held: Sequence[Sequence[SharePiece]],
        layouts: Sequence[ReceiverLayout],
    ) -> PairPlans:
        """The pairs of senders holding `held[rank]` and receivers holding `layouts`.

        `held`'s pieces must not overlap (each byte is sent once), as `rank0_pieces`
        and `OwnersLayout.pieces` give them; each layout must be of `plan`'s
        parameters (names and shapes).
        """
        layouts = tuple(layouts)
        for index, layout in enumerate(layouts):
            _check_same_params(plan, layout, index)
        pairs = [
            pair
            for sender, pieces in enumerate(held)
            for receiver, layout in enumerate(layouts)
            if (pair := pair_plan(plan, sender, pieces, receiver, layout)) is not None
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
