"""ModuleSource over DTensor and FSDP2 parameters, across two real processes on gloo.

One spawn runs every scenario in `_dist.SCENARIOS` on two ranks (a few seconds: two
fresh interpreters importing torch); each test below asserts on what the ranks recorded.
"""

from __future__ import annotations

from typing import Any

import _dist
import pytest
import torch

from asyncwt import ParamMeta, Replicate, Shard

WORLD_SIZE = 2


pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every scenario's record, per rank (index = rank)."""
    results: list[dict[str, Any]] = _dist.run_ranks(
        _dist.source_scenarios, WORLD_SIZE, tmp_path_factory.mktemp("dist"), timeout_s=60.0
    )
    return results


def _records(ranks: list[dict[str, Any]], scenario: str) -> list[dict[str, Any]]:
    records = [result[scenario] for result in ranks]
    for rank, record in enumerate(records):
        if "error" in record:
            pytest.fail(f"rank {rank} failed scenario {scenario!r}:\n{record['error']}")
    return records


def _expected_local(full: torch.Tensor, meta: ParamMeta, rank: int) -> torch.Tensor:
    """The piece `meta` says `rank` holds: torch.chunk per sharded mesh axis, outer first."""
    if meta.placements is None:
        return full
    assert meta.owners is not None and meta.mesh_shape is not None
    flat = meta.owners.index(rank)
    coord = []
    for size in reversed(meta.mesh_shape):
        coord.append(flat % size)
        flat //= size
    coord.reverse()
    piece = full
    for axis, placement in enumerate(meta.placements):
        if isinstance(placement, Shard):
            piece = torch.chunk(piece, meta.mesh_shape[axis], dim=placement.dim)[coord[axis]]
    return piece


def _by_name(pairs: list[tuple[str, str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: tensor for name, _, tensor in pairs}


def test_dtensor_source_metadata_on_1d_mesh(ranks: list[dict[str, Any]]) -> None:
    expected = [
        ParamMeta(
            "row", torch.float32, (5, 3), owners=(0, 1), mesh_shape=(2,), placements=(Shard(0),)
        ),
        ParamMeta(
            "col", torch.float32, (2, 5), owners=(0, 1), mesh_shape=(2,), placements=(Shard(1),)
        ),
        ParamMeta("rep", torch.float32, (4,), owners=(0, 1), mesh_shape=(2,)),
        ParamMeta("plain", torch.float32, (3,)),
        ParamMeta(
            "solo", torch.float32, (4, 2), owners=(0,), mesh_shape=(1,), placements=(Shard(0),)
        ),
        ParamMeta("partial", torch.float32, (2, 2), owners=(0, 1), mesh_shape=(2,)),
    ]

    for record in _records(ranks, "mesh_1d"):
        assert record["metadata"] == expected
        assert record["metadata_cached"]
        assert all(
            type(p) in (Shard, Replicate) for m in record["metadata"] for p in m.placements or ()
        )


def test_dtensor_source_metadata_is_identical_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    for scenario in _dist.SCENARIOS:
        rank0, rank1 = _records(ranks, scenario)
        assert rank0["metadata"] == rank1["metadata"]


def test_dtensor_source_iter_full_gathers_full_tensors_on_1d_mesh(
    ranks: list[dict[str, Any]],
) -> None:
    for record in _records(ranks, "mesh_1d"):
        reference = record["reference"]
        assert [name for name, _, _ in record["full"]] == record["owned"]
        for name, type_name, tensor in record["full"]:
            assert type_name == "Tensor", name
            assert tensor.shape == reference[name].shape, name
            assert torch.equal(tensor, reference[name]), name


def test_dtensor_source_iter_local_yields_torch_chunk_pieces_on_1d_mesh(
    ranks: list[dict[str, Any]],
) -> None:
    rank0, rank1 = _records(ranks, "mesh_1d")
    ref = rank0["reference"]
    local0, local1 = _by_name(rank0["local"]), _by_name(rank1["local"])

    assert torch.equal(local0["row"], ref["row"][:3])
    assert torch.equal(local1["row"], ref["row"][3:])
    assert torch.equal(local0["col"], ref["col"][:, :3])
    assert torch.equal(local1["col"], ref["col"][:, 3:])
    assert torch.equal(local0["rep"], ref["rep"])
    assert torch.equal(local1["rep"], ref["rep"])
    assert torch.equal(local0["plain"], ref["plain"])
    assert torch.equal(local1["plain"], ref["plain"])
    assert torch.equal(local0["solo"], ref["solo"])
    for rank, record in enumerate((rank0, rank1)):
        assert [name for name, _, _ in record["local"]] == record["owned"]
        assert all(type_name == "Tensor" for _, type_name, _ in record["local"])
        metas = {m.name: m for m in record["metadata"]}
        for name, _, tensor in record["local"]:
            assert torch.equal(tensor, _expected_local(ref[name], metas[name], rank)), name


def test_dtensor_source_rank_outside_a_parameters_mesh_skips_it(
    ranks: list[dict[str, Any]],
) -> None:
    rank0, rank1 = _records(ranks, "mesh_1d")
    everything = ["row", "col", "rep", "plain", "solo", "partial"]

    assert rank0["owned"] == everything
    assert rank1["owned"] == ["row", "col", "rep", "plain", "partial"]
    for record in (rank0, rank1):
        assert [name for name, _, _ in record["full"]] == record["owned"]
        assert [name for name, _, _ in record["local"]] == record["owned"]


def test_dtensor_source_partial_placement_is_declared_replicated_and_gathered(
    ranks: list[dict[str, Any]],
) -> None:
    summed = torch.full((2, 2), 3.0)  # rank 0 holds 1, rank 1 holds 2

    for record in _records(ranks, "mesh_1d"):
        (meta,) = [m for m in record["metadata"] if m.name == "partial"]
        assert meta.owners == (0, 1)
        assert meta.placements is None
        assert torch.equal(_by_name(record["full"])["partial"], summed)
        assert torch.equal(_by_name(record["local"])["partial"], summed)


def test_dtensor_source_metadata_on_2d_meshes(ranks: list[dict[str, Any]]) -> None:
    expected = [
        ParamMeta(
            "shard_shard",
            torch.float32,
            (4, 6),
            owners=(0, 1),
            mesh_shape=(2, 1),
            placements=(Shard(0), Shard(1)),
        ),
        ParamMeta(
            "replicate_shard",
            torch.float32,
            (5, 2),
            owners=(0, 1),
            mesh_shape=(1, 2),
            placements=(Replicate(), Shard(0)),
        ),
        ParamMeta(
            "shard_dim1_twice",
            torch.float32,
            (3, 7),
            owners=(0, 1),
            mesh_shape=(2, 1),
            placements=(Shard(1), Shard(1)),
        ),
        ParamMeta("replicate_replicate", torch.float32, (3,), owners=(0, 1), mesh_shape=(1, 2)),
    ]

    for record in _records(ranks, "mesh_2d"):
        assert record["metadata"] == expected


def test_dtensor_source_iter_full_gathers_full_tensors_on_2d_meshes(
    ranks: list[dict[str, Any]],
) -> None:
    for record in _records(ranks, "mesh_2d"):
        reference = record["reference"]
        assert [name for name, _, _ in record["full"]] == list(reference)
        for name, type_name, tensor in record["full"]:
            assert type_name == "Tensor", name
            assert torch.equal(tensor, reference[name]), name


def test_dtensor_source_iter_local_on_2d_meshes_follows_placements(
    ranks: list[dict[str, Any]],
) -> None:
    rank0, rank1 = _records(ranks, "mesh_2d")
    ref = rank0["reference"]
    local0, local1 = _by_name(rank0["local"]), _by_name(rank1["local"])

    assert torch.equal(local0["shard_shard"], ref["shard_shard"][:2])
    assert torch.equal(local1["shard_shard"], ref["shard_shard"][2:])
    assert torch.equal(local0["replicate_shard"], ref["replicate_shard"][:3])
    assert torch.equal(local1["replicate_shard"], ref["replicate_shard"][3:])
    assert torch.equal(local0["shard_dim1_twice"], ref["shard_dim1_twice"][:, :4])
    assert torch.equal(local1["shard_dim1_twice"], ref["shard_dim1_twice"][:, 4:])
    assert torch.equal(local0["replicate_replicate"], ref["replicate_replicate"])
    assert torch.equal(local1["replicate_replicate"], ref["replicate_replicate"])
    for rank, record in enumerate((rank0, rank1)):
        metas = {m.name: m for m in record["metadata"]}
        for name, _, tensor in record["local"]:
            assert torch.equal(tensor, _expected_local(ref[name], metas[name], rank)), name


def test_fsdp2_module_source_metadata_has_full_shapes(ranks: list[dict[str, Any]]) -> None:
    for record in _records(ranks, "fsdp2"):
        assert set(record["param_types"]) == {"DTensor"}
        reference = record["reference"]
        assert record["metadata"] == [
            ParamMeta(
                name,
                torch.float32,
                tuple(ref.shape),
                owners=(0, 1),
                mesh_shape=(2,),
                placements=(Shard(0),),
            )
            for name, ref in reference.items()
        ]
        assert [m.name for m in record["metadata"]] == [
            "0.weight",
            "0.bias",
            "2.weight",
            "2.bias",
            "3.weight",
            "3.bias",
        ]


def test_fsdp2_module_source_iter_full_equals_the_unsharded_reference(
    ranks: list[dict[str, Any]],
) -> None:
    for record in _records(ranks, "fsdp2"):
        reference = record["reference"]
        assert [name for name, _, _ in record["full"]] == list(reference)
        for name, type_name, tensor in record["full"]:
            assert type_name == "Tensor", name
            assert torch.equal(tensor, reference[name]), name


def test_fsdp2_module_source_iter_local_yields_dim0_chunks(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, record in enumerate(_records(ranks, "fsdp2")):
        reference = record["reference"]
        pieces = _by_name(record["local"])
        assert list(pieces) == list(reference)
        for name, ref in reference.items():
            expected = torch.chunk(ref, WORLD_SIZE, dim=0)[rank]
            assert torch.equal(pieces[name], expected), name
