"""ParamMeta: coercion, defaults and every validation rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncwt import ParamMeta, Replicate, Shard


def test_param_meta_plain_parameter_is_owned_by_every_rank() -> None:
    meta = ParamMeta("model.embed.weight", torch.bfloat16, (10, 4))

    assert meta.name == "model.embed.weight"
    assert meta.dtype is torch.bfloat16
    assert meta.shape == (10, 4)
    assert meta.owners is None
    assert meta.mesh_shape is None
    assert meta.placements is None


def test_param_meta_coerces_shape_to_tuple() -> None:
    from_list = ParamMeta("w", torch.float32, [3, 4])  # type: ignore[arg-type]
    from_size = ParamMeta("w", torch.float32, torch.Size([3, 4]))

    assert type(from_list.shape) is tuple
    assert from_list.shape == (3, 4)
    assert type(from_size.shape) is tuple
    assert from_size.shape == (3, 4)


def test_param_meta_coerces_owners_mesh_shape_and_placements_to_tuples() -> None:
    meta = ParamMeta(
        "w",
        torch.float32,
        (4, 6),
        owners=[2, 0, 3, 1],  # type: ignore[arg-type]
        mesh_shape=[2, 2],  # type: ignore[arg-type]
        placements=[Shard(0), Replicate()],  # type: ignore[arg-type]
    )

    assert meta.owners == (2, 0, 3, 1)
    assert type(meta.owners) is tuple
    assert meta.mesh_shape == (2, 2)
    assert type(meta.mesh_shape) is tuple
    assert meta.placements == (Shard(0), Replicate())
    assert type(meta.placements) is tuple


def test_param_meta_mesh_shape_defaults_to_one_axis_over_owners() -> None:
    meta = ParamMeta("w", torch.float32, (4,), owners=(1, 0, 2))

    assert meta.owners == (1, 0, 2)
    assert meta.mesh_shape == (3,)
    assert meta.placements is None


def test_param_meta_keeps_shard_placements() -> None:
    meta = ParamMeta("w", torch.float32, (4, 6), owners=(0, 1), placements=(Shard(1),))

    assert meta.mesh_shape == (2,)
    assert meta.placements == (Shard(1),)


def test_param_meta_normalises_all_replicate_placements_to_none() -> None:
    one_axis = ParamMeta("w", torch.float32, (4,), owners=(0, 1), placements=(Replicate(),))
    two_axes = ParamMeta(
        "w",
        torch.float32,
        (4,),
        owners=(0, 1, 2, 3),
        mesh_shape=(2, 2),
        placements=(Replicate(), Replicate()),
    )

    assert one_axis.placements is None
    assert two_axes.placements is None
    assert two_axes.mesh_shape == (2, 2)


def test_param_meta_equal_metadata_compares_equal() -> None:
    first = ParamMeta("w", torch.float16, [4, 6], owners=[0, 1], placements=[Shard(0)])  # type: ignore[arg-type]
    second = ParamMeta("w", torch.float16, (4, 6), owners=(0, 1), placements=(Shard(0),))

    assert first == second


def test_param_meta_is_frozen() -> None:
    meta = ParamMeta("w", torch.float32, (2,))

    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.name = "v"  # type: ignore[misc]


def test_param_meta_numel_and_nbytes_describe_the_full_tensor() -> None:
    meta = ParamMeta("w", torch.bfloat16, (3, 5), owners=(0, 1), placements=(Shard(0),))
    scalar = ParamMeta("s", torch.float64, ())

    assert meta.numel == 15
    assert meta.nbytes == 30
    assert scalar.numel == 1
    assert scalar.nbytes == 8


@pytest.mark.parametrize(
    ("mesh_shape", "placements", "pattern"),
    [
        (
            (2,),
            None,
            (
                r"^parameter 'w': mesh_shape and placements need owners, got owners=None "
                r"with mesh_shape=\(2,\), placements=None$"
            ),
        ),
        (
            None,
            (Shard(0),),
            (
                r"^parameter 'w': mesh_shape and placements need owners, got owners=None "
                r"with mesh_shape=None, placements=\(Shard\(dim=0\),\)$"
            ),
        ),
    ],
    ids=["mesh_shape", "placements"],
)
def test_param_meta_rejects_mesh_or_placements_without_owners(
    mesh_shape: tuple[int, ...] | None, placements: tuple[Shard, ...] | None, pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        ParamMeta("w", torch.float32, (4,), mesh_shape=mesh_shape, placements=placements)


@pytest.mark.parametrize(
    ("owners", "shown"),
    [
        ((0, 0), r"\(0, 0\)"),
        ((1, 2, 1), r"\(1, 2, 1\)"),
        ((0, -1), r"\(0, -1\)"),
        ((0, True), r"\(0, True\)"),
        ((False,), r"\(False,\)"),
        ((0, 1.0), r"\(0, 1\.0\)"),
        ((0, "1"), r"\(0, '1'\)"),
        ((), r"\(\)"),
        ([3, 3], r"\[3, 3\]"),
    ],
    ids=[
        "duplicate",
        "duplicate-later",
        "negative",
        "bool-true",
        "bool-false",
        "float",
        "str",
        "empty",
        "list-duplicate",
    ],
)
def test_param_meta_rejects_owners_that_are_not_distinct_non_negative_int_ranks(
    owners: tuple[object, ...], shown: str
) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^parameter 'w': owners should be distinct non-negative int ranks, got {shown}$",
    ):
        ParamMeta("w", torch.float32, (4,), owners=owners)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("owners", "mesh_shape", "shown"),
    [
        ((0, 1), (3,), r"\(3,\)"),
        ((0, 1, 2, 3), (2, 3), r"\(2, 3\)"),
        ((0, 1), (2, 0), r"\(2, 0\)"),
        ((0,), (0,), r"\(0,\)"),
        ((0, 1), (-1, -2), r"\(-1, -2\)"),
        ((0, 1), (True, 2), r"\(True, 2\)"),
        ((0, 1), (), r"\(\)"),
    ],
    ids=["too-big", "2d-too-big", "zero-axis", "zero", "negative", "bool", "empty"],
)
def test_param_meta_rejects_mesh_shape_that_does_not_cover_owners(
    owners: tuple[int, ...], mesh_shape: tuple[int, ...], shown: str
) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^parameter 'w': mesh_shape should cover its {len(owners)} owners, got {shown}$",
    ):
        ParamMeta("w", torch.float32, (4,), owners=owners, mesh_shape=mesh_shape)


def test_param_meta_accepts_a_one_rank_mesh() -> None:
    meta = ParamMeta(
        "w", torch.float32, (4,), owners=(5,), mesh_shape=(1, 1), placements=(Shard(0), Replicate())
    )

    assert meta.owners == (5,)
    assert meta.mesh_shape == (1, 1)
    assert meta.placements == (Shard(0), Replicate())


@pytest.mark.parametrize(
    ("mesh_shape", "placements", "axes", "count"),
    [
        ((2,), (Shard(0), Replicate()), 1, 2),
        ((2, 1), (Shard(0),), 2, 1),
        ((2,), (), 1, 0),
    ],
    ids=["too-many", "too-few", "none"],
)
def test_param_meta_requires_one_placement_per_mesh_axis(
    mesh_shape: tuple[int, ...], placements: tuple[Shard | Replicate, ...], axes: int, count: int
) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^parameter 'w': placements should have one entry per mesh axis \({axes}\), "
        rf"got {count}$",
    ):
        ParamMeta(
            "w", torch.float32, (4, 6), owners=(0, 1), mesh_shape=mesh_shape, placements=placements
        )


@pytest.mark.parametrize(
    ("shape", "dim", "pattern"),
    [
        ((4, 6), 2, r"^parameter 'w': Shard dim should be in \[0, 2\) for shape \(4, 6\), got 2$"),
        (
            (4, 6),
            -1,
            r"^parameter 'w': Shard dim should be in \[0, 2\) for shape \(4, 6\), got -1$",
        ),
        ((8,), 1, r"^parameter 'w': Shard dim should be in \[0, 1\) for shape \(8,\), got 1$"),
        ((), 0, r"^parameter 'w': Shard dim should be in \[0, 0\) for shape \(\), got 0$"),
    ],
    ids=["past-rank", "negative", "1d", "scalar"],
)
def test_param_meta_rejects_shard_dim_outside_tensor_rank(
    shape: tuple[int, ...], dim: int, pattern: str
) -> None:
    with pytest.raises(ValueError, match=pattern):
        ParamMeta("w", torch.float32, shape, owners=(0, 1), placements=(Shard(dim),))


def test_param_meta_checks_shard_dim_on_every_mesh_axis() -> None:
    with pytest.raises(
        ValueError,
        match=r"^parameter 'w': Shard dim should be in \[0, 2\) for shape \(4, 6\), got 3$",
    ):
        ParamMeta(
            "w",
            torch.float32,
            (4, 6),
            owners=(0, 1, 2, 3),
            mesh_shape=(2, 2),
            placements=(Shard(1), Shard(3)),
        )


@pytest.mark.parametrize(
    ("placement", "shown"),
    [
        ("shard0", r"'shard0'"),
        (0, r"0"),
        (None, r"None"),
    ],
    ids=["str", "int", "none"],
)
def test_param_meta_rejects_placement_that_is_neither_shard_nor_replicate(
    placement: object, shown: str
) -> None:
    with pytest.raises(
        TypeError,
        match=rf"^parameter 'w': placements should be Shard or Replicate, got {shown}$",
    ):
        ParamMeta(
            "w",
            torch.float32,
            (4,),
            owners=(0, 1),
            mesh_shape=(1, 2),
            placements=(Replicate(), placement),  # type: ignore[arg-type]
        )


@pytest.mark.slow
def test_param_meta_rejects_torch_placements_that_were_not_translated() -> None:
    from torch.distributed.tensor import Shard as TorchShard

    with pytest.raises(
        TypeError,
        match=r"^parameter 'w': placements should be Shard or Replicate, got Shard\(dim=0\)$",
    ):
        ParamMeta("w", torch.float32, (4,), owners=(0, 1), placements=(TorchShard(0),))  # type: ignore[arg-type]


def test_param_meta_error_messages_name_the_parameter() -> None:
    with pytest.raises(ValueError, match=r"^parameter 'model\.layers\.3\.mlp\.w1': "):
        ParamMeta("model.layers.3.mlp.w1", torch.float32, (4,), owners=(0, 0))
