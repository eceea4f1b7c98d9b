"""The worker's applier on its own: chunked parameters, reassembly, receive buffers.

Buckets are packed here exactly as a trainer packs them (slice bytes at the plan's
offsets), then applied; the transports that carry them are tested across
processes in test_backends.py.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from asyncwt import (
    ApplyError,
    ModuleSource,
    TcpWorkerInitInfo,
    WeightTransferConfig,
    create_worker_engine,
)
from asyncwt._core.bytes import byte_view
from asyncwt._core.plan import Bucket, Slice, TransferPlan
from asyncwt._worker.applier import (
    DeferredApplier,
    ModelTarget,
    Transform,
    bucket_parts,
    split_runs,
)
from asyncwt._worker.engine import DeferredWorkerEngine

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


# -- elementwise transforms: runs of elements land as they arrive, split among threads --


@given(
    sizes=st.lists(
        st.tuples(st.integers(1, 300), st.sampled_from([1, 2, 4, 8])), min_size=1, max_size=12
    ),
    parts=st.integers(1, 6),
)
@settings(max_examples=300, deadline=None, derandomize=True)
def test_split_runs_covers_every_byte_once_in_order_cut_between_elements(
    sizes: list[tuple[int, int]], parts: int
) -> None:
    runs = []
    offset = 0
    for index, (count, itemsize) in enumerate(sizes):
        runs.append((Slice(index, 0, count * itemsize, offset), itemsize))
        offset += count * itemsize
    split = split_runs(runs, parts)
    assert 1 <= len(split) <= parts
    flat = [p for part in split for p in part]
    for s, itemsize in runs:  # every slice's bytes, once, in order, cut between elements
        mine = [p for p in flat if p.slice == s]
        assert [p.start for p in mine] == [0, *[p.start + p.nbytes for p in mine][:-1]]
        assert sum(p.nbytes for p in mine) == s.nbytes
        assert all(p.start % itemsize == 0 and p.nbytes % itemsize == 0 for p in mine)
    total = sum(s.nbytes for s, _ in runs)
    widest = max(itemsize for _, itemsize in runs)
    for part in split[:-1]:  # no part is much more than its share
        assert sum(p.nbytes for p in part) <= -(-total // parts) + widest


def _doubled_into_float32(
    calls: list[tuple[str, torch.Tensor, bool]], released: list[int]
) -> Transform:
    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        calls.append((name, tensor.clone(), bool(released)))
        return tensor.to(torch.float32) * 2

    return transform


def test_an_elementwise_transform_gets_runs_of_elements_split_among_threads() -> None:
    plan = _plan(_Model())
    worker = _Model(torch.float32)
    calls: list[tuple[str, torch.Tensor, bool]] = []
    released: list[int] = []
    transform = _doubled_into_float32(calls, released)
    target = ModelTarget.resolve(worker, plan, transform, elementwise=True, in_place=False)
    assert target.chunks_land == (True, True)
    applier = DeferredApplier(threads=3, min_part_bytes=512)
    try:
        for round_id in (1, 2):
            calls.clear()
            source = _trainer_model(seed=round_id)
            _apply_round(applier, target, plan, source, round_id)
            for name, param in worker.named_parameters():
                expected = dict(source.named_parameters())[name].detach().to(torch.float32) * 2
                assert torch.equal(param.detach(), expected), name
            # The transform saw flat runs, never a whole chunked parameter, and more
            # calls than buckets: each bucket's work was split among the threads.
            assert all(t.dim() == 1 for _, t, _ in calls)
            big = [t for n, t, _ in calls if n == "big"]
            assert max(t.numel() for t in big) < worker.big.numel()
            assert sum(t.numel() for t in big) == worker.big.numel()
            assert len(calls) > len(plan.buckets)
        assert applier._spare == {}  # no reassembly buffer was ever made
    finally:
        applier.shutdown()


def test_a_split_bucket_is_released_once_after_its_last_part() -> None:
    plan = _plan(_Model())
    bucket = plan.buckets[0]
    worker = _Model()
    started = threading.Barrier(2, timeout=10)

    def wait_for_the_other_part(name: str, tensor: torch.Tensor) -> torch.Tensor:
        started.wait()  # both parts of the bucket run at once, on two threads
        return tensor

    target = ModelTarget.resolve(
        worker, plan, wait_for_the_other_part, elementwise=True, in_place=False
    )
    whole, parts = bucket_parts(target, bucket, threads=2, min_part_bytes=512)
    assert whole == [] and len(parts) == 2
    applier = DeferredApplier(threads=2, min_part_bytes=512)
    released: list[int] = []
    try:
        applier.submit(
            target, 1, bucket, _packed(plan, _trainer_model(1), bucket), lambda: released.append(1)
        )
        applier.drain(timeout=10)
        assert released == [1]
    finally:
        applier.shutdown()


def test_an_elementwise_transform_that_changes_the_element_count_fails_naming_it() -> None:
    plan = _plan(_Model())

    def halves(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor[: tensor.numel() // 2]

    target = ModelTarget.resolve(_Model(), plan, halves, elementwise=True, in_place=False)
    applier = DeferredApplier(threads=2)
    try:
        bucket = plan.buckets[0]
        applier.submit(target, 1, bucket, _packed(plan, _trainer_model(1), bucket), lambda: None)
        with pytest.raises(
            ApplyError,
            match=r"^round 1, bucket 0: applying parameter 'big' failed: ValueError: an elementwise transform should return a tensor of as many elements as it is given \(2048, a run of the parameter's elements\), got 1024$",
        ):
            applier.drain(timeout=10)
    finally:
        applier.shutdown()


def test_a_model_with_load_weights_still_gets_whole_tensors_from_an_elementwise_transform() -> None:
    plan = _plan(_Model())
    loader = _Loader()
    target = ModelTarget.resolve(loader, plan, lambda n, t: t.clone(), elementwise=True)
    assert target.chunks_land == (False, False)
    applier = DeferredApplier(threads=2, min_part_bytes=1)
    try:
        source = _trainer_model(seed=3)
        _apply_round(applier, target, plan, source, 1)
        assert loader.kept["big"].shape == source.big.shape
        assert torch.equal(loader.kept["big"], source.big.detach())
    finally:
        applier.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"transform_elementwise": True},
            "transform_elementwise=True describes the transform, but transform is None; set a transform or leave transform_elementwise False",
        ),
        (
            {"transform": _recording([]), "transform_elementwise": 1},
            "transform_elementwise should be a bool, got 1",
        ),
    ],
)
def test_transform_elementwise_is_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        WeightTransferConfig(backend="tcp", **kwargs)  # type: ignore[arg-type]


def test_an_elementwise_transform_runs_in_place_on_bytes_received_into_the_parameter() -> None:
    plan = _plan(_Model())
    worker = _Model()
    seen: list[torch.Tensor] = []

    def double_in_place(name: str, tensor: torch.Tensor) -> torch.Tensor:
        seen.append(tensor)
        return tensor.mul_(2)

    target = ModelTarget.resolve(worker, plan, double_in_place, elementwise=True)
    assert target.direct == (True, True)  # the receiver writes straight into the model
    applier = DeferredApplier(threads=2, min_part_bytes=512)
    try:
        source = _trainer_model(seed=5)
        with torch.no_grad():  # what a receiver does for a direct parameter
            for name, param in worker.named_parameters():
                param.copy_(dict(source.named_parameters())[name])
        for bucket in plan.buckets:
            applier.submit(target, 1, bucket, None, lambda: None)
        applier.drain(timeout=10)
        for name, param in worker.named_parameters():
            assert torch.equal(param.detach(), dict(source.named_parameters())[name].detach() * 2)
        storages = {p.untyped_storage().data_ptr() for p in worker.parameters()}
        assert {t.untyped_storage().data_ptr() for t in seen} == storages
    finally:
        applier.shutdown()
