"""Owner senders (`senders="owners"`): every trainer rank sends its own shards.

Multi-process (gloo) ends compare the workers' weights bit for bit with the
gathered full tensors and with a worker fed by the gathered path, for FSDP2,
tensor-parallel (Shard(1), Shard(0), uneven), replicated and 2-D mesh layouts,
over two rounds; and prove the owners engine never gathers. The layout itself
(which rank sends which bytes) is checked in-process against DTensor's own split.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import _dist
import _owners_ranks
import pytest
import torch

from asyncwt._core.meta import ParamMeta, Replicate, Shard
from asyncwt._core.owners import OwnersLayout, full_slices
from asyncwt._core.plan import TransferPlan


def _run(tmp_path: Path, world: int, monkeypatch: pytest.MonkeyPatch, **env: str) -> list[Any]:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return _dist.run_ranks(_owners_ranks.owners_scenarios, world, tmp_path, timeout_s=120)


def _check(results: list[Any], name: str, world: int) -> None:
    per_rank = [r[name] for r in results]
    for rank, record in enumerate(per_rank):
        assert "error" not in record, f"rank {rank}:\n{record.get('error')}"
        assert record["gather_calls"] == [], f"rank {rank} gathered: {record['gather_calls']}"
        assert record["receive_threads_left"] == []
    rounds = per_rank[0]["rounds"]
    assert len(rounds) == _owners_ranks.ROUNDS
    for r, row in enumerate(rounds, start=1):
        for exact in row["owners_exact"] + row["gathered_exact"]:
            assert all(exact.values()), f"round {r}: not bit-exact: {exact}"
        assert row["versions"] == [f"v{r}"] * 2
        shares = [rec["rounds"][r - 1]["bytes"] for rec in per_rank]
        assert sum(shares) == row["total"] == row["full_bytes"], (shares, row)
        assert all(rec["rounds"][r - 1]["total"] == row["total"] for rec in per_rank)
        assert sum(1 for s in shares if s) > 1, f"only one rank sent: {shares}"


@pytest.mark.parametrize(
    ("world", "scenarios"),
    [(2, ["fsdp2", "tensor_parallel"]), (4, ["fsdp2", "tensor_parallel", "mesh_2d"])],
)
@pytest.mark.slow
def test_owner_senders_are_bit_exact_and_never_gather(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int, scenarios: list[str]
) -> None:
    results = _run(
        tmp_path,
        world,
        monkeypatch,
        ASYNCWT_TEST_BACKEND="tcp",
        ASYNCWT_TEST_SCENARIOS=",".join(scenarios),
    )
    for name in scenarios:
        _check(results, name, world)


@pytest.mark.slow
def test_owner_senders_over_shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = _run(
        tmp_path,
        2,
        monkeypatch,
        ASYNCWT_TEST_BACKEND="shm",
        ASYNCWT_TEST_SCENARIOS="tensor_parallel",
    )
    for name in ("tensor_parallel",):
        _check(results, name, 2)


# --- the layout, in-process ---------------------------------------------------------------


def _reassemble(layout: OwnersLayout, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a worker builds from every rank's share buckets (packed as a trainer packs)."""
    params = layout.plan.params
    out = {m.name: torch.zeros(m.shape, dtype=m.dtype) for m in params}
    for rank, share in enumerate(layout.share_plans):
        pieces = layout.pieces[rank]
        for bucket in share.buckets:
            buffer = torch.zeros(bucket.buffer_bytes, dtype=torch.uint8)
            for s in bucket.slices:
                piece = pieces[s.param]
                whole = full[params[piece.param].name]
                box = tuple(slice(a, a + n) for a, n in zip(piece.box.start, piece.box.size))
                data = whole[box].contiguous().reshape(-1).view(torch.uint8)
                buffer[s.offset : s.offset + s.nbytes] = data[s.start : s.end]
                for f in full_slices(piece, params[piece.param], s, piece.param):
                    target = out[params[f.param].name].reshape(-1).view(torch.uint8)
                    target[f.start : f.end] = buffer[f.offset : f.offset + f.nbytes]
    return out


def test_layout_sends_every_byte_once_and_spreads_replicas() -> None:
    metas = [
        ParamMeta("slab", torch.float32, (5, 3), owners=(0, 1), placements=(Shard(0),)),
        ParamMeta("cols", torch.bfloat16, (2, 5), owners=(0, 1), placements=(Shard(1),)),
        ParamMeta("plain", torch.float32, (8,)),
        ParamMeta("scalar", torch.float32, ()),
        ParamMeta("empty", torch.float32, (0, 4)),
        ParamMeta(
            "hsdp",
            torch.float32,
            (4, 6),
            owners=(0, 1, 2, 3),
            mesh_shape=(2, 2),
            placements=(Replicate(), Shard(1)),
        ),
        ParamMeta("tiny", torch.float32, (3,), owners=(0, 1, 2, 3), placements=(Shard(0),)),
    ]
    plan = TransferPlan.build(metas, bucket_bytes=64)
    layout = OwnersLayout.build(plan, 4)
    torch.manual_seed(0)
    full = {m.name: torch.randn(m.shape).to(m.dtype) for m in metas}
    out = _reassemble(layout, full)
    assert all(torch.equal(full[k], out[k]) for k in full)
    assert layout.total_bytes == sum(m.nbytes for m in metas)  # every byte exactly once
    sent = [sum(p.box.numel for p in layout.pieces[r] if p.param == 2) for r in range(4)]
    assert sent == [2, 2, 2, 2]  # the plain tensor: a quarter from each rank
    assert [p.rank for p in layout.pieces[0] + layout.pieces[1] if p.param == 3] == [0]
    # 'tiny' (3 rows on 4 ranks): rank 3's shard is empty, as torch.chunk leaves it
    assert layout.local[3][6].size == (0,)


def test_layout_digest_covers_ownership_and_wire_round_trips() -> None:
    sharded = ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), placements=(Shard(0),))
    other = ParamMeta("w", torch.float32, (4, 4), owners=(0, 1), placements=(Shard(1),))
    a = OwnersLayout.build(TransferPlan.build([sharded]), 2)
    b = OwnersLayout.build(TransferPlan.build([other]), 2)
    assert a.plan.digest == b.plan.digest  # the full plan does not see ownership
    assert a.digest != b.digest  # the layout's digest does
    bare = TransferPlan.build([ParamMeta("w", torch.float32, (4, 4))])
    assert OwnersLayout.from_wire(bare, a.to_wire()).digest == a.digest
    tampered = a.to_wire()
    tampered["params"][0][2] = [["s", 1]]
    with pytest.raises(ValueError, match="digest"):
        OwnersLayout.from_wire(bare, tampered)
    with pytest.raises(ValueError, match="placement"):
        OwnersLayout.from_wire(bare, {**a.to_wire(), "params": [[[0, 1], [2], ["x"]]]})
    with pytest.raises(ValueError, match="world_size"):
        OwnersLayout.from_wire(bare, {**a.to_wire(), "world_size": 10**9})


@pytest.mark.slow
def test_a_rank_whose_shard_disagrees_fails_the_round_and_nothing_is_published(
    tmp_path: Path,
) -> None:
    rank0, rank1 = _dist.run_ranks(_owners_ranks.failing_share, 2, tmp_path, timeout_s=120)
    first, failed, recovered = rank0["rounds"]
    assert first["error"] is None and first["version"] == "v1"
    assert rank1["rounds"][0]["error"] is None
    why = rank1["rounds"][1]["error"]
    assert why is not None and "'2.weight'" in why and "rank 1" in why, why
    assert failed["error"] is not None  # rank 0 learns it from the workers
    assert failed["version"] == "v1"  # nothing published
    assert recovered["error"] is None and rank1["rounds"][2]["error"] is None
    assert recovered["version"] == "v3" and all(recovered["exact"].values())


def test_share_source_names_the_parameter_and_rank_of_a_bad_shard() -> None:
    from asyncwt import WeightSource
    from asyncwt._core.errors import SourceMismatchError
    from asyncwt._trainer.owners import ShareSource

    meta = ParamMeta("w", torch.float32, (5, 2), owners=(0, 1), placements=(Shard(0),))
    layout = OwnersLayout.build(TransferPlan.build([meta]), 2)

    class Local(WeightSource):
        @functools.cached_property
        def metadata(self) -> list[ParamMeta]:
            return [meta]

        def __init__(self, rows: int) -> None:
            self.rows = rows

        def iter_local(self) -> Any:
            yield "w", torch.zeros(self.rows, 2)

    good = list(ShareSource(Local(2), layout, 1).iter_full())
    assert [(n, tuple(t.shape)) for n, t in good] == [("w", (2, 2))]
    with pytest.raises(SourceMismatchError, match=r"'w' on rank 1.*\(3, 2\).*\(2, 2\)"):
        list(ShareSource(Local(3), layout, 1).iter_full())


@pytest.mark.slow
def test_an_init_failure_on_one_rank_fails_every_rank_without_hanging(tmp_path: Path) -> None:
    rank0, rank1 = _dist.run_ranks(_owners_ranks.init_fails_on_one_rank, 2, tmp_path)
    assert rank1["error"] is not None and "Address already in use" in rank1["error"]
    assert rank0["error"] is not None and "rank 1" in rank0["error"], rank0["error"]


def test_a_worker_refuses_a_malformed_owner_layout_before_connecting() -> None:
    import asyncwt

    meta = ParamMeta("w", torch.float32, (4, 2), owners=(0, 1), placements=(Shard(0),))
    layout = OwnersLayout.build(TransferPlan.build([meta]), 2)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(4, 2))
    engine = asyncwt.create_worker_engine(asyncwt.WeightTransferConfig(backend="tcp"), model=model)
    bare = TransferPlan.build([ParamMeta("w", torch.float32, (4, 2))])
    # Port 9 (discard) on loopback: nothing listens, so a connect attempt would fail loudly.
    endpoint = {"host": "127.0.0.1", "port": 9, "token": "t" * 32}
    good = {**layout.to_wire(), "senders": [endpoint, endpoint]}

    def init(owners: object) -> None:
        info = engine.parse_init_info({**endpoint, "plan": bare.to_wire(), "owners": owners})
        engine.init_transfer_engine(info)

    with pytest.raises(ValueError, match="digest"):
        init({**good, "digest": "0" * 64})
    with pytest.raises(ValueError, match="senders should list the 2"):
        init({**good, "senders": [endpoint]})
    with pytest.raises(ValueError, match=r"senders\[1\] should be a dict"):
        init({**good, "senders": [endpoint, {**endpoint, "plan": bare.to_wire()}]})
    with pytest.raises(ValueError, match="owners should be a dict"):
        init([1, 2])
    assert engine.receiver is None  # nothing was connected
    engine.shutdown()


@pytest.mark.asyncio
async def test_owner_senders_refuse_other_backends_topologies_and_sources() -> None:
    import asyncwt
    from asyncwt import trainer_init

    source = asyncwt.ModuleSource(torch.nn.Linear(2, 2))
    client = _owners_ranks._NoClient()
    with pytest.raises(TypeError, match="unexpected keyword argument 'senders'"):
        asyncwt.TorchDistTrainerInitInfo(rank=0, senders="owners")  # type: ignore[call-arg]
    with pytest.raises(
        ValueError, match=r"^senders='owners' cannot be combined with fanout=Chain\(\): "
    ):
        asyncwt.TcpTrainerInitInfo(rank=0, senders="owners", fanout=asyncwt.Chain())
    with pytest.raises(ValueError, match="torch.distributed initialised"):
        await trainer_init(
            asyncwt.TcpTrainerInitInfo(rank=0, senders="owners"), client=client, source=source
        )
    with pytest.raises(
        ValueError, match=r"^senders should be one of \['rank0', 'owners'\], got 'all'$"
    ):
        asyncwt.TcpTrainerInitInfo(rank=0, senders="all")
    with pytest.raises(
        ValueError, match=r"^senders='owners' cannot be combined with delta=Delta\("
    ):
        asyncwt.TcpTrainerInitInfo(rank=0, senders="owners", delta=True)
