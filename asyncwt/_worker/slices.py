"""Sliced receivers, worker side: the boxes a worker's model holds, and its plan.

A model that holds part of some parameters (a tensor-parallel rank's shards)
says which part in `asyncwt_layout`: a mapping from a parameter's name to the
box of the full tensor it holds, `(start, size)` per dim. Every other parameter
of the plan is held whole. The worker declares these boxes to the trainer and
receives only their bytes, landing them in its local tensors (shaped as the
boxes) by the plan `asyncwt._core.slices.select` derives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .._core.owners import Box
from .._core.plan import TransferPlan
from .._core.receiver_layout import whole_box
from .._core.slices import Selection, check_layout, select

__all__ = ["LAYOUT_ATTRIBUTE", "declared_boxes", "select_boxes"]

LAYOUT_ATTRIBUTE = "asyncwt_layout"
"""The model attribute that declares the boxes it holds (see the module docstring)."""


def _ints(name: str, what: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, Sequence) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(
            f"{LAYOUT_ATTRIBUTE}[{name!r}] should be (start, size), two sequences of ints; "
            f"its {what} is {value!r}"
        )
    return tuple(value)


def declared_boxes(model: torch.nn.Module, plan: TransferPlan) -> tuple[Box, ...]:
    """The box of each of `plan`'s parameters `model` holds (checked against the plan)."""
    layout = getattr(model, LAYOUT_ATTRIBUTE, None)
    if layout is None:
        layout = {}
    if not isinstance(layout, Mapping):
        raise ValueError(
            f"model.{LAYOUT_ATTRIBUTE} should map parameter names to (start, size), got "
            f"{type(layout).__name__}"
        )
    names = {meta.name for meta in plan.params}
    unknown = sorted(set(layout) - names)
    if unknown:
        raise ValueError(
            f"model.{LAYOUT_ATTRIBUTE} names parameters the trainer does not send: {unknown[:5]}"
        )
    boxes = []
    for meta in plan.params:
        declared = layout.get(meta.name)
        if declared is None:
            boxes.append(whole_box(meta))
            continue
        if not isinstance(declared, Sequence) or len(declared) != 2:
            raise ValueError(
                f"{LAYOUT_ATTRIBUTE}[{meta.name!r}] should be (start, size), got {declared!r}"
            )
        start, size = declared
        boxes.append(Box(_ints(meta.name, "start", start), _ints(meta.name, "size", size)))
    check_layout(plan, boxes, where=f"model.{LAYOUT_ATTRIBUTE}")
    return tuple(boxes)


def select_boxes(plan: TransferPlan, boxes: Sequence[Box]) -> Selection:
    """What a worker holding `boxes` receives of rank 0's `plan`, which sends every
    parameter whole."""
    whole = [whole_box(meta) for meta in plan.params]
    return select(plan, whole, boxes, digest=plan.digest)
