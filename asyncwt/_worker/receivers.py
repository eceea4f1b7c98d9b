"""A worker's side of the round plan: its receiver, built in layers from the init.

The trainer's plan reaches a worker as its init info. This module turns it into
what the engine drives, one layer per choice the plan made, so the engine holds
no branch per mode: one receiver per sending trainer rank when the owners send
(`owners_receiver`), else the backend's receiver from rank 0, of the whole
model or, for sliced receivers, of the boxes this worker holds (`declared_boxes`,
declared on every sending rank's link after the handshake: rank 0's, or each
owner rank's); then, for delta rounds, a codec on its link (`delta_receiver`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .._core.plan import TransferPlan
from .._core.settings import WorkerPlanInfo
from .._core.slices import pack_layout
from .._transports.base import ReceiverTransport
from .._transports.link import LinkedReceiver
from .delta import WorkerDelta, delta_receiver
from .owners import owners_receiver
from .slices import declared_boxes, select_boxes

__all__ = ["WorkerSide", "worker_side"]


@dataclass(frozen=True, slots=True)
class WorkerSide:
    """What a worker receives rounds with."""

    receiver: ReceiverTransport
    plan: TransferPlan
    """The plan rounds name (its digest) and land by."""
    delta: WorkerDelta | None
    """The worker's side of delta rounds, when the plan's codec is delta."""


def worker_side(
    info: WorkerPlanInfo,
    parse: Callable[[dict[str, Any]], Any],
    make_receiver: Callable[[Any, TransferPlan], ReceiverTransport],
    model: torch.nn.Module,
) -> WorkerSide:
    """Build the receiver `info` describes, not yet connected.

    `parse(fields)` checks one sending rank's endpoint fields with the backend's
    init info class; `make_receiver(info, plan)` builds the backend's receiver
    from one sender. `model` says which boxes it holds, for sliced receivers.
    """
    receiver: ReceiverTransport
    boxes = declared_boxes(model, info.transfer_plan) if info.slices else None
    if info.owners is not None:  # every trainer rank sends its own shards
        receiver, plan = owners_receiver(info, parse, make_receiver, boxes)
        links = list(receiver.receivers)
    elif boxes is not None:  # this worker receives only the boxes its model holds
        plan = select_boxes(info.transfer_plan, boxes).plan
        receiver = make_receiver(info, plan)
        links = [receiver]
    else:
        plan = info.transfer_plan
        receiver = make_receiver(info, plan)
        links = []
    try:
        if boxes is not None:  # declared on every link: to each sending rank
            declared = pack_layout(info.transfer_plan, boxes)
            for link in links:
                if not isinstance(link, LinkedReceiver):
                    raise ValueError(
                        f"slices should be False for a {type(link).__name__} (sliced "
                        f"receivers declare their layout over a worker link: tcp's star), "
                        f"got True"
                    )
                link.declare(declared)
        delta = delta_receiver(receiver, plan) if info.codec == "delta" else None
    except BaseException:
        receiver.close()
        raise
    return WorkerSide(receiver, plan, delta)
