"""The pipeline with a sink that leaves buckets in flight (`send_bucket` returns a `Settle`).

The sink here reads each bucket's segments only when the bucket settles, after the
pipeline moved on: if a slot or a source tensor were reused before that, the bytes
read would differ from the model's.
"""

from __future__ import annotations

import anyio
import pytest
import torch

from asyncwt._core.bytes import byte_view
from asyncwt._core.lanes import DeviceLane
from asyncwt._core.plan import Bucket, TransferPlan
from asyncwt._core.source import ModuleSource
from asyncwt._trainer.pipeline import PipelineConfig, StagingPool, run_pipeline
from asyncwt._transports.base import Settle

pytestmark = pytest.mark.asyncio

BUCKET_BYTES = 4096


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # Long slices (sent in place) and short ones (packed into the slots) in each bucket.
    return torch.nn.Sequential(*(torch.nn.Linear(24, 16) for _ in range(12)))


class LateReadingSink:
    """Copies a bucket's segments out only when it settles, some time after sending."""

    def __init__(self, plan: TransferPlan, *, in_flight_buckets: int, fail_at: int | None = None):
        self.plan = plan
        self.min_view_bytes: int | None = 1024
        self.in_flight_buckets = in_flight_buckets
        self.fail_at = fail_at
        self.unsettled: list[int] = []
        self.most_unsettled = 0
        self.received: dict[int, bytes] = {}
        self.settled_order: list[int] = []
        self.cancel_at: tuple[int, anyio.CancelScope] | None = None

    def staging(self, slot: int) -> torch.Tensor | None:
        return None

    async def reclaim(self, slot: int) -> None:
        return None

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[torch.Tensor]) -> Settle:
        self.unsettled.append(bucket.index)
        self.most_unsettled = max(self.most_unsettled, len(self.unsettled))
        if self.cancel_at is not None and self.cancel_at[0] == bucket.index:
            self.cancel_at[1].cancel()

        async def settle() -> None:
            await anyio.sleep(0.01)  # the pipeline packs the next bucket meanwhile
            self.received[bucket.index] = b"".join(bytes(byte_view(s)) for s in segments)
            self.unsettled.remove(bucket.index)
            self.settled_order.append(bucket.index)
            if bucket.index == self.fail_at:
                raise RuntimeError(f"bucket {bucket.index} failed to deliver")

        return settle


def _expected(plan: TransferPlan, model: torch.nn.Module, bucket: Bucket) -> bytes:
    tensors = [p.detach() for p in model.parameters()]
    return b"".join(bytes(byte_view(tensors[s.param])[s.start : s.end]) for s in bucket.slices)


async def _run(sink: LateReadingSink, plan: TransferPlan, model: torch.nn.Module) -> None:
    cpu = torch.device("cpu")
    await run_pipeline(
        plan,
        ModuleSource(model),
        sink,
        pool=StagingPool(2, plan.bucket_bytes, cpu),
        iterate_lane=DeviceLane(cpu),
        pack_lane=DeviceLane(cpu),
        config=PipelineConfig(num_buffers=2),
        fence=DeviceLane(cpu).record_caller(),
    )


def _plan(model: torch.nn.Module) -> TransferPlan:
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=BUCKET_BYTES)
    assert len(plan.buckets) >= 4
    return plan


@pytest.mark.parametrize("in_flight_buckets", [1, 2, 3])
async def test_buckets_settle_in_order_with_their_bytes_intact(in_flight_buckets: int) -> None:
    model = _model()
    plan = _plan(model)
    sink = LateReadingSink(plan, in_flight_buckets=in_flight_buckets)
    await _run(sink, plan, model)
    assert sink.settled_order == list(range(len(plan.buckets)))
    assert not sink.unsettled
    # At most min(in_flight_buckets, num_buffers) buckets out at once, and that many.
    assert sink.most_unsettled == min(in_flight_buckets, 2)
    for bucket in plan.buckets:
        assert sink.received[bucket.index] == _expected(plan, model, bucket), bucket.index


async def test_a_failed_settle_fails_the_round_after_settling_the_rest() -> None:
    model = _model()
    plan = _plan(model)
    sink = LateReadingSink(plan, in_flight_buckets=2, fail_at=1)
    with pytest.raises(RuntimeError, match="bucket 1 failed to deliver"):
        await _run(sink, plan, model)
    assert not sink.unsettled, "a bucket was left in flight"
    assert 1 in sink.settled_order


async def test_a_cancelled_round_settles_every_bucket_in_flight() -> None:
    model = _model()
    plan = _plan(model)
    sink = LateReadingSink(plan, in_flight_buckets=2)
    with anyio.CancelScope() as scope:
        sink.cancel_at = (2, scope)  # cancelled as bucket 2 goes out, bucket 1 in flight
        await _run(sink, plan, model)
    assert scope.cancelled_caught
    assert sink.settled_order == [0, 1, 2]
    assert not sink.unsettled, "a bucket was left in flight"
    for index in sink.settled_order:
        assert sink.received[index] == _expected(plan, model, plan.buckets[index]), index


async def test_progress_is_told_the_bytes_sent_after_each_bucket() -> None:
    model = _model()
    plan = _plan(model)
    sink = LateReadingSink(plan, in_flight_buckets=2)
    told: list[tuple[int, int]] = []
    cpu = torch.device("cpu")
    await run_pipeline(
        plan,
        ModuleSource(model),
        sink,
        pool=StagingPool(2, plan.bucket_bytes, cpu),
        iterate_lane=DeviceLane(cpu),
        pack_lane=DeviceLane(cpu),
        config=PipelineConfig(num_buffers=2),
        fence=DeviceLane(cpu).record_caller(),
        progress=lambda sent, total: told.append((sent, total)),
    )
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    sent = 0
    expected = []
    for bucket in plan.buckets:
        sent += bucket.payload_bytes
        expected.append((sent, total))
    assert told == expected
    assert told[-1] == (total, total)
