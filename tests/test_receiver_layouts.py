"""Slices to slices (`asyncwt._core.receiver_layout`, `asyncwt._core.pairs`): each
receiver declares the box of each parameter it holds, and each (sender, receiver)
pair's plan carries exactly the bytes both hold. In-process, no I/O: a round is
simulated in memory (cut, pack, land), the fast tier."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncwt._core.meta import ParamMeta, Placement, Replicate, Shard
from asyncwt._core.owners import Box
from asyncwt._core.pairs import PairPlans, pair_plan, rank0_pieces
from asyncwt._core.plan import TransferPlan
from asyncwt._core.receiver_layout import (
    ReceiverLayout,
    check_box,
    kv_heads_box,
    placement_box,
    range_box,
    shard_box,
    whole_box,
)
from asyncwt._core.round_plan import (
    BackendFeatures,
    RoundChoices,
    RoundPlan,
    build_round_plan,
    check_choices,
    dropping_workers,
    owner_senders,
    rank0_senders,
    via_chain,
    with_delta,
    with_receiver_layouts,
)

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64]


# --- an in-memory round -------------------------------------------------------------------


def _full(metas: list[ParamMeta]) -> dict[str, torch.Tensor]:
    """Every parameter's full tensor, each byte telling where it came from."""
    out = {}
    for i, m in enumerate(metas):
        raw = torch.arange(m.nbytes, dtype=torch.int64).mul(7).add(i * 31).remainder(251)
        out[m.name] = raw.to(torch.uint8).view(m.dtype).reshape(m.shape)
    return out


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(s, s + n) for s, n in zip(box.start, box.size))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Landed:
    """What one receiver ends with: its local tensors (landed by its pairs' plans),
    how many times each byte was written, bytes received."""

    local: dict[str, torch.Tensor]
    byte_writes: dict[str, torch.Tensor]
    received: int = 0


def _simulate(rp: RoundPlan, held_local: list[dict[int, torch.Tensor]]) -> list[Landed]:
    """Each sender packs its own buckets from its local tensors and sends each
    receiver the pair's picks of them; each receiver lands them by its pair plan."""
    pairs = rp.pairs
    assert pairs is not None
    params = pairs.plan.params
    held = rp.layout.pieces if rp.layout is not None else rank0_pieces(rp.plan)
    landed = []
    for layout in pairs.layouts:
        landed.append(
            Landed(
                local={
                    m.name: torch.zeros(b.size, dtype=m.dtype) for m, b in zip(params, layout.boxes)
                },
                byte_writes={
                    m.name: torch.zeros(b.numel * m.dtype.itemsize, dtype=torch.int32)
                    for m, b in zip(params, layout.boxes)
                },
            )
        )
    for pair in pairs.pairs:
        share = rp.share(pair.sender)
        assert share is not None
        pieces = held[pair.sender]
        sent = [_bytes(held_local[pair.sender][p.param][p.box.within(p.local)]) for p in pieces]
        into = landed[pair.receiver]
        local_plan = pair.selection.plan
        for bucket, picks, landing in zip(share.buckets, pair.selection.picks, local_plan.buckets):
            payload = torch.cat([sent[s.param][s.start : s.end] for s in bucket.slices])
            frame = torch.cat([payload[a : a + n] for a, n in picks] or [payload[:0]])
            assert frame.numel() == landing.payload_bytes
            into.received += frame.numel()
            for s in landing.slices:
                name = local_plan.params[s.param].name
                _bytes_view(into.local[name])[s.start : s.end] = frame[
                    s.offset : s.offset + s.nbytes
                ]
                into.byte_writes[name][s.start : s.end] += 1
    return landed


def _bytes_view(tensor: torch.Tensor) -> torch.Tensor:
    """A writable byte view of a contiguous tensor (0-d and empty ones included)."""
    return tensor.reshape(-1).view(torch.uint8)


def _held(rp: RoundPlan, full: dict[str, torch.Tensor]) -> list[dict[int, torch.Tensor]]:
    """Each sending rank's local tensors, by parameter index (what `iter_local` yields)."""
    names = [m.name for m in rp.plan.params]
    if rp.layout is None:
        return [{i: full[n] for i, n in enumerate(names)}]
    return [
        {i: full[names[i]][_index(box)].clone() for i, box in local.items()}
        for local in rp.layout.local
    ]


def _check_round(rp: RoundPlan) -> None:
    assert rp.pairs is not None
    full = _full(list(rp.plan.params))
    landed = _simulate(rp, _held(rp, full))
    for receiver, (layout, got) in enumerate(zip(rp.pairs.layouts, landed)):
        assert rp.need(receiver) == layout.boxes
        assert got.received == layout.nbytes, "a receiver got other bytes than it holds"
        for meta, box in zip(rp.plan.params, layout.boxes):
            want = full[meta.name][_index(box)]
            assert torch.equal(_bytes(got.local[meta.name]), _bytes(want)), (receiver, meta.name)
            assert bool((got.byte_writes[meta.name] == 1).all()), (receiver, meta.name)
    assert rp.pairs.total_bytes == sum(layout.nbytes for layout in rp.pairs.layouts)


# --- the property ---------------------------------------------------------------------------


@st.composite
def _owned(
    draw: st.DrawFn, name: str, dtype: torch.dtype, shape: tuple[int, ...], world: int
) -> ParamMeta:
    """A parameter as an owner-sending trainer holds it: every rank, or some ranks
    over a 1-D or 2-D mesh, each axis `Shard` or `Replicate`."""
    if draw(st.booleans()):
        return ParamMeta(name, dtype, shape)
    count = draw(st.integers(1, world))
    owners = tuple(draw(st.permutations(range(world)))[:count])
    mesh = draw(st.sampled_from([(count,)] + ([(2, count // 2)] if count % 2 == 0 else [])))
    axis: st.SearchStrategy[Placement] = (
        st.one_of(st.just(Replicate()), st.builds(Shard, st.integers(0, len(shape) - 1)))
        if shape
        else st.just(Replicate())
    )
    placements = tuple(draw(axis) for _ in mesh)
    return ParamMeta(name, dtype, shape, owners=owners, mesh_shape=mesh, placements=placements)


@st.composite
def _receiver_box(draw: st.DrawFn, meta: ParamMeta, size: int, rank: int) -> Box:
    """A box a receiver of a group of `size` may hold: whole, an even shard, an
    explicit (maybe padded, maybe empty) range, or nothing."""
    if not meta.shape:
        return whole_box(meta)
    dim = draw(st.integers(0, len(meta.shape) - 1))
    length = meta.shape[dim]
    kind = draw(st.sampled_from(["whole", "shard", "range", "empty"]))
    if kind == "shard" and length % size == 0:
        return shard_box(meta, dim, size=size, rank=rank)
    if kind == "empty":
        return range_box(meta, dim, length, length + 2)
    if kind == "whole":
        return placement_box(meta, Replicate(), size=size, rank=rank)
    start = draw(st.integers(0, length + 1))
    return range_box(meta, dim, start, start + draw(st.integers(0, length + 1)))


@st.composite
def _rounds(draw: st.DrawFn) -> RoundPlan:
    world = draw(st.integers(1, 4))
    owners = draw(st.booleans())
    metas = []
    for i in range(draw(st.integers(1, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
        dtype = draw(st.sampled_from(DTYPES))
        metas.append(
            draw(_owned(f"p{i}", dtype, shape, world))
            if owners
            else ParamMeta(f"p{i}", dtype, shape)
        )
    plan = TransferPlan.build(
        metas, bucket_bytes=draw(st.sampled_from([32, 64, 256])), alignment=16
    )
    rp = owner_senders(plan, world_size=world) if owners else rank0_senders(plan, world_size=world)
    size = draw(st.integers(1, 4))
    layouts = [
        ReceiverLayout.build(
            plan.params, {m.name: draw(_receiver_box(m, size, rank)) for m in plan.params}
        )
        for rank in range(size)
    ]
    return with_receiver_layouts(rp, layouts)


@settings(max_examples=80, deadline=None)
@given(rp=_rounds())
def test_every_receiver_gets_exactly_the_bytes_it_holds_each_once(rp: RoundPlan) -> None:
    _check_round(rp)
    assert rp.pairs is not None
    held = rp.layout.pieces if rp.layout is not None else rank0_pieces(rp.plan)
    for receiver, layout in enumerate(rp.pairs.layouts):  # a receiver builds its own pairs
        alone = [
            pair_plan(share, s, pieces, receiver, layout, digest=rp.round_digest)
            for s, pieces in enumerate(held)
            if (share := rp.share(s)) is not None
        ]
        assert [p for p in alone if p is not None] == list(rp.pairs.to_receiver(receiver))
    for layout in rp.pairs.layouts:  # and each declaration travels as JSON unchanged
        assert ReceiverLayout.from_wire(rp.plan, json.loads(json.dumps(layout.to_wire()))) == layout


def test_tp_receivers_of_an_fsdp_trainer_get_their_rows_from_the_ranks_that_hold_them() -> None:
    """M:N: two owner ranks (rows split), two receivers (columns, then rows split)."""
    metas = [
        ParamMeta("rows", torch.float32, (4, 6), owners=(0, 1), placements=(Shard(0),)),
        ParamMeta("cols", torch.float32, (4, 6), owners=(0, 1), placements=(Shard(0),)),
        ParamMeta("norm", torch.float32, (6,)),
    ]
    plan = TransferPlan.build(metas, bucket_bytes=64, alignment=16)
    layouts = [
        ReceiverLayout.build(
            plan.params,
            {
                "rows": shard_box(metas[0], 0, size=2, rank=r),
                "cols": shard_box(metas[1], 1, size=2, rank=r),
                "norm": whole_box(metas[2]),
            },
        )
        for r in range(2)
    ]
    rp = with_receiver_layouts(owner_senders(plan, world_size=2), layouts)
    _check_round(rp)
    assert rp.pairs is not None
    sent = {
        (p.sender, p.receiver): [(m.name, m.shape) for m in p.selection.plan.params]
        for p in rp.pairs.pairs
    }
    # Each pair lands in the receiver's tensors, shaped as its boxes (the same ones
    # whichever rank sends); rank 1 holds none of receiver 0's rows of 'rows' (its
    # rows are 2 and 3), so that pair lands nothing in it.
    assert sent[(0, 0)] == sent[(1, 0)] == [("rows", (2, 6)), ("cols", (4, 3)), ("norm", (6,))]
    landed = {s.param for b in rp.pairs.pair(1, 0).selection.plan.buckets for s in b.slices}  # type: ignore[union-attr]
    assert landed == {1, 2}
    sizes = {(p.sender, p.receiver): p.total_bytes for p in rp.pairs.pairs}
    assert sizes[(0, 0)] == (12 + 6 + 3) * 4 and sizes[(1, 0)] == (6 + 3) * 4
    assert rp.pairs.total_bytes == 2 * (12 + 12 + 6) * 4  # each receiver its half, norm whole
    edge = rp.pairs.pair(1, 0)
    assert edge is not None
    (bucket,) = [b for b in edge.selection.plan.buckets if b.slices]
    # rank 1's rows 2 and 3 of receiver 0's columns: half of each of rank 1's rows (a
    # run per row there), but bytes 24..48 of the receiver's (4, 3) tensor, so one
    # slice lands both; then the second half of 'norm'
    assert [(s.param, s.start, s.nbytes) for s in bucket.slices] == [(1, 24, 24), (2, 12, 12)]
    assert edge.selection.picks[bucket.index] == ((0, 12), (24, 12), (48, 12))


# --- edges, digest, choices -----------------------------------------------------------------


def _plan() -> TransferPlan:
    return TransferPlan.build(
        [
            ParamMeta("w", torch.float32, (4, 6), owners=(0, 1), placements=(Shard(0),)),
            ParamMeta("b", torch.float32, (6,)),
        ],
        bucket_bytes=64,
        alignment=16,
    )


def _layouts(plan: TransferPlan, dim: int, size: int = 2) -> list[ReceiverLayout]:
    w, b = plan.params
    return [
        ReceiverLayout.build(
            plan.params, {"w": shard_box(w, dim, size=size, rank=r), "b": whole_box(b)}
        )
        for r in range(size)
    ]


def test_edges_join_only_the_pairs_that_share_bytes() -> None:
    plan = TransferPlan.build(
        [ParamMeta("w", torch.float32, (4, 6), owners=(0, 1), placements=(Shard(0),))]
    )
    by_rows = with_receiver_layouts(owner_senders(plan, world_size=2), _one(plan, 0))
    assert [(e.source.index, e.target.index) for e in by_rows.edges(2)] == [(0, 0), (1, 1)]
    assert {e.admission.kind for e in by_rows.edges(2)} == {"init-token"}
    by_cols = with_receiver_layouts(owner_senders(plan, world_size=2), _one(plan, 1))
    assert [(e.source.index, e.target.index) for e in by_cols.edges(2)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]
    nothing = ReceiverLayout.build(plan.params, {"w": range_box(plan.params[0], 0, 9, 12)})
    assert nothing.boxes == (Box((4, 0), (0, 6)),) and nothing.nbytes == 0
    rp = with_receiver_layouts(rank0_senders(plan), [_one(plan, 0)[0], nothing])
    assert [(e.source.index, e.target.index) for e in rp.edges(2)] == [(0, 0)]
    assert rp.need(1) == nothing.boxes
    with pytest.raises(
        ValueError,
        match=r"^receivers should be the 2 receivers whose layouts the plan was built with, got 3$",
    ):
        rp.edges(3)


def _one(plan: TransferPlan, dim: int) -> list[ReceiverLayout]:
    (w,) = plan.params
    return [
        ReceiverLayout.build(plan.params, {"w": shard_box(w, dim, size=2, rank=r)})
        for r in range(2)
    ]


def test_the_digest_is_stable_and_sees_every_layout() -> None:
    plan = _plan()
    rows, cols = _layouts(plan, 0), _layouts(plan, 1)
    a = with_receiver_layouts(owner_senders(plan, world_size=2), rows)
    assert (
        a.digest
        == with_receiver_layouts(owner_senders(plan, world_size=2), _layouts(plan, 0)).digest
    )
    assert a.pairs is not None and a.layout is not None
    shares = [a.share(rank) for rank in range(2)]
    again = PairPlans.build(plan, shares, a.layout.pieces, rows, digest=a.round_digest)
    assert a.pairs.digest == again.digest
    digests = {
        a.digest,
        with_receiver_layouts(owner_senders(plan, world_size=2), cols).digest,
        with_receiver_layouts(owner_senders(plan, world_size=2), rows[::-1]).digest,
        with_receiver_layouts(rank0_senders(plan, world_size=2), rows).digest,
        with_receiver_layouts(
            owner_senders(plan, world_size=2), [ReceiverLayout.whole(plan.params)] * 2
        ).digest,
        owner_senders(plan, world_size=2).digest,
    }
    assert len(digests) == 6
    assert a.round_digest == owner_senders(plan, world_size=2).round_digest  # what rounds name
    assert rank0_senders(plan).pairs is None  # whole receivers: as before


def test_the_digests_cover_the_pairs_and_the_declarations_themselves() -> None:
    """The needs and senders already determine the pairs; the digests cover the pairs
    and each declaration as sent too, so a plan that differs in either differs."""
    plan = _plan()
    w, b = plan.params
    a = with_receiver_layouts(rank0_senders(plan), _layouts(plan, 0))
    other = with_receiver_layouts(rank0_senders(plan), _layouts(plan, 1))
    assert a.pairs is not None and other.pairs is not None
    swapped = dataclasses.replace(a, pairs=other.pairs)._digested()  # needs kept, pairs not
    assert swapped.digest != a.digest
    nothing = [
        ReceiverLayout.build(
            plan.params, {"w": range_box(w, dim, 9, 9), "b": range_box(b, 0, 9, 9)}
        )
        for dim in (0, 1)
    ]
    first, second = (
        PairPlans.build(plan, [plan], rank0_pieces(plan), [n], digest=plan.digest) for n in nothing
    )
    assert first.pairs == second.pairs == ()
    assert first.digest != second.digest  # the same bytes (none), declared otherwise
    one, two = a.pairs.pairs  # rank 0 to each receiver: their rows
    assert len({one.digest, two.digest, dataclasses.replace(two, receiver=0).digest}) == 3
    # The same bytes picked, landed elsewhere: another pair.
    landed = dataclasses.replace(one.selection, plan=two.selection.plan)
    assert dataclasses.replace(one, selection=landed).digest != one.digest


def test_build_round_plan_takes_the_layouts_when_receivers_are_sliced() -> None:
    plan = _plan()
    layouts = _layouts(plan, 1)
    for senders in ("rank0", "owners"):
        built = build_round_plan(
            plan.params,
            bucket_bytes=64,
            alignment=16,
            choices=RoundChoices(senders=senders, receivers="sliced"),  # type: ignore[arg-type]
            world_size=2,
            layouts=layouts,
        )
        base = (
            owner_senders(plan, world_size=2)
            if senders == "owners"
            else rank0_senders(plan, world_size=2)
        )
        assert built == with_receiver_layouts(base, layouts)
        assert built.choices.receivers == "sliced"
    # Without layouts the receivers declare theirs at init: the needs come then.
    pending = build_round_plan(
        plan.params, bucket_bytes=64, alignment=16, choices=RoundChoices(receivers="sliced")
    )
    assert pending.choices.receivers == "whole" and pending.pairs is None
    with pytest.raises(
        ValueError,
        match=r"^layouts should be given only with receivers='sliced', got receivers='whole' "
        r"with 2 layouts$",
    ):
        build_round_plan(
            plan.params, bucket_bytes=64, alignment=16, choices=RoundChoices(), layouts=layouts
        )


def test_sliced_receivers_refuse_a_chain_and_delta_naming_both_settings() -> None:
    plan = _plan()
    layouts = _layouts(plan, 0)
    sliced = with_receiver_layouts(rank0_senders(plan), layouts)
    chain = (
        "receivers='sliced' cannot be combined with fanout=Chain(): "
        "a relay forwards the whole stream"
    )
    delta = (
        "receivers='sliced' cannot be combined with delta=Delta(): "
        "a delta round's base is the whole tensor"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(chain)}"):
        via_chain(sliced)
    with pytest.raises(ValueError, match=f"^{re.escape(chain)}"):
        with_receiver_layouts(via_chain(rank0_senders(plan)), layouts)
    with pytest.raises(ValueError, match=f"^{re.escape(delta)}"):
        with_delta(sliced)
    with pytest.raises(ValueError, match=f"^{re.escape(delta)}"):
        with_receiver_layouts(with_delta(rank0_senders(plan)), layouts)
    with pytest.raises(ValueError, match=f"^{re.escape(chain)}"):
        dataclasses.replace(sliced, route="chain")  # nor by hand
    for choices, message in (
        (RoundChoices(receivers="sliced", route="chain"), chain),
        (RoundChoices(receivers="sliced", codec="delta"), delta),
    ):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            check_choices(choices)
    assert dropping_workers(sliced).choices == RoundChoices(
        receivers="sliced", on_worker_failure="drop"
    )


def test_every_combination_with_sliced_receivers_is_built_or_refused() -> None:
    """The 32 combinations of senders x route x codec x failure x receivers."""
    plan = _plan()
    built = []
    for senders, route, codec, failure, receivers in itertools.product(
        ("rank0", "owners"),
        ("star", "chain"),
        ("raw", "delta"),
        ("fail", "drop"),
        ("whole", "sliced"),
    ):
        choices = RoundChoices(
            senders=senders,
            route=route,
            codec=codec,
            on_worker_failure=failure,
            receivers=receivers,
        )  # type: ignore[arg-type]
        try:
            rp = build_round_plan(
                plan.params,
                bucket_bytes=64,
                alignment=16,
                choices=choices,
                world_size=2,
                layouts=_layouts(plan, 0) if receivers == "sliced" else None,
            )
        except ValueError as exc:
            assert " cannot be combined with " in str(exc)
            continue
        assert rp.choices == choices
        built.append(choices)
    assert len(built) == 9
    assert [c for c in built if c.receivers == "sliced"] == [
        RoundChoices(receivers="sliced"),
        RoundChoices(receivers="sliced", on_worker_failure="drop"),
        RoundChoices(senders="owners", receivers="sliced"),
    ]


def test_a_backend_runs_sliced_receivers_only_when_it_opts_in() -> None:
    with pytest.raises(
        ValueError,
        match=(
            r"^receivers should be 'whole' for the tcp backend \(no backend runs receivers "
            r"that declare their slices yet\), got 'sliced'$"
        ),
    ):
        check_choices(RoundChoices(receivers="sliced"), BackendFeatures(), "tcp")
    check_choices(
        RoundChoices(receivers="sliced"), BackendFeatures(receivers=("whole", "sliced")), "tcp"
    )


# --- the helpers a tensor-parallel rank spells its boxes with ------------------------------


def test_boxes_of_a_tensor_parallel_rank() -> None:
    w = ParamMeta("w", torch.float32, (8, 6))
    assert whole_box(w) == placement_box(w, Replicate(), size=4, rank=3) == Box((0, 0), (8, 6))
    assert (
        shard_box(w, 1, size=3, rank=2)
        == placement_box(w, Shard(1), size=3, rank=2)
        == Box((0, 4), (8, 2))
    )
    assert shard_box(w, 0, size=1, rank=0) == whole_box(w)
    embed = ParamMeta("embed", torch.float32, (10, 4))  # vocab 10 padded to 12 over 4 ranks
    assert [range_box(embed, 0, 3 * r, 3 * r + 3) for r in range(4)] == [
        Box((0, 0), (3, 4)),
        Box((3, 0), (3, 4)),
        Box((6, 0), (3, 4)),
        Box((9, 0), (1, 4)),  # clipped to the vocabulary
    ]
    assert range_box(embed, 0, 12, 15) == Box((10, 0), (0, 4))  # past it: nothing
    assert range_box(ParamMeta("v", torch.float32, (4,)), 0, 2, 2).numel == 0


def test_kv_heads_split_evenly_or_are_replicated_when_fewer_than_the_ranks() -> None:
    k = ParamMeta("k", torch.float32, (2 * 3, 5))  # 2 kv heads of head_dim 3
    fewer = [kv_heads_box(k, kv_heads=2, head_dim=3, size=4, rank=r) for r in range(4)]
    assert fewer == [Box((0, 0), (3, 5))] * 2 + [Box((3, 0), (3, 5))] * 2
    assert [kv_heads_box(k, kv_heads=2, head_dim=3, size=8, rank=r).start[0] for r in range(8)] == [
        0
    ] * 4 + [3] * 4
    assert [kv_heads_box(k, kv_heads=2, head_dim=3, size=2, rank=r) for r in range(2)] == [
        shard_box(k, 0, size=2, rank=r) for r in range(2)
    ]
    bias = ParamMeta("k.bias", torch.float32, (4 * 2,))
    assert kv_heads_box(bias, kv_heads=4, head_dim=2, size=2, rank=1) == Box((4,), (4,))


BAD_HELPERS: list[tuple[Any, str]] = [
    (
        lambda: shard_box(ParamMeta("embed", torch.float32, (10, 4)), 0, size=4, rank=0),
        (
            r"^parameter 'embed': dim 0 has length 10, which does not split evenly over size=4 "
            r"ranks; give each rank's range explicitly with range_box\(meta, 0, start, stop\)$"
        ),
    ),
    (
        lambda: shard_box(ParamMeta("w", torch.float32, (4, 4)), 2, size=2, rank=0),
        r"^parameter 'w': dim should be in \[0, 2\) for shape \(4, 4\), got 2$",
    ),
    (
        lambda: shard_box(ParamMeta("w", torch.float32, (4, 4)), 0, size=2, rank=2),
        r"^parameter 'w': rank should be an int in \[0, 1\], got 2$",
    ),
    (
        lambda: placement_box(ParamMeta("w", torch.float32, (4,)), Replicate(), size=0, rank=0),
        r"^parameter 'w': size should be an int >= 1, got 0$",
    ),
    (
        lambda: range_box(ParamMeta("w", torch.float32, (4,)), 0, 3, 1),
        r"^parameter 'w': stop should be >= start \(3\), got 1$",
    ),
    (
        lambda: range_box(ParamMeta("w", torch.float32, (4,)), 0, -1, 1),
        r"^parameter 'w': start should be an int >= 0, got -1$",
    ),
    (
        lambda: kv_heads_box(
            ParamMeta("k", torch.float32, (7, 2)), kv_heads=2, head_dim=3, size=4, rank=0
        ),
        r"^parameter 'k': dim 0 should have kv_heads \* head_dim = 6 rows, got shape \(7, 2\)$",
    ),
    (
        lambda: kv_heads_box(
            ParamMeta("k", torch.float32, (6,)), kv_heads=0, head_dim=3, size=4, rank=0
        ),
        r"^parameter 'k': kv_heads should be an int >= 1, got 0$",
    ),
    (
        lambda: check_box(ParamMeta("w", torch.float32, (4, 6)), Box((2, 0), (3, 6))),
        (
            r"^parameter 'w': box should lie inside shape \(4, 6\), got \[2, 5\) along dim 0 "
            r"\(length 4\)$"
        ),
    ),
    (
        lambda: check_box(ParamMeta("w", torch.float32, (4, 6)), Box((0,), (4,))),
        r"^parameter 'w': box start should be 2 ints >= 0 \(shape \(4, 6\)\), got \(0,\)$",
    ),
    (
        lambda: check_box(ParamMeta("w", torch.float32, (4,)), Box((0,), (True,))),
        r"^parameter 'w': box size should be 1 ints >= 0 \(shape \(4,\)\), got \(True,\)$",
    ),
    (
        lambda: ReceiverLayout.build(
            [ParamMeta("w", torch.float32, (4,))], {"w": Box((0,), (4,)), "x": Box((0,), (1,))}
        ),
        r"^the receiver layout names parameters the plan does not have: 'x'$",
    ),
    (
        lambda: ReceiverLayout.build(
            [ParamMeta("w", torch.float32, (4,)), ParamMeta("v", torch.float32, (4,))],
            {"w": Box((0,), (4,))},
        ),
        r"^the receiver layout should give a box for every parameter of the plan; missing: 'v'$",
    ),
]


@pytest.mark.parametrize(("call", "message"), BAD_HELPERS)
def test_a_bad_box_is_refused_naming_the_parameter_expected_and_got(
    call: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def test_a_layout_of_another_plan_is_refused() -> None:
    plan = _plan()
    other = [ReceiverLayout.whole([ParamMeta("w", torch.float32, (4, 7)), plan.params[1]])]
    with pytest.raises(
        ValueError,
        match=(
            r"^layouts\[0\] should be of the plan's parameters \(names and shapes\): "
            r"\('w', \(4, 6\)\) here, \('w', \(4, 7\)\) in the layout$"
        ),
    ):
        with_receiver_layouts(rank0_senders(plan), other)


# --- the wire -------------------------------------------------------------------------------


def test_a_layout_round_trips_through_json() -> None:
    plan = _plan()
    w, b = plan.params
    layout = ReceiverLayout.build(
        plan.params, {"b": range_box(b, 0, 4, 9), "w": shard_box(w, 1, size=3, rank=1)}
    )
    wire = json.loads(json.dumps(layout.to_wire()))
    assert wire == {"params": [["w", [0, 2], [4, 2]], ["b", [4], [2]]]}
    assert ReceiverLayout.from_wire(plan, wire) == layout
    shuffled = {"params": wire["params"][::-1]}  # by name, in any order
    assert ReceiverLayout.from_wire(plan, shuffled).digest == layout.digest


BAD_WIRE: list[tuple[Any, str]] = [
    ([1], r"^a receiver layout should be a dict, got list$"),
    (
        {"params": [["w", [0, 0], [4, 6]]] * 10**6},
        r"^receiver layout params should list the plan's 2 parameters, got 1000000$",
    ),
    ({}, r"^receiver layout params should list the plan's 2 parameters, got NoneType$"),
    (
        {"params": [["w", [0, 0], [4, 6]], ["x", [0], [6]]]},
        r"^the receiver layout names parameters the plan does not have: 'x'$",
    ),
    (
        {"params": [["w", [0, 0], [4, 6]], ["w", [0, 0], [4, 6]]]},
        r"^the receiver layout names parameter 'w' twice$",
    ),
    (
        {"params": [["w", [0, 0], [4, 6]], ["b", [0]]]},
        r"^a receiver layout entry should be \[name, start, size\], got \['b', \[0\]\]$",
    ),
    (
        {"params": [["w", [0] * 10**6, [4, 6]], ["b", [0], [6]]]},
        r"^parameter 'w': box start should be 2 ints \(shape \(4, 6\)\), got \[0, 0, 0, ",
    ),
    (
        {"params": [["w", [0, 0], [4, 6.0]], ["b", [0], [6]]]},
        r"^parameter 'w': box size should be a list of ints, got \[4, 6\.0\]$",
    ),
    (
        {"params": [["w", [0, 0], [4, 6]], ["b", [10**30], [6]]]},
        r"^parameter 'b': box should lie inside shape \(6,\), got \[10{30}, 10{29}6\) along dim 0",
    ),
]


@pytest.mark.parametrize(("data", "message"), BAD_WIRE)
def test_a_bad_declaration_is_refused_before_anything_is_built(data: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReceiverLayout.from_wire(_plan(), data)
