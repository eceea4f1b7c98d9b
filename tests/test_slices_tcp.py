"""Sliced receivers over tcp's star (issue 35): each worker process holds a
tensor-parallel rank's shards, declares them, and receives exactly their bytes."""

from __future__ import annotations

from pathlib import Path

import _dist
import _slice_models as sm
import _sliced_owners
import pytest
from _faults import info_for, worker_env

from asyncwt import (
    Chain,
    ControlPlaneError,
    Delta,
    HttpClient,
    ModuleSource,
    Star,
    TcpTrainerInitInfo,
    trainer_init,
)
from asyncwt._core.checksum import model_checksum
from asyncwt._worker.launch import worker_process

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])


def held_bytes(index: int, size: int) -> int:
    return sum(p.numel() * 4 for p in sm.rank(index, size).parameters())


@uvloop_only
@pytest.mark.slow
async def test_two_tp_ranks_each_receive_only_their_shards_round_after_round() -> None:
    model = sm.full(seed=1)
    env = worker_env()
    with (
        worker_process("_slice_models:rank0_of_2", env=env) as url0,
        worker_process("_slice_models:rank1_of_2", env=env) as url1,
    ):
        async with HttpClient([url0, url1], timeout=30) as client:
            info = info_for("tcp", fanout=Star(slices=True))
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                # The round plan records what each worker declared it needs (the
                # receivers in the order they connected).
                names = [m.name for m in engine.plan.params]
                needs = [
                    {n: (b.start, b.size) for n, b in zip(names, engine.round_plan.need(i))}
                    for i in (0, 1)
                ]
                assert sorted(needs, key=str) == sorted([sm.boxes(0, 2), sm.boxes(1, 2)], key=str)
                assert len(engine.round_plan.edges(2)) == 2
                for seed in (2, 3):
                    model = sm.full(seed)
                    engine.source = ModuleSource(model)
                    stats = await engine.send_weights(weight_version=f"v{seed}")
                    statuses = await client.weights_status(checksum=True)
                    for index, status in enumerate(statuses):
                        assert status["weight_version"] == f"v{seed}"
                        assert status["checksum"] == model_checksum(sm.shard_of(model, index, 2))
                    # Each worker got its shards' bytes and no more: on average, half
                    # of the sharded tensors and the replicated norm whole.
                    mean = (held_bytes(0, 2) + held_bytes(1, 2)) // 2
                    assert stats.wire_bytes == mean < stats.bytes


def test_slices_refuse_chain_by_construction_and_delta_naming_both_settings() -> None:
    with pytest.raises(TypeError):
        Chain(slices=True)  # type: ignore[call-arg]
    with pytest.raises(
        ValueError, match=r"^fanout=Star\(slices=True\) cannot be combined with delta="
    ):
        TcpTrainerInitInfo(rank=0, fanout=Star(slices=True), delta=Delta())
    with pytest.raises(ValueError, match="fanout.slices should be a bool"):
        Star(slices="yes")  # type: ignore[arg-type]


@uvloop_only
@pytest.mark.slow
async def test_a_worker_declaring_a_box_outside_a_parameter_fails_its_init_naming_it() -> None:
    model = sm.full(seed=1)
    with worker_process("_slice_models:past_the_edge", env=worker_env()) as url:
        async with HttpClient(url, timeout=30) as client:
            info = info_for("tcp", fanout=Star(slices=True))
            with pytest.raises(
                ControlPlaneError,
                match=r"parameter 'up.bias': box should lie inside shape \(128,\)",
            ):
                await trainer_init(info, client=client, source=ModuleSource(model))


@pytest.mark.slow
def test_two_owner_ranks_send_each_tp_worker_only_its_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """M:N: two FSDP-like owner ranks (each its `Shard(0)` rows) to two tensor-parallel
    workers: every worker holds exactly its shards after each round, and the ranks
    together send each worker the bytes of the boxes it declared, no more."""
    env = worker_env()
    with (
        worker_process("_slice_models:rank0_of_2", env=env) as url0,
        worker_process("_slice_models:rank1_of_2", env=env) as url1,
    ):
        monkeypatch.setenv("ASYNCWT_TEST_WORKERS", f"{url0},{url1}")
        ranks = _dist.run_ranks(_sliced_owners.sliced_owners, 2, tmp_path, timeout_s=120)
    for rank, record in enumerate(ranks):
        assert "error" not in record, f"rank {rank}:\n{record.get('error')}"
        assert len(record["rounds"]) == _sliced_owners.ROUNDS
    for r, row in enumerate(ranks[0]["rounds"], start=1):
        versions = [version for version, _ in row["workers"]]
        checksums = [checksum for _, checksum in row["workers"]]
        assert versions == [f"v{r}"] * 2
        assert checksums == row["expected"]
        # Both ranks send (each holds half of every parameter's rows); together, each
        # worker's bytes on average: the declared boxes' bytes.
        sent = [record["rounds"][r - 1]["wire_bytes"] for record in ranks]
        assert all(sent), sent
        assert sum(sent) == (held_bytes(0, 2) + held_bytes(1, 2)) // 2
    # Per worker, the pairs of both ranks carry exactly the bytes of its boxes.
    for index in (0, 1):
        key = str(sm.boxes(index, 2)["embed.weight"])
        assert sum(record["pairs"][key] for record in ranks) == held_bytes(index, 2)
