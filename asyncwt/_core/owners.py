"""Owner senders' layout: which trainer rank sends which bytes of which parameter (sans-I/O).

With `senders="owners"` every trainer rank sends the bytes it holds (`iter_local`)
instead of rank 0 gathering everything. This module derives, from the metadata
alone (owners, mesh shape, placements), identically on every rank and worker:

- each rank's *local box*: the block of the full tensor its shard covers
  (`Shard(d)` split as `torch.chunk` splits it, outer mesh axis first, so uneven
  and empty shards come out as DTensor makes them);
- each rank's *pieces*: the part of its box it sends. Ranks whose boxes are equal
  (replicas) split that box along its first dim, so replicated bytes travel once
  and their cost is spread across the replicas;
- each rank's *share plan*: a `TransferPlan` over its pieces (one `ParamMeta` per
  piece, named as the parameter, shaped as the piece), which its own pipeline and
  links carry;
- the layout's `digest`, over the full plan, every piece and every share plan: the
  round's plan digest in this mode, so a worker that derived another layout fails.

A piece is a box of the full tensor: on the worker it lands as contiguous runs of
the full parameter's bytes (`full_slices`), one run for a `Shard(0)` slab, one per
row for a `Shard(1)` block; `row_groups` finds the rows again, so that a block
lands as one strided copy, not one copy per row.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .meta import ParamMeta, Placement, Replicate, Shard
from .plan import Slice, TransferPlan

__all__ = [
    "MAX_SENDERS",
    "Box",
    "OwnersLayout",
    "SharePiece",
    "full_slices",
    "local_boxes",
    "piece_plan",
    "pieces_by_param",
    "row_groups",
]

OWNERS_FORMAT = 1
MAX_SENDERS = 4096
"""Most trainer ranks a layout may name (a hostile init cannot make a worker plan
for more)."""


@dataclass(frozen=True, slots=True)
class Box:
    """A block of a tensor: `start` and `size` per dim (row-major, like the tensor)."""

    start: tuple[int, ...]
    size: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.size)

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside `outer` (a tensor holding `outer`'s elements)."""
        return tuple(slice(s - o, s - o + n) for s, n, o in zip(self.start, self.size, outer.start))

    def intersection(self, other: Box) -> Box | None:
        """The elements both boxes cover, or None when they share none (boxes of one
        tensor: same number of dims)."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(
            min(a + n, b + m) for a, n, b, m in zip(self.start, self.size, other.start, other.size)
        )
        box = Box(start, tuple(hi - lo for lo, hi in zip(start, stop)))
        return box if all(n > 0 for n in box.size) else None


@dataclass(frozen=True, slots=True)
class SharePiece:
    """What one rank sends of one parameter: `box` of the full tensor, cut from the
    rank's `local` box (what its `iter_local` yields)."""

    param: int
    """Index of the parameter in the full plan."""
    rank: int
    box: Box
    local: Box


def _chunk(start: int, size: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of `parts` of the range `[start, start + size)`, as `torch.chunk`
    cuts it (parts of `ceil(size / parts)`, the last ones short or empty)."""
    step = -(-size // parts) if size else 0
    lo = min(index * step, size)
    hi = min(lo + step, size)
    return start + lo, hi - lo


def _coords(mesh_shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Every mesh coordinate, row-major (the order of `ParamMeta.owners`)."""
    for flat in range(math.prod(mesh_shape)):
        coord = []
        for dim in reversed(mesh_shape):
            coord.append(flat % dim)
            flat //= dim
        yield tuple(reversed(coord))


def local_boxes(meta: ParamMeta, world_size: int) -> dict[int, Box]:
    """The block of the full tensor each owner of `meta` holds, by global rank.

    `owners=None` means every rank of `world_size` holds all of it.
    """
    full = Box((0,) * len(meta.shape), meta.shape)
    if meta.owners is None:
        return {rank: full for rank in range(world_size)}
    assert meta.mesh_shape is not None
    boxes: dict[int, Box] = {}
    for owner, coord in zip(meta.owners, _coords(meta.mesh_shape)):
        start, size = list(full.start), list(full.size)
        for axis, placement in enumerate(meta.placements or ()):
            if isinstance(placement, Shard):
                d = placement.dim
                start[d], size[d] = _chunk(start[d], size[d], meta.mesh_shape[axis], coord[axis])
        boxes[owner] = Box(tuple(start), tuple(size))
    return boxes


def _spread(box: Box, replicas: int, index: int) -> Box | None:
    """Replica `index`'s part of a box `replicas` ranks hold, cut along dim 0 (None
    when its part is empty)."""
    if not box.size:
        return box if index == 0 else None  # a 0-d tensor: the first replica sends it
    start, size = _chunk(box.start[0], box.size[0], replicas, index)
    part = Box((start, *box.start[1:]), (size, *box.size[1:]))
    return part if part.numel else None


def _pieces(index: int, meta: ParamMeta, world_size: int) -> list[SharePiece]:
    boxes = local_boxes(meta, world_size)
    holders: dict[Box, list[int]] = {}
    for rank, box in boxes.items():
        holders.setdefault(box, []).append(rank)
    pieces = []
    for box, ranks in holders.items():
        for i, rank in enumerate(ranks):
            part = _spread(box, len(ranks), i)
            if part is not None:
                pieces.append(SharePiece(index, rank, part, box))
    return pieces


def _encode_placement(placement: Placement) -> Any:
    return ["s", placement.dim] if isinstance(placement, Shard) else "r"


def _decode_placement(raw: object) -> Placement:
    if raw == "r":
        return Replicate()
    if (
        isinstance(raw, list)
        and len(raw) == 2
        and raw[0] == "s"
        and isinstance(raw[1], int)
        and not isinstance(raw[1], bool)
    ):
        return Shard(raw[1])
    raise ValueError(f"a placement should be 'r' or ['s', dim], got {raw!r}")


def _int_list(name: str, raw: object) -> tuple[int, ...]:
    if not isinstance(raw, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in raw
    ):
        raise ValueError(f"{name} should be a list of ints, got {raw!r}")
    return tuple(raw)


def piece_plan(plan: TransferPlan, pieces: Iterable[tuple[int, Box]]) -> TransferPlan:
    """The plan that carries `pieces` (each a parameter index of `plan` and a box of
    that parameter): one `ParamMeta` per piece, named as its parameter and shaped as
    its box, packed as `plan` packs (its bucket size and alignment). A slice's
    `param` is then the piece's index in `pieces`."""
    return TransferPlan.build(
        [ParamMeta(plan.params[i].name, plan.params[i].dtype, box.size) for i, box in pieces],
        bucket_bytes=plan.bucket_bytes,
        alignment=plan.alignment,
    )


@dataclass(frozen=True)
class OwnersLayout:
    """Who sends what with `senders="owners"`; identical on every rank and worker.

    Build it with `OwnersLayout.build(plan, world_size)` from the full plan (whose
    `ParamMeta`s carry the ownership); a worker rebuilds it with `from_wire`.
    """

    plan: TransferPlan
    """The full plan: what the worker's model receives."""
    world_size: int
    pieces: tuple[tuple[SharePiece, ...], ...]
    """Per rank, its pieces in parameter order."""
    local: tuple[dict[int, Box], ...]
    """Per rank, the local box of every parameter it owns (what `iter_local` yields)."""
    share_plans: tuple[TransferPlan, ...]
    """Per rank, the plan its pieces travel in."""
    digest: str

    @classmethod
    def build(cls, plan: TransferPlan, world_size: int) -> OwnersLayout:
        if not 1 <= world_size <= MAX_SENDERS:
            raise ValueError(f"world_size should be in [1, {MAX_SENDERS}], got {world_size}")
        pieces: list[list[SharePiece]] = [[] for _ in range(world_size)]
        local: list[dict[int, Box]] = [{} for _ in range(world_size)]
        for index, meta in enumerate(plan.params):
            if meta.owners is not None and max(meta.owners) >= world_size:
                raise ValueError(
                    f"parameter {meta.name!r}: owners {meta.owners} name a rank outside the "
                    f"{world_size} trainer ranks"
                )
            for rank, box in local_boxes(meta, world_size).items():
                local[rank][index] = box
            for piece in _pieces(index, meta, world_size):
                pieces[piece.rank].append(piece)
        share_plans = tuple(
            piece_plan(plan, [(p.param, p.box) for p in rank_pieces]) for rank_pieces in pieces
        )
        h = hashlib.sha256(f"asyncwt-owners/{OWNERS_FORMAT}|{world_size}|{plan.digest}\n".encode())
        for rank_pieces, share in zip(pieces, share_plans):
            for p in rank_pieces:
                h.update(f"{p.param}|{p.rank}|{p.box.start}|{p.box.size}|{p.local}\n".encode())
            h.update(f"plan|{share.digest}\n".encode())
        return cls(
            plan=plan,
            world_size=world_size,
            pieces=tuple(tuple(p) for p in pieces),
            local=tuple(local),
            share_plans=share_plans,
            digest=h.hexdigest(),
        )

    @property
    def total_bytes(self) -> int:
        """Bytes every worker receives in a round, from all ranks together."""
        return sum(share.total_bytes for share in self.share_plans)

    def to_wire(self) -> dict[str, Any]:
        """The JSON-safe ownership a worker needs (the full plan travels beside it)."""
        return {
            "world_size": self.world_size,
            "params": [
                None
                if m.owners is None
                else [
                    list(m.owners),
                    list(m.mesh_shape or ()),
                    None if m.placements is None else [_encode_placement(p) for p in m.placements],
                ]
                for m in self.plan.params
            ],
            "digest": self.digest,
        }

    @classmethod
    def from_wire(cls, plan: TransferPlan, data: object) -> OwnersLayout:
        """Rebuild the layout from `to_wire` output over `plan`; check the digest.

        Every field is validated before anything is laid out.
        """
        if not isinstance(data, dict):
            raise ValueError(f"owners should be a dict, got {type(data).__name__}")
        world_size = data.get("world_size")
        if not isinstance(world_size, int) or not 1 <= world_size <= MAX_SENDERS:
            raise ValueError(
                f"owners.world_size should be in [1, {MAX_SENDERS}], got {world_size!r}"
            )
        raw = data.get("params")
        if not isinstance(raw, list) or len(raw) != len(plan.params):
            got = len(raw) if isinstance(raw, list) else type(raw).__name__
            raise ValueError(
                f"owners.params should list the plan's {len(plan.params)} parameters, got {got}"
            )
        metas = []
        for meta, entry in zip(plan.params, raw):
            if entry is None:
                metas.append(meta)
                continue
            if not isinstance(entry, list) or len(entry) != 3:
                raise ValueError(
                    f"owners of {meta.name!r} should be [owners, mesh_shape, placements], "
                    f"got {entry!r}"
                )
            owners = _int_list(f"owners of {meta.name!r}", entry[0])
            mesh_shape = _int_list(f"mesh_shape of {meta.name!r}", entry[1])
            if len(owners) > world_size:
                raise ValueError(f"parameter {meta.name!r}: more owners than {world_size} ranks")
            placements = (
                None
                if entry[2] is None
                else tuple(_decode_placement(p) for p in _bounded(entry[2], len(mesh_shape)))
            )
            metas.append(
                ParamMeta(
                    meta.name,
                    meta.dtype,
                    meta.shape,
                    owners=owners,
                    mesh_shape=mesh_shape,
                    placements=placements,
                )
            )
        full = TransferPlan.build(metas, bucket_bytes=plan.bucket_bytes, alignment=plan.alignment)
        layout = cls.build(full, world_size)
        if data.get("digest") != layout.digest:
            raise ValueError(
                f"owners.digest {str(data.get('digest'))[:16]}… does not match the layout "
                f"derived here ({layout.digest[:16]}…): trainer and worker disagree on who "
                f"sends what"
            )
        return layout


def _bounded(raw: object, count: int) -> list[Any]:
    if not isinstance(raw, list) or len(raw) != count:
        raise ValueError(f"placements should be a list of {count}, got {raw!r}")
    return raw


@functools.lru_cache(maxsize=1024)
def _runs(box: Box, shape: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """How `box` lies in a row-major tensor of `shape`: the elements of one
    contiguous run, and the element offset of each run, in the box's order."""
    n = len(shape)
    if n == 0:
        return 1, (0,)
    k = n - 1
    while k > 0 and box.start[k] == 0 and box.size[k] == shape[k]:
        k -= 1
    strides = [math.prod(shape[d + 1 :]) for d in range(n)]
    run = box.size[k] * strides[k]
    base = box.start[k] * strides[k]
    offsets = [base]
    for d in range(k - 1, -1, -1):
        offsets = [
            (box.start[d] + i) * strides[d] + off for i in range(box.size[d]) for off in offsets
        ]
    return run, tuple(offsets)


def full_slices(piece: SharePiece, meta: ParamMeta, share_slice: Slice, param: int) -> list[Slice]:
    """Where the piece bytes of `share_slice` go in the full parameter `param`: one
    `Slice` per contiguous run (its `offset` in the share bucket's buffer)."""
    itemsize = meta.dtype.itemsize
    run_elems, offsets = _runs(piece.box, meta.shape)
    run_bytes = run_elems * itemsize
    out = []
    lo, hi = share_slice.start, share_slice.end
    first = lo // run_bytes if run_bytes else 0
    for r in range(first, len(offsets)):
        run_lo = r * run_bytes
        if run_lo >= hi:
            break
        a, b = max(lo, run_lo), min(hi, run_lo + run_bytes)
        if a < b:
            out.append(
                Slice(param, offsets[r] * itemsize + a - run_lo, b - a, share_slice.offset + a - lo)
            )
    return out


def pieces_by_param(pieces: Sequence[SharePiece]) -> dict[int, SharePiece]:
    """A rank's pieces by full-plan parameter index (a rank has one piece per parameter)."""
    return {p.param: p for p in pieces}


def row_groups(slices: Sequence[Slice | None]) -> list[tuple[int, int, int]]:
    """Runs of consecutive `slices` that are rows of one block: `(first, rows,
    stride)`, `rows` slices from index `first`, of one parameter and one length,
    back to back in the buffer, `stride` bytes apart in the parameter (at least
    their length). Every slice is in exactly one run, in order; a slice that is
    `None`, or that fits no run, is a run of its own (`rows` 1, `stride` 0)."""
    out: list[tuple[int, int, int]] = []
    i, n = 0, len(slices)
    while i < n:
        first = slices[i]
        rows, stride = 1, 0
        second = slices[i + 1] if first is not None and i + 1 < n else None
        if first is not None and second is not None:
            stride = second.start - first.start
            while i + rows < n:
                row = slices[i + rows]
                if (
                    row is None
                    or row.param != first.param
                    or row.nbytes != first.nbytes
                    or row.offset != first.offset + rows * first.nbytes
                    or row.start != first.start + rows * stride
                    or stride < first.nbytes
                ):
                    break
                rows += 1
        out.append((i, rows, stride if rows > 1 else 0))
        i += rows
    return out
