"""The worker's applier on its own: chunked parameters, reassembly, receive buffers.

Buckets are packed here exactly as a trainer packs them (slice bytes at the plan's
offsets), then applied; the transports that carry them are tested across
processes in test_backends.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncwt import ModuleSource, TcpWorkerInitInfo, WeightTransferConfig, create_worker_engine
from asyncwt._applier import DeferredApplier, ModelTarget, Transform
from asyncwt._bytes import byte_view
from asyncwt._plan import Bucket, TransferPlan
from asyncwt._worker_engine import DeferredWorkerEngine

BUCKET = 4096


class _Model(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.zeros(3 * BUCKET // 2 + 7, dtype=dtype))  # 4 chunks in bf16
        self.small = nn.Parameter(torch.zeros(5, 3, dtype=dtype))


def _trainer_model(seed: int) -> _Model:
    model = _Model()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model


def _packed(plan: TransferPlan, model: nn.Module, bucket: Bucket) -> torch.Tensor:
    """`bucket` of `model` as a receive buffer holds it."""
    tensors = dict(model.named_parameters())
    buffer = torch.zeros(plan.bucket_bytes, dtype=torch.uint8)
    for s in bucket.slices:
        raw = byte_view(tensors[plan.params[s.param].name].detach())
        buffer[s.offset : s.offset + s.nbytes] = torch.frombuffer(
            raw[s.start : s.end], dtype=torch.uint8
        )
    return buffer


def _apply_round(
    applier: DeferredApplier,
    target: ModelTarget,
    plan: TransferPlan,
    source: nn.Module,
    round_id: int,
) -> list[torch.Tensor]:
    """Apply every bucket of `source`; the buffers handed out (to check their release)."""
    released: list[int] = []
    for bucket in plan.buckets:
        applier.submit(
            target,
            round_id,
            bucket,
            _packed(plan, source, bucket),
            lambda i=bucket.index: released.append(i),
        )
    applier.drain(timeout=10)
    assert sorted(released) == [b.index for b in plan.buckets]
    return list(applier._partial.values())  # nothing may stay half-assembled


def _plan(model: nn.Module) -> TransferPlan:
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=BUCKET)
    assert len(plan.param_buckets[0]) == 4, "big should be chunked over four buckets"
    return plan


@pytest.mark.parametrize(
    "worker_dtype", [torch.bfloat16, torch.float32], ids=["same-dtype", "cast"]
)
def test_chunks_land_in_their_element_range_without_a_whole_tensor_buffer(
    worker_dtype: torch.dtype,
) -> None:
    plan = _plan(_Model())
    worker = _Model(worker_dtype)
    target = ModelTarget.resolve(worker, plan, None, in_place=False)
    assert target.chunks_land == (True, True)
    applier = DeferredApplier(threads=3)
    try:
        for round_id in (1, 2):
            source = _trainer_model(seed=round_id)
            assert _apply_round(applier, target, plan, source, round_id) == []
            for name, param in worker.named_parameters():
                expected = dict(source.named_parameters())[name].detach().to(worker_dtype)
                assert torch.equal(param.detach(), expected), name
        assert applier._spare == {}  # no reassembly buffer was ever made
    finally:
        applier.shutdown()


def _recording(calls: list[tuple[str, torch.Tensor]]) -> Transform:
    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        calls.append((name, tensor))
        return tensor

    return transform


def test_with_a_transform_chunks_are_reassembled_in_one_buffer_reused_every_round() -> None:
    plan = _plan(_Model())
    worker = _Model()
    calls: list[tuple[str, torch.Tensor]] = []
    target = ModelTarget.resolve(worker, plan, _recording(calls), in_place=False)
    assert target.chunks_land == (False, False)
    applier = DeferredApplier(threads=2)
    try:
        storages = []
        for round_id in (1, 2, 3):
            calls.clear()
            source = _trainer_model(seed=round_id)
            _apply_round(applier, target, plan, source, round_id)
            (big,) = [t for n, t in calls if n == "big"]  # the transform saw it whole, once
            storages.append(big.untyped_storage().data_ptr())
            assert torch.equal(worker.big.detach(), source.big.detach())
            assert torch.equal(worker.small.detach(), source.small.detach())
        assert len(set(storages)) == 1, "the reassembly buffer should be reused by later rounds"
    finally:
        applier.shutdown()


class _Loader(nn.Module):
    """A model with `load_weights` that keeps what it is given (as vLLM's loaders may)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.kept.update(weights)


def test_a_tensor_given_to_load_weights_is_never_reused_by_a_later_round() -> None:
    plan = _plan(_Model())
    loader = _Loader()
    target = ModelTarget.resolve(loader, plan, None)
    applier = DeferredApplier(threads=2)
    try:
        first = _trainer_model(seed=1)
        _apply_round(applier, target, plan, first, 1)
        big_after_first = loader.kept["big"]
        assert torch.equal(big_after_first, first.big.detach())
        _apply_round(applier, target, plan, _trainer_model(seed=2), 2)
        assert torch.equal(big_after_first, first.big.detach()), (
            "round 2 overwrote round 1's tensor"
        )
        assert loader.kept["big"].data_ptr() != big_after_first.data_ptr()
    finally:
        applier.shutdown()


def _pool_size(config: WeightTransferConfig, model: nn.Module, num_buffers: int) -> int:
    engine = create_worker_engine(config, model=model)
    assert isinstance(engine, DeferredWorkerEngine)
    plan = _plan(_Model())
    info = TcpWorkerInitInfo(
        plan=plan.to_wire(), num_buffers=num_buffers, host="127.0.0.1", port=1, token="t"
    )
    pool = engine.receive_pool(info, plan)
    return pool._free.qsize()


@pytest.mark.parametrize(
    ("transform", "apply_threads", "num_buffers", "expected"),
    [
        (None, 4, 2, 2),  # a plain copy: the trainer's num_buffers
        (_recording([]), 4, 2, 5),  # a slow apply: one per apply thread + the one receiving
        (_recording([]), 1, 3, 3),  # never fewer than num_buffers
    ],
)
def test_receive_buffers_let_every_apply_thread_work_while_the_next_bucket_arrives(
    transform: Transform | None, apply_threads: int, num_buffers: int, expected: int
) -> None:
    config = WeightTransferConfig(backend="tcp", apply_threads=apply_threads, transform=transform)
    assert _pool_size(config, _Model(), num_buffers) == expected


def test_a_model_with_load_weights_gets_a_receive_buffer_per_apply_thread() -> None:
    config = WeightTransferConfig(backend="tcp", apply_threads=3)
    assert _pool_size(config, _Loader(), num_buffers=2) == 4
