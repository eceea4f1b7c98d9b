"""A worker's side of the round plan: its receiver, built in layers from the init.

The trainer's plan reaches a worker as its init info. This module turns it into
what the engine drives, one layer per choice the plan made, so the engine holds
no branch per mode: one receiver per sending trainer rank when the owners send
(`owners_receiver`), else the backend's receiver from rank 0, of the whole
model or, for sliced receivers, of the boxes this worker holds (`selection_for`,
declared on its link after the handshake); then, for delta rounds, a codec on its
link (`delta_receiver`).
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
from .slices import selection_for

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
    declared = None
    if info.owners is not None:  # every trainer rank sends its own shards
        receiver, plan = owners_receiver(info, parse, make_receiver)
    elif info.slices:  # this worker receives only the boxes its model holds
        selection, boxes = selection_for(model, info.transfer_plan)
        plan = selection.plan
        declared = pack_layout(info.transfer_plan, boxes)
        receiver = make_receiver(info, plan)
    else:
        plan = info.transfer_plan
        receiver = make_receiver(info, plan)
    try:
        if declared is not None:
            if not isinstance(receiver, LinkedReceiver):
                raise ValueError(
                    f"slices should be False for a {type(receiver).__name__} (sliced "
                    f"receivers declare their layout over a worker link: tcp's star), got True"
                )
            receiver.declare(declared)
        delta = delta_receiver(receiver, plan) if info.codec == "delta" else None
    except BaseException:
        receiver.close()
        raise
    return WorkerSide(receiver, plan, delta)
