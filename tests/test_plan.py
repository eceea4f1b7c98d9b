import pytest
import torch

from asyncwt import ParamMeta, PlanMismatchError, TransferPlan


def metas() -> list[ParamMeta]:
    return [
        ParamMeta("embed", torch.float32, (10,)),
        ParamMeta("scalar", torch.bfloat16, ()),
        ParamMeta("big", torch.float32, (100,)),
        ParamMeta("empty", torch.float16, (0, 3)),
        ParamMeta("tail", torch.float32, (3,)),
    ]


def test_plan_is_deterministic_and_digest_is_stable() -> None:
    a = TransferPlan.build(metas(), bucket_bytes=128, alignment=16)
    b = TransferPlan.build(metas(), bucket_bytes=128, alignment=16)
    assert a == b
    assert a.digest == b.digest and len(a.digest) == 64


def test_plan_chunks_tensor_larger_than_bucket() -> None:
    plan = TransferPlan.build(metas(), bucket_bytes=128, alignment=16)
    assert plan.param_buckets[2] == (1, 2, 3, 4)
    chunks = [s for b in plan.buckets for s in b.slices if s.param == 2]
    assert [(s.start, s.nbytes) for s in chunks] == [(0, 128), (128, 128), (256, 128), (384, 16)]
    assert all(b.buffer_bytes <= 128 for b in plan.buckets)


def test_plan_covers_every_byte_once_and_aligns_slices() -> None:
    plan = TransferPlan.build(metas(), bucket_bytes=128, alignment=16)
    for index, meta in enumerate(plan.params):
        covered = sorted(
            (s.start, s.end) for b in plan.buckets for s in b.slices if s.param == index
        )
        position = 0
        for start, end in covered:
            assert start == position
            position = end
        assert position == meta.nbytes
    assert all(s.offset % 16 == 0 for b in plan.buckets for s in b.slices)
    assert plan.total_bytes == sum(m.nbytes for m in metas())


def test_plan_keeps_zero_size_and_zero_dim_tensors() -> None:
    plan = TransferPlan.build(metas(), bucket_bytes=128, alignment=16)
    assert plan.param_buckets[1] and plan.param_buckets[3]
    only_empty = TransferPlan.build(
        [ParamMeta("e", torch.float32, (0,))], bucket_bytes=64, alignment=16
    )
    assert len(only_empty.buckets) == 1 and only_empty.buckets[0].payload_bytes == 0


def test_plan_digest_changes_with_layout_inputs() -> None:
    base = TransferPlan.build(metas(), bucket_bytes=128, alignment=16).digest
    assert TransferPlan.build(metas(), bucket_bytes=256, alignment=16).digest != base
    assert TransferPlan.build(metas(), bucket_bytes=128, alignment=32).digest != base
    changed = metas()
    changed[0] = ParamMeta("embed", torch.float16, (10,))
    assert TransferPlan.build(changed, bucket_bytes=128, alignment=16).digest != base


def test_plan_round_trips_through_its_wire_form() -> None:
    plan = TransferPlan.build(metas(), bucket_bytes=128, alignment=16)
    assert TransferPlan.from_wire(plan.to_wire()) == plan


def test_plan_from_wire_rejects_a_tampered_digest() -> None:
    wire = TransferPlan.build(metas(), bucket_bytes=128, alignment=16).to_wire()
    wire["digest"] = "0" * 64
    with pytest.raises(
        PlanMismatchError, match=r"^the trainer's plan: transfer plan digest 0{16}… does not match"
    ):
        TransferPlan.from_wire(wire)


def test_plan_from_wire_rejects_malformed_input() -> None:
    with pytest.raises(ValueError, match=r"^plan description is malformed: KeyError\('params'\)$"):
        TransferPlan.from_wire({})
    with pytest.raises(
        ValueError, match=r"^dtype should name a torch dtype \(e\.g\. 'float32'\), got 'nope'$"
    ):
        TransferPlan.from_wire(
            {"params": [["a", "nope", [1]]], "bucket_bytes": 64, "alignment": 16, "digest": ""}
        )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bucket_bytes": 0}, r"^bucket_bytes should be a positive int, got 0$"),
        (
            {"bucket_bytes": 100},
            r"^bucket_bytes should be a multiple of alignment \(64\), got 100$",
        ),
        ({"alignment": 24}, r"^alignment should be a power of two >= 16, got 24$"),
    ],
)
def test_plan_rejects_bad_wire_parameters(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TransferPlan.build(metas(), **kwargs)


def test_plan_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match=r"^params should have distinct names; 'a' appears twice$"):
        TransferPlan.build([ParamMeta("a", torch.float32, (1,))] * 2)
