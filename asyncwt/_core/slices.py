"""Sliced receivers: each receiver gets exactly the bytes of the boxes it holds (sans-I/O).

A receiver that holds part of a parameter (a tensor-parallel rank's shard)
declares, per parameter of the full plan, the box of the full tensor it holds
(`Box`, see `asyncwt._core.owners`; an empty box: none of it). From the sender's
plan and that declaration, both ends derive the same `Selection`, identically:

- `picks`: per bucket of the sender's plan, the byte ranges of the bucket's payload
  that go to this receiver (the sender sends them, in order, as that bucket's
  frame, and nothing else);
- `plan`: the receiver's own plan, bucket for bucket aligned with the sender's.
  Its parameters are the receiver's local tensors (named as the parameter, shaped
  as its box) and its slices say where each picked byte lands in them. A bucket
  of which the receiver holds nothing is an empty one (a frame of no payload).

A box's bytes are contiguous runs of the full tensor (`box_runs`): one run for a
`Shard(0)` slab, one per row for a `Shard(1)` block; adjacent picks merge, so the
sender hands the socket as few views as the layout allows.

The declaration travels as `pack_layout`: per parameter of the plan, in order, a
little-endian u64 start and size per dim. Its length is fixed by the plan, so a
receiver's declaration is read at a size the trainer knows before it reads.
"""

from __future__ import annotations

import bisect
import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .meta import ParamMeta
from .owners import Box
from .plan import Bucket, Slice, TransferPlan
from .receiver_layout import check_box

__all__ = [
    "Run",
    "Selection",
    "box_runs",
    "layout_nbytes",
    "pack_layout",
    "select",
    "unpack_layout",
    "wants_of",
]

_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class Run:
    """A contiguous run of bytes held by both ends: at `src` in the sender's tensor,
    at `dst` in the receiver's, `nbytes` long."""

    src: int
    dst: int
    nbytes: int


def _strides(size: Sequence[int]) -> list[int]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= n
    return strides[::-1]


def box_runs(held: Box, want: Box, itemsize: int) -> list[Run]:
    """The bytes of `held ∩ want` as runs contiguous in both tensors: `src` within a
    tensor holding `held`'s elements, `dst` within one holding `want`'s (both
    row-major), in `src` order. Empty when the boxes share no element."""
    if not held.size:  # a 0-d tensor: one element, held whole by both
        return [Run(0, 0, itemsize)]
    inter = held.intersection(want)
    if inter is None:
        return []
    ndim = len(inter.size)
    # The first dim from which every later dim is whole in all three boxes: a run
    # spans that dim's part and everything after it.
    split = ndim - 1
    while split > 0 and inter.size[split] == held.size[split] == want.size[split]:
        split -= 1
    run_elems = math.prod(inter.size[split:])
    held_strides, want_strides = _strides(held.size), _strides(want.size)
    runs = []
    for index in _indices(inter.size[:split]):
        src = dst = 0
        for d in range(ndim):
            at = inter.start[d] + (index[d] if d < split else 0)
            src += (at - held.start[d]) * held_strides[d]
            dst += (at - want.start[d]) * want_strides[d]
        runs.append(Run(src * itemsize, dst * itemsize, run_elems * itemsize))
    return runs


def _indices(size: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every index of a box of `size`, row-major."""
    for flat in range(math.prod(size)):
        index = []
        for n in reversed(size):
            index.append(flat % n)
            flat //= n
        yield tuple(reversed(index))


@dataclass(frozen=True, slots=True)
class Selection:
    """What one receiver gets of a sender's plan (see the module docstring)."""

    plan: TransferPlan
    """The receiver's plan: its local tensors (the parameters it holds some of, in
    order, shaped as its boxes), buckets aligned with the sender's."""
    picks: tuple[tuple[tuple[int, int], ...], ...]
    """Per bucket of the sender's plan: `(payload offset, nbytes)` ranges to send."""

    @property
    def total_bytes(self) -> int:
        """Payload bytes a round carries to this receiver."""
        return sum(n for bucket in self.picks for _, n in bucket)


def select(
    plan: TransferPlan,
    held: Sequence[Box],
    wants: Sequence[Box],
    *,
    digest: str,
) -> Selection:
    """The `Selection` of `plan` for a receiver that holds `wants` (one box of the
    full tensor per parameter of `plan`, in order), the sender holding `held` (the
    box each of `plan`'s parameters covers: the full tensor, or an owner's piece).

    The receiver's plan is named by `digest` (the round's), as the links check it.
    """
    if len(held) != len(plan.params) or len(wants) != len(plan.params):
        raise ValueError(
            f"held and wants should have one box per parameter of the plan "
            f"({len(plan.params)}), got {len(held)} and {len(wants)}"
        )
    # The receiver's tensors: the parameters it holds some of, in plan order.
    kept = [i for i, w in enumerate(wants) if _numel(w)]
    local_index = {param: i for i, param in enumerate(kept)}
    local = tuple(_local_meta(plan.params[i], wants[i]) for i in kept)
    runs = [
        box_runs(h, w, meta.dtype.itemsize) if i in local_index else []
        for i, (meta, h, w) in enumerate(zip(plan.params, held, wants))
    ]
    starts = [[run.src for run in param_runs] for param_runs in runs]
    buckets: list[Bucket] = []
    picks: list[tuple[tuple[int, int], ...]] = []
    for bucket in plan.buckets:
        slices: list[Slice] = []
        ranges: list[tuple[int, int]] = []
        payload = offset = 0
        for s in bucket.slices:
            param_runs = runs[s.param]
            first = max(bisect.bisect_right(starts[s.param], s.start) - 1, 0)
            for run in param_runs[first:]:
                lo, hi = max(run.src, s.start), min(run.src + run.nbytes, s.end)
                if run.src >= s.end:
                    break
                if hi <= lo:
                    continue
                at = payload + lo - s.start
                if ranges and ranges[-1][0] + ranges[-1][1] == at:
                    ranges[-1] = (ranges[-1][0], ranges[-1][1] + hi - lo)
                else:
                    ranges.append((at, hi - lo))
                _append_run(slices, local_index[s.param], run.dst + lo - run.src, hi - lo, offset)
                offset += hi - lo
            payload += s.nbytes
        buckets.append(Bucket(bucket.index, tuple(slices), offset, offset))
        picks.append(tuple(ranges))
    per_param: list[list[int]] = [[] for _ in local]
    for b in buckets:
        for s in b.slices:
            if not per_param[s.param] or per_param[s.param][-1] != b.index:
                per_param[s.param].append(b.index)
    receiver_plan = TransferPlan(
        params=local,
        bucket_bytes=plan.bucket_bytes,
        alignment=plan.alignment,
        buckets=tuple(buckets),
        digest=digest,
        param_buckets=tuple(tuple(b) for b in per_param),
    )
    return Selection(receiver_plan, tuple(picks))


def _append_run(slices: list[Slice], param: int, start: int, nbytes: int, offset: int) -> None:
    """Add a run to a receiver's bucket, merged into the last slice when it continues
    it in both the local tensor and the bucket: a column slice of a row-sharded piece
    is one run per row in the sender's tensor but one range of the receiver's (its
    box), so it lands with one copy, not one per row."""
    last = slices[-1] if slices else None
    if (
        last is not None
        and last.param == param
        and last.end == start
        and last.offset + last.nbytes == offset
    ):
        slices[-1] = Slice(param, last.start, last.nbytes + nbytes, last.offset)
    else:
        slices.append(Slice(param, start, nbytes, offset))


def wants_of(full: TransferPlan, boxes: Sequence[Box], plan: TransferPlan) -> list[Box]:
    """The box of each of `plan`'s parameters (by name) in `boxes`, declared one per
    parameter of `full`: what `select` takes as `wants` for a sender whose plan
    carries part of `full` (an owner rank's share plan), or all of it."""
    by_name = {meta.name: box for meta, box in zip(full.params, boxes)}
    return [by_name[meta.name] for meta in plan.params]


def _numel(box: Box) -> int:
    return box.numel if box.size else 1


def _local_meta(meta: ParamMeta, box: Box) -> ParamMeta:
    """`meta` as a receiver holding `box` of it has it: shaped as the box, whole."""
    return ParamMeta(meta.name, meta.dtype, box.size)


def check_layout(plan: TransferPlan, boxes: Sequence[Box], *, where: str) -> None:
    """`boxes` declares one box per parameter of `plan`, each inside its tensor
    (`check_box`); an error names `where` the layout came from."""
    if len(boxes) != len(plan.params):
        raise ValueError(
            f"{where}: a layout should have one box per parameter of the plan "
            f"({len(plan.params)}), got {len(boxes)}"
        )
    for meta, box in zip(plan.params, boxes):
        try:
            check_box(meta, box)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None


def layout_nbytes(plan: TransferPlan) -> int:
    """Bytes of a packed layout for `plan` (see `pack_layout`)."""
    return sum(2 * _U64.size * len(meta.shape) for meta in plan.params)


def pack_layout(plan: TransferPlan, boxes: Sequence[Box]) -> bytes:
    """A receiver's declared boxes as it sends them (checked against `plan` first)."""
    check_layout(plan, boxes, where="pack_layout")
    out = bytearray()
    for box in boxes:
        for s, n in zip(box.start, box.size):
            out += _U64.pack(s) + _U64.pack(n)
    return bytes(out)


def unpack_layout(plan: TransferPlan, data: bytes, *, where: str) -> tuple[Box, ...]:
    """The boxes a receiver declared, read back and checked against `plan`."""
    if len(data) != layout_nbytes(plan):
        raise ValueError(
            f"{where}: a layout for this plan is {layout_nbytes(plan)} bytes, got {len(data)}"
        )
    boxes, at = [], 0
    for meta in plan.params:
        start, size = [], []
        for _ in meta.shape:
            start.append(_U64.unpack_from(data, at)[0])
            size.append(_U64.unpack_from(data, at + _U64.size)[0])
            at += 2 * _U64.size
        boxes.append(Box(tuple(start), tuple(size)))
    check_layout(plan, boxes, where=where)
    return tuple(boxes)
