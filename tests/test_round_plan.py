"""The round plan as data (`asyncwt._core.round_plan`): what each builder step produces,
its digest, and the combinations it refuses. In-process, no I/O: the fast tier."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncwt
from asyncwt._core.meta import ParamMeta, Shard
from asyncwt._core.owners import Box
from asyncwt._core.plan import TransferPlan
from asyncwt._core.round_plan import (
    BackendFeatures,
    Endpoint,
    RoundChoices,
    RoundPlan,
    build_round_plan,
    check_choices,
    dropping_workers,
    owner_senders,
    rank0_senders,
    via_chain,
    with_delta,
)

METAS = [
    ParamMeta("w", torch.float32, (4, 6), owners=(0, 1), placements=(Shard(0),)),
    ParamMeta("b", torch.bfloat16, (6,)),
    ParamMeta("s", torch.float32, ()),
]


def _plan(metas: list[ParamMeta] = METAS) -> TransferPlan:
    return TransferPlan.build(metas, bucket_bytes=64, alignment=16)


def _build(**choices: Any) -> RoundPlan:
    return build_round_plan(
        METAS,
        bucket_bytes=64,
        alignment=16,
        choices=RoundChoices(**choices),
        world_size=2,
    )


def test_rank0_senders_send_the_whole_plan_from_rank_0_straight_and_raw() -> None:
    plan = _plan()
    rp = rank0_senders(plan)
    assert (rp.senders, rp.route, rp.codec, rp.layout) == ("rank0", "star", "raw", None)
    assert rp.share(0) is plan and rp.share(1) is None
    assert rp.round_digest == plan.digest  # what rounds name on the wire, as before
    assert rp.receiver_plan is plan
    assert rp.total_bytes == plan.total_bytes
    whole = (Box((0, 0), (4, 6)), Box((0,), (6,)), Box((), ()))
    assert rp.need(0) == rp.need(7) == whole  # every receiver needs every parameter whole
    edges = rp.edges(3)
    assert [(e.source, e.target.index) for e in edges] == [
        (Endpoint(role="sender", index=0), i) for i in range(3)
    ]
    assert {e.admission.kind for e in edges} == {"init-token"}


def test_owner_senders_split_the_pieces_by_rank_and_name_the_layout() -> None:
    plan = _plan()
    rp = owner_senders(plan, world_size=2)
    assert rp.layout is not None and rp.senders == "owners"
    assert [s.rank for s in rp.shares] == [0, 1]
    assert rp.share(0) == rp.layout.share_plans[0] and rp.share(1) == rp.layout.share_plans[1]
    assert rp.round_digest == rp.layout.digest != plan.digest
    assert rp.receiver_plan.digest == rp.layout.digest
    assert rp.receiver_plan.buckets == plan.buckets
    assert rp.total_bytes == plan.total_bytes  # every byte once, from both ranks together
    edges = rp.edges(2)  # every owner rank straight to every receiver
    assert sorted((e.source.index, e.target.index) for e in edges) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
    ]


def test_chain_routes_through_predecessors_with_a_round_key_per_edge() -> None:
    rp = via_chain(rank0_senders(_plan()))
    assert rp.route == "chain"
    edges = rp.edges(3)
    assert [(e.source.role, e.source.index, e.target.index) for e in edges] == [
        ("sender", 0, 0),
        ("receiver", 0, 1),
        ("receiver", 1, 2),
    ]
    assert {e.admission.kind for e in edges} == {"round-edge-key"}
    assert rp.edges(0) == ()
    assert rp.round_digest == rp.plan.digest  # the wire's plan digest is the route's too


def test_delta_changes_only_the_codec() -> None:
    raw = rank0_senders(_plan())
    delta = with_delta(raw)
    assert delta.codec == "delta"
    assert dataclasses.replace(delta, codec="raw", digest=raw.digest) == raw


def test_build_round_plan_composes_the_steps() -> None:
    assert _build() == rank0_senders(_plan(), world_size=2)
    assert _build(route="chain") == via_chain(rank0_senders(_plan(), world_size=2))
    assert _build(codec="delta") == with_delta(rank0_senders(_plan(), world_size=2))
    assert _build(senders="owners") == owner_senders(_plan(), world_size=2)
    assert _build(on_worker_failure="drop") == dropping_workers(
        rank0_senders(_plan(), world_size=2)
    )


def test_the_digest_is_stable_and_sees_every_choice() -> None:
    assert _build().digest == _build().digest
    assert len(_build().digest) == 64
    plans = [
        _build(senders="rank0"),
        _build(senders="owners"),
        _build(route="chain"),
        _build(codec="delta"),
        _build(on_worker_failure="drop"),
        build_round_plan(
            METAS, bucket_bytes=128, alignment=16, choices=RoundChoices(), world_size=2
        ),
        build_round_plan(
            [*METAS[:2], ParamMeta("s", torch.float64, ())],
            bucket_bytes=64,
            alignment=16,
            choices=RoundChoices(),
            world_size=2,
        ),
    ]
    assert len({p.digest for p in plans}) == len(plans)


REFUSED = [
    (
        {"senders": "owners", "route": "chain"},
        "senders='owners' cannot be combined with fanout=Chain()",
    ),
    (
        {"senders": "owners", "codec": "delta"},
        "senders='owners' cannot be combined with delta=Delta()",
    ),
    (
        {"senders": "owners", "on_worker_failure": "drop"},
        "senders='owners' cannot be combined with on_worker_failure='drop'",
    ),
    ({"codec": "delta", "route": "chain"}, "delta=Delta() cannot be combined with fanout=Chain()"),
    (
        {"codec": "delta", "on_worker_failure": "drop"},
        "delta=Delta() cannot be combined with on_worker_failure='drop'",
    ),
]


@pytest.mark.parametrize(("choices", "message"), REFUSED)
def test_a_refused_pair_cannot_be_built_and_names_both_settings(
    choices: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        _build(**choices)


def test_refusal_holds_whichever_step_comes_last() -> None:
    owners = owner_senders(_plan(), world_size=2)
    with pytest.raises(ValueError, match="senders='owners' cannot be combined with fanout"):
        via_chain(owners)
    with pytest.raises(ValueError, match="senders='owners' cannot be combined with delta"):
        with_delta(owners)
    chain = via_chain(rank0_senders(_plan()))
    with pytest.raises(
        ValueError, match=re.escape("delta=Delta() cannot be combined with fanout=Chain()")
    ):
        with_delta(chain)
    with pytest.raises(
        ValueError, match=re.escape("delta=Delta() cannot be combined with on_worker_failure")
    ):
        dropping_workers(with_delta(rank0_senders(_plan())))
    with pytest.raises(
        ValueError, match=re.escape("senders='owners' cannot be combined with fanout=Chain()")
    ):
        dataclasses.replace(owners, route="chain")  # nor by hand


def test_every_combination_is_built_or_refused_in_one_place() -> None:
    """The 16 combinations of senders x topology x delta x on_worker_failure: each
    is either a plan carrying exactly its choices, or one `ValueError`."""
    built = refused = 0
    for senders, route, codec, failure in itertools.product(
        ("rank0", "owners"), ("star", "chain"), ("raw", "delta"), ("fail", "drop")
    ):
        choices = RoundChoices(
            senders=senders,  # type: ignore[arg-type]
            route=route,  # type: ignore[arg-type]
            codec=codec,  # type: ignore[arg-type]
            on_worker_failure=failure,  # type: ignore[arg-type]
        )
        try:
            rp = _build(**dataclasses.asdict(choices))
        except ValueError:
            refused += 1
            continue
        built += 1
        assert (rp.senders, rp.route, rp.codec, rp.on_worker_failure) == (
            senders,
            route,
            codec,
            failure,
        )
    assert (built, refused) == (6, 10)


def test_a_backend_refuses_what_it_cannot_run_naming_itself() -> None:
    plain = BackendFeatures()
    with pytest.raises(
        ValueError, match=r"^senders='owners' is supported by the tcp and shm backends, got "
    ):
        check_choices(RoundChoices(senders="owners"), plain, "torch_dist")
    with pytest.raises(
        ValueError,
        match=r"^delta should be False for the cuda_ipc backend \(delta rounds run on tcp "
        r"and shm\), got True$",
    ):
        check_choices(RoundChoices(codec="delta"), plain, "cuda_ipc")
    with pytest.raises(ValueError, match=r"^fanout should be Star\(\) for the shm backend"):
        check_choices(RoundChoices(route="chain"), plain, "shm")
    check_choices(RoundChoices(), plain, "torch_dist")  # the default plan runs everywhere


def test_the_settings_say_what_plan_they_choose() -> None:
    """Each backend's init info names its choices: the engines read those, no field."""
    assert asyncwt.TcpTrainerInitInfo(rank=0).round_choices() == RoundChoices()
    chosen = asyncwt.TcpTrainerInitInfo(rank=0, fanout=asyncwt.Chain()).round_choices()
    assert chosen == RoundChoices(route="chain")
    chosen = asyncwt.TcpTrainerInitInfo(rank=0, delta=True).round_choices()
    assert chosen == RoundChoices(codec="delta")
    chosen = asyncwt.ShmTrainerInitInfo(rank=0, senders="owners").round_choices()
    assert chosen == RoundChoices(senders="owners")


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 4),
    rows=st.integers(0, 9),
    cols=st.integers(1, 5),
    owners=st.integers(1, 4),
    dim=st.integers(0, 1),
)
def test_owner_plans_send_every_byte_once_whatever_the_layout(
    world: int, rows: int, cols: int, owners: int, dim: int
) -> None:
    owned = tuple(range(min(owners, world)))
    metas = [
        ParamMeta("w", torch.float32, (rows, cols), owners=owned, placements=(Shard(dim),)),
        ParamMeta("r", torch.float16, (cols,)),
    ]
    plan = TransferPlan.build(metas, bucket_bytes=64)
    rp = owner_senders(plan, world_size=world)
    assert rp.total_bytes == plan.total_bytes
    assert [s.rank for s in rp.shares] == list(range(world))
    assert owner_senders(plan, world_size=world).digest == rp.digest
    assert len(rp.edges(2)) == 2 * world
