"""A worker's side of the round plan: its receiver, built in layers from the init.

The trainer's plan reaches a worker as its init info. This module turns it into
what the engine drives, one layer per choice the plan made, so the engine holds
no branch per mode: one receiver per sending trainer rank when the owners send
(`owners_receiver`), else the backend's receiver from rank 0; then, for delta
rounds, a codec on its link (`delta_receiver`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._core.plan import TransferPlan
from .._core.settings import WorkerPlanInfo
from .._transports.base import ReceiverTransport
from .delta import WorkerDelta, delta_receiver
from .owners import owners_receiver

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
) -> WorkerSide:
    """Build the receiver `info` describes, not yet connected.

    `parse(fields)` checks one sending rank's endpoint fields with the backend's
    init info class; `make_receiver(info, plan)` builds the backend's receiver
    from one sender.
    """
    receiver: ReceiverTransport
    if info.owners is not None:  # every trainer rank sends its own shards
        receiver, plan = owners_receiver(info, parse, make_receiver)
    else:
        plan = info.transfer_plan
        receiver = make_receiver(info, plan)
    try:
        delta = delta_receiver(receiver, plan) if info.codec == "delta" else None
    except BaseException:
        receiver.close()
        raise
    return WorkerSide(receiver, plan, delta)
