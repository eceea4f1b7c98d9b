"""What an ideal pipeline could reach on the overlap pairs: the floor under each ratio.

Two stages of equal total cost overlap perfectly only if their work is divisible
without limit. It is not: a tensor is gathered whole before a byte of it can be
sent, and a received bucket is transformed in jobs. These floors replay the
stage-alone costs with no overhead at all (no round trips, no CPU contention, no
buffer limit), so a measured ratio can be read against what the work's own grain
allows, for the model the run used:

- `gather_wire_floors`: tensor `i` is ready at `(i + 1) × gather_alone / N`; the
  wire moves bytes at `total / wire_alone`, in order. `bucket`: a bucket is sent
  once its last tensor is ready (what asyncwt does); `tensor`: each tensor's bytes
  go as soon as it is ready (the least any sender of whole tensors can do).
- `transform_floor`: bucket `k` has fully arrived at its share of `wire_alone`;
  the applier's jobs (`transform_jobs`) then run first-come first-served on the
  apply threads, each costing its bytes at the calibrated rate.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from .._core.plan import TransferPlan

__all__ = ["gather_wire_floors", "transform_floor"]


def gather_wire_floors(plan: TransferPlan, gather_s: float, wire_s: float) -> dict[str, float]:
    """Seconds an ideal round would take, at bucket and at tensor granularity."""
    per_tensor = gather_s / len(plan.params)
    per_byte = wire_s / plan.total_bytes

    def ready(param: int) -> float:
        return (param + 1) * per_tensor

    by_bucket = by_tensor = 0.0
    for bucket in plan.buckets:
        by_bucket = max(by_bucket, ready(bucket.slices[-1].param)) + bucket.payload_bytes * per_byte
        for s in bucket.slices:
            by_tensor = max(by_tensor, ready(s.param)) + s.nbytes * per_byte
    return {"bucket": by_bucket, "tensor": by_tensor}


def transform_floor(
    plan: TransferPlan,
    jobs: Sequence[tuple[int, Sequence[tuple[str, int]]]],
    wire_s: float,
    s_per_bucket: float,
    threads: int,
) -> float:
    """Seconds until the last job ends, jobs starting on the first free thread once
    their bucket has arrived."""
    arrived: list[float] = []
    sent = 0
    for bucket in plan.buckets:
        sent += bucket.payload_bytes
        arrived.append(wire_s * sent / plan.total_bytes)
    free = [0.0] * threads
    end = 0.0
    for index, calls in jobs:
        start = max(arrived[index], heapq.heappop(free))
        finish = start + sum(s_per_bucket * n / plan.bucket_bytes for _, n in calls)
        heapq.heappush(free, finish)
        end = max(end, finish)
    return max(end, arrived[-1] if arrived else 0.0)
