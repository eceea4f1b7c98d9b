"""A receiver's declared layout: the block of each full parameter it holds (sans-I/O).

A receiver that holds a slice of the model (a vLLM tensor-parallel rank) declares,
for every parameter of the full plan, the one `Box` of the full tensor its local
tensor holds; the round then sends it exactly those bytes (`asyncwt._core.pairs`).
The helpers below spell the boxes such a rank holds:

- `whole_box`: all of it (a replicated parameter, `Replicate`);
- `shard_box`: rank `rank` of `size` ranks splitting dim `dim` evenly (`Shard(dim)`);
  an uneven split is refused, naming the explicit form;
- `range_box`: rows `[start, stop)` of a dim, clipped to the parameter (a
  vocab-parallel embedding whose padded range runs past the vocabulary, or misses it:
  an empty box, "needs nothing of this parameter");
- `kv_heads_box`: the key/value heads a rank holds when they may be fewer than the
  ranks (then each head is replicated across `size // kv_heads` ranks).

A layout travels as JSON (`to_wire`, `from_wire`); `from_wire` checks every field
against the plan before it builds anything, so a hostile declaration costs the
trainer no more than the plan's own size.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .meta import ParamMeta, Placement, Shard
from .owners import Box, _int_list
from .plan import TransferPlan
from .validate import check_int_in

__all__ = [
    "ReceiverLayout",
    "check_box",
    "kv_heads_box",
    "placement_box",
    "range_box",
    "shard_box",
    "whole_box",
]

RECEIVER_LAYOUT_FORMAT = 1


def whole_box(meta: ParamMeta) -> Box:
    """All of `meta`'s full tensor (what a replicated parameter's holder holds)."""
    return Box((0,) * len(meta.shape), meta.shape)


def _check_dim(meta: ParamMeta, dim: object) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not 0 <= dim < len(meta.shape):
        raise ValueError(
            f"parameter {meta.name!r}: dim should be in [0, {len(meta.shape)}) for shape "
            f"{meta.shape}, got {dim!r}"
        )
    return dim


def _check_group(meta: ParamMeta, size: int, rank: int) -> None:
    check_int_in(f"parameter {meta.name!r}: size", size, 1)
    check_int_in(f"parameter {meta.name!r}: rank", rank, 0, size - 1)


def range_box(meta: ParamMeta, dim: int, start: int, stop: int) -> Box:
    """Indices `[start, stop)` of dim `dim`, the other dims whole, clipped to the
    parameter: a range past its end holds what lies inside, or nothing (an empty box).

    The explicit form of a split `shard_box` refuses (uneven, or padded)."""
    dim = _check_dim(meta, dim)
    check_int_in(f"parameter {meta.name!r}: start", start, 0)
    check_int_in(f"parameter {meta.name!r}: stop", stop, 0)
    if stop < start:
        raise ValueError(f"parameter {meta.name!r}: stop should be >= start ({start}), got {stop}")
    length = meta.shape[dim]
    lo, hi = min(start, length), min(stop, length)
    begin = list(whole_box(meta).start)
    size = list(meta.shape)
    begin[dim], size[dim] = lo, hi - lo
    return Box(tuple(begin), tuple(size))


def shard_box(meta: ParamMeta, dim: int, *, size: int, rank: int) -> Box:
    """Rank `rank`'s part of dim `dim` split evenly over `size` ranks (`Shard(dim)` of
    a tensor-parallel group). The dim's length must divide by `size`; an uneven
    split is refused: spell it with `range_box`."""
    dim = _check_dim(meta, dim)
    _check_group(meta, size, rank)
    length = meta.shape[dim]
    if length % size:
        raise ValueError(
            f"parameter {meta.name!r}: dim {dim} has length {length}, which does not split "
            f"evenly over size={size} ranks; give each rank's range explicitly with "
            f"range_box(meta, {dim}, start, stop)"
        )
    step = length // size
    return range_box(meta, dim, rank * step, (rank + 1) * step)


def placement_box(meta: ParamMeta, placement: Placement, *, size: int, rank: int) -> Box:
    """What rank `rank` of a group of `size` holds under `placement`: `Replicate()`
    the whole tensor, `Shard(d)` its even part of dim `d` (see `shard_box`)."""
    if isinstance(placement, Shard):
        return shard_box(meta, placement.dim, size=size, rank=rank)
    _check_group(meta, size, rank)
    return whole_box(meta)


def kv_heads_box(meta: ParamMeta, *, kv_heads: int, head_dim: int, size: int, rank: int) -> Box:
    """The key/value heads rank `rank` of `size` holds of a K or V projection (`meta`'s
    dim 0 is `kv_heads * head_dim` rows, a head after another).

    With at least as many heads as ranks they split evenly (`shard_box` on dim 0);
    with fewer, each head is replicated and rank `rank` holds head
    `rank * kv_heads // size` whole."""
    _check_group(meta, size, rank)
    check_int_in(f"parameter {meta.name!r}: kv_heads", kv_heads, 1)
    check_int_in(f"parameter {meta.name!r}: head_dim", head_dim, 1)
    rows = meta.shape[0] if meta.shape else None
    if rows != kv_heads * head_dim:
        raise ValueError(
            f"parameter {meta.name!r}: dim 0 should have kv_heads * head_dim = "
            f"{kv_heads * head_dim} rows, got shape {meta.shape}"
        )
    if kv_heads >= size:
        return shard_box(meta, 0, size=size, rank=rank)
    head = rank * kv_heads // size
    return range_box(meta, 0, head * head_dim, (head + 1) * head_dim)


def check_box(meta: ParamMeta, box: Box) -> None:
    """Raise a `ValueError` naming the parameter unless `box` lies inside `meta`'s
    full tensor (one start and one size per dim, ints, within its shape)."""
    if not isinstance(box, Box):
        raise ValueError(f"parameter {meta.name!r}: the box should be a Box, got {box!r}")
    ndim = len(meta.shape)
    for name, values in (("start", box.start), ("size", box.size)):
        if (
            not isinstance(values, tuple)
            or len(values) != ndim
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values)
        ):
            raise ValueError(
                f"parameter {meta.name!r}: box {name} should be {ndim} ints >= 0 (shape "
                f"{meta.shape}), got {values!r}"
            )
    for dim, (start, size, length) in enumerate(zip(box.start, box.size, meta.shape)):
        if start + size > length:
            raise ValueError(
                f"parameter {meta.name!r}: box should lie inside shape {meta.shape}, got "
                f"[{start}, {start + size}) along dim {dim} (length {length})"
            )


@dataclass(frozen=True)
class ReceiverLayout:
    """The box of each full parameter one receiver holds, in the plan's order.

    Build it with `ReceiverLayout.build(params, {name: box})` (every parameter
    named once), or `ReceiverLayout.whole(params)`; rebuild a declaration a
    receiver sent with `from_wire`.
    """

    params: tuple[ParamMeta, ...]
    """The full plan's parameters the boxes are of."""
    boxes: tuple[Box, ...]
    """One per parameter: the block of the full tensor this receiver holds (an
    empty box: none of it)."""

    def __post_init__(self) -> None:
        if len(self.boxes) != len(self.params):
            raise ValueError(
                f"boxes should have one box per parameter ({len(self.params)}), got "
                f"{len(self.boxes)}"
            )
        for meta, box in zip(self.params, self.boxes):
            check_box(meta, box)

    @classmethod
    def build(cls, params: Sequence[ParamMeta], boxes: Mapping[str, Box]) -> ReceiverLayout:
        """The layout holding `boxes[name]` of each parameter of `params`: every
        parameter is named once, and no other name."""
        params = tuple(params)
        names = {meta.name for meta in params}
        unknown = sorted(name for name in boxes if name not in names)
        if unknown:
            raise ValueError(
                f"the receiver layout names parameters the plan does not have: {_few(unknown)}"
            )
        missing = [meta.name for meta in params if meta.name not in boxes]
        if missing:
            raise ValueError(
                f"the receiver layout should give a box for every parameter of the plan; "
                f"missing: {_few(missing)}"
            )
        return cls(params=params, boxes=tuple(boxes[meta.name] for meta in params))

    @classmethod
    def whole(cls, params: Sequence[ParamMeta]) -> ReceiverLayout:
        """A receiver holding every parameter whole (what an unsliced worker holds)."""
        params = tuple(params)
        return cls(params=params, boxes=tuple(whole_box(meta) for meta in params))

    def box(self, name: str) -> Box:
        """The box of parameter `name` this receiver holds."""
        for meta, box in zip(self.params, self.boxes):
            if meta.name == name:
                return box
        raise KeyError(f"the plan has no parameter {name!r}")

    @property
    def nbytes(self) -> int:
        """The bytes this receiver holds: what each round must bring it."""
        return sum(box.numel * meta.dtype.itemsize for meta, box in zip(self.params, self.boxes))

    @property
    def digest(self) -> str:
        """Over every parameter's name, shape, dtype and box."""
        h = hashlib.sha256(f"asyncwt-receiver-layout/{RECEIVER_LAYOUT_FORMAT}\n".encode())
        for meta, box in zip(self.params, self.boxes):
            h.update(f"{meta.name}|{meta.dtype}|{meta.shape}|{box.start}|{box.size}\n".encode())
        return h.hexdigest()

    def to_wire(self) -> dict[str, Any]:
        """The JSON-safe declaration: `[name, start, size]` per parameter."""
        return {
            "params": [
                [meta.name, list(box.start), list(box.size)]
                for meta, box in zip(self.params, self.boxes)
            ]
        }

    @classmethod
    def from_wire(cls, plan: TransferPlan, data: object) -> ReceiverLayout:
        """The layout a receiver declared (`to_wire` output) over `plan`.

        The declaration's length, every name and every list are checked against
        the plan before they are read further, so nothing larger than the plan is
        built from it; unknown, repeated and missing names are refused.
        """
        if not isinstance(data, dict):
            raise ValueError(f"a receiver layout should be a dict, got {type(data).__name__}")
        raw = data.get("params")
        if not isinstance(raw, list) or len(raw) != len(plan.params):
            got = len(raw) if isinstance(raw, list) else type(raw).__name__
            raise ValueError(
                f"receiver layout params should list the plan's {len(plan.params)} "
                f"parameters, got {got}"
            )
        index = {meta.name: i for i, meta in enumerate(plan.params)}
        boxes: dict[str, Box] = {}
        for entry in raw:
            if not isinstance(entry, list) or len(entry) != 3 or not isinstance(entry[0], str):
                raise ValueError(
                    f"a receiver layout entry should be [name, start, size], got {_short(entry)}"
                )
            name = entry[0]
            if name not in index:
                raise ValueError(
                    f"the receiver layout names parameters the plan does not have: {_short(name)}"
                )
            if name in boxes:
                raise ValueError(f"the receiver layout names parameter {name!r} twice")
            meta = plan.params[index[name]]
            ends = []
            for field, value in (("start", entry[1]), ("size", entry[2])):
                if not isinstance(value, list) or len(value) != len(meta.shape):
                    raise ValueError(
                        f"parameter {name!r}: box {field} should be {len(meta.shape)} ints "
                        f"(shape {meta.shape}), got {_short(value)}"
                    )
                ends.append(_int_list(f"parameter {name!r}: box {field}", value))
            boxes[name] = Box(ends[0], ends[1])
        return cls.build(plan.params, boxes)


def _few(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
