"""Sliced receivers' selection (sans-I/O): each receiver gets exactly its boxes' bytes."""

from __future__ import annotations

import math

import _slice_models as sm
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncwt._core.meta import ParamMeta, Shard
from asyncwt._core.owners import Box, OwnersLayout
from asyncwt._core.plan import TransferPlan
from asyncwt._core.slices import (
    box_runs,
    layout_nbytes,
    pack_layout,
    select,
    unpack_layout,
    wants_of,
)


def whole_box(shape: tuple[int, ...]) -> Box:
    return Box((0,) * len(shape), shape)


@st.composite
def boxes_in(draw: st.DrawFn, shape: tuple[int, ...], *, empty: bool) -> Box:
    """A box inside `shape` (maybe empty when `empty`)."""
    start, size = [], []
    for n in shape:
        lo = draw(st.integers(0, n))
        hi = draw(st.integers(lo if empty else min(lo + 1, n), n))
        if not empty and lo == n:
            lo, hi = n - 1, n
        start.append(lo)
        size.append(hi - lo)
    return Box(tuple(start), tuple(size))


@st.composite
def cases(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], list[Box], list[Box], int]:
    count = draw(st.integers(1, 4))
    shapes = [
        tuple(draw(st.lists(st.integers(1, 8), min_size=0, max_size=3))) for _ in range(count)
    ]
    # Rank 0 holds every tensor whole; an owner, a box of each.
    whole = draw(st.booleans())
    held = [
        draw(boxes_in(shape, empty=False)) if shape and not whole else whole_box(shape)
        for shape in shapes
    ]
    wants = [draw(boxes_in(shape, empty=True)) if shape else whole_box(shape) for shape in shapes]
    bucket_bytes = draw(st.sampled_from([16, 32, 48, 64, 256]))  # params chunked across buckets
    return shapes, held, wants, bucket_bytes


def region(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    return tensor[tuple(slice(s, s + n) for s, n in zip(box.start, box.size))]


@settings(max_examples=300, deadline=None)
@given(cases())
def test_a_receiver_gets_exactly_the_bytes_both_ends_hold(
    case: tuple[list[tuple[int, ...]], list[Box], list[Box], int],
) -> None:
    shapes, held, wants, bucket_bytes = case
    fulls = [torch.arange(math.prod(s), dtype=torch.float32).reshape(s) + 1 for s in shapes]
    # The sender's plan: its tensors are the boxes it holds.
    params = [ParamMeta(f"p{i}", torch.float32, h.size) for i, h in enumerate(held)]
    plan = TransferPlan.build(params, bucket_bytes=bucket_bytes, alignment=16)
    sent = [region(f, h).contiguous().view(-1).view(torch.uint8) for f, h in zip(fulls, held)]
    selection = select(plan, held, wants, digest=plan.digest)
    local = selection.plan
    assert len(local.buckets) == len(plan.buckets)
    received = {m.name: torch.zeros(m.shape, dtype=torch.float32) for m in local.params}
    covered = {m.name: torch.zeros(m.shape, dtype=torch.int32) for m in local.params}
    moved = 0
    for bucket, picks, landing in zip(plan.buckets, selection.picks, local.buckets):
        payload = torch.cat([sent[s.param][s.start : s.end] for s in bucket.slices])
        frame = torch.cat([payload[a : a + n] for a, n in picks] or [payload[:0]])
        assert frame.numel() == landing.payload_bytes
        moved += frame.numel()
        for s in landing.slices:
            name = local.params[s.param].name
            dst = received[name].view(-1).view(torch.uint8)
            dst[s.start : s.end] = frame[s.offset : s.offset + s.nbytes]
            covered[name].view(-1)[s.start // 4 : s.end // 4] += 1
    expected_bytes = 0
    for i, (full, h, w) in enumerate(zip(fulls, held, wants)):
        name = f"p{i}"
        if w.numel == 0 and w.size:
            assert name not in received  # holds none of it: not in its plan
            continue
        mask = torch.zeros(w.size, dtype=torch.int32)
        both = [
            slice(max(hs, ws) - ws, min(hs + hn, ws + wn) - ws)
            for hs, hn, ws, wn in zip(h.start, h.size, w.start, w.size)
        ]
        if all(b.stop > b.start for b in both):
            mask[tuple(both)] = 1
        assert torch.equal(covered[name], mask), name  # each byte both hold, exactly once
        want = region(full, w)
        assert torch.equal(received[name] * mask, want * mask), name
        expected_bytes += int(mask.sum()) * 4
    assert moved == expected_bytes == selection.total_bytes


def test_a_shard0_slab_is_one_run_and_a_shard1_block_one_run_per_row() -> None:
    full = Box((0, 0), (8, 6))
    assert box_runs(full, Box((4, 0), (4, 6)), 2) == [box_runs(full, Box((4, 0), (4, 6)), 2)[0]]
    (run,) = box_runs(full, Box((4, 0), (4, 6)), 2)
    assert (run.src, run.dst, run.nbytes) == (4 * 6 * 2, 0, 4 * 6 * 2)
    rows = box_runs(full, Box((0, 3), (8, 3)), 2)
    assert [(r.src, r.dst, r.nbytes) for r in rows] == [(r * 12 + 6, r * 6, 6) for r in range(8)]


def test_picks_merge_where_the_payload_is_contiguous() -> None:
    params = [ParamMeta("a", torch.float16, (4, 8)), ParamMeta("b", torch.float16, (4, 8))]
    plan = TransferPlan.build(params, bucket_bytes=1024, alignment=16)
    held = [whole_box((4, 8)), whole_box((4, 8))]
    wants = [Box((2, 0), (2, 8)), Box((0, 0), (2, 8))]  # a's second half, b's first half
    selection = select(plan, held, wants, digest=plan.digest)
    assert selection.picks == (((32, 64),),)  # one range: the two halves touch
    assert [m.shape for m in selection.plan.params] == [(2, 8), (2, 8)]


def test_a_layout_round_trips_and_bad_ones_name_the_parameter() -> None:
    params = [ParamMeta("w", torch.float32, (6, 4)), ParamMeta("s", torch.float32, ())]
    plan = TransferPlan.build(params, bucket_bytes=256, alignment=16)
    boxes = (Box((3, 0), (3, 4)), Box((), ()))
    data = pack_layout(plan, boxes)
    assert len(data) == layout_nbytes(plan) == 32
    assert unpack_layout(plan, data, where="test") == boxes
    with pytest.raises(ValueError, match=r"a layout for this plan is 32 bytes, got 31"):
        unpack_layout(plan, data[:-1], where="test")
    with pytest.raises(
        ValueError,
        match=r"^pack_layout: parameter 'w': box should lie inside shape \(6, 4\), got \[4, 7\)",
    ):
        pack_layout(plan, (Box((4, 0), (3, 4)), Box((), ())))
    with pytest.raises(
        ValueError,
        match=r"^pack_layout: parameter 'w': box start should be 2 ints >= 0 \(shape \(6, 4\)\)",
    ):
        pack_layout(plan, (Box((0,), (6,)), Box((), ())))
    with pytest.raises(ValueError, match=r"one box per parameter of the plan \(2\), got 1"):
        pack_layout(plan, (Box((0, 0), (6, 4)),))


def test_owner_ranks_together_land_each_tp_workers_boxes_exactly_once() -> None:
    """M:N: each owner rank selects from its share plan and pieces, with the worker's
    boxes declared over the full plan (`wants_of`); the ranks' picks, landed by each
    rank's receiver plan in the worker's tensors (by name), cover every byte of the
    worker's boxes exactly once, however FSDP rows and TP boxes cut each other."""
    metas = [
        ParamMeta(name, torch.float32, tuple(p.shape), owners=(0, 1), placements=(Shard(0),))
        for name, p in sm.full(seed=0).named_parameters()
    ]
    plan = TransferPlan.build(metas, bucket_bytes=1024, alignment=16)
    layout = OwnersLayout.build(plan, 2)
    fulls = {m.name: torch.randn(m.shape) for m in plan.params}
    for worker in (0, 1):
        declared = sm.boxes(worker, 2)
        boxes = [Box(*declared[m.name]) for m in plan.params]
        local = {m.name: torch.zeros(b.size) for m, b in zip(plan.params, boxes)}
        covered = {name: torch.zeros(t.shape, dtype=torch.int32) for name, t in local.items()}
        for rank, share in enumerate(layout.share_plans):
            held = [piece.box for piece in layout.pieces[rank]]
            selection = select(share, held, wants_of(plan, boxes, share), digest=share.digest)
            assert [m.name for m in selection.plan.params] == [m.name for m in share.params]
            sent = [
                region(fulls[m.name], h).contiguous().view(-1).view(torch.uint8)
                for m, h in zip(share.params, held)
            ]
            for bucket, picks, landing in zip(
                share.buckets, selection.picks, selection.plan.buckets
            ):
                payload = torch.cat([sent[s.param][s.start : s.end] for s in bucket.slices])
                frame = torch.cat([payload[a : a + n] for a, n in picks] or [payload[:0]])
                assert frame.numel() == landing.payload_bytes
                for s in landing.slices:
                    name = selection.plan.params[s.param].name
                    dst = local[name].view(-1).view(torch.uint8)
                    dst[s.start : s.end] = frame[s.offset : s.offset + s.nbytes]
                    covered[name].view(-1)[s.start // 4 : s.end // 4] += 1
        for m, box in zip(plan.params, boxes):
            assert torch.equal(covered[m.name], torch.ones(box.size, dtype=torch.int32)), m.name
            assert torch.equal(local[m.name], region(fulls[m.name], box)), m.name
