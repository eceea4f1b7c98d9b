"""Parameter metadata: what every rank and worker agrees on before a byte moves."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeAlias

import torch

__all__ = ["ParamMeta", "Placement", "Replicate", "Shard"]


@dataclass(frozen=True)
class Replicate:
    """Along this mesh axis every coordinate holds the parameter's whole extent."""


@dataclass(frozen=True)
class Shard:
    """Along this mesh axis tensor dim `dim` is split as `torch.chunk` splits it."""

    dim: int


Placement: TypeAlias = Shard | Replicate


def _is_rank(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class ParamMeta:
    """One parameter as it travels: name, wire dtype, full shape, and ownership.

    The same list of `ParamMeta` is built on every trainer rank (ownership included),
    so every rank and every worker derives the same transfer plan without exchanging
    anything at run time.

    Attributes:
        name: The parameter's name as the worker's model knows it.
        dtype: The dtype on the wire.
        shape: The full (unsharded) shape; any sequence is stored as a tuple.
        owners: Global trainer ranks holding the parameter, in mesh order; `None`
            means every rank.
        mesh_shape: Row-major shape of the mesh laid over `owners`; defaults to
            `(len(owners),)`.
        placements: One `Shard` or `Replicate` per mesh axis, describing what
            `iter_local` yields on each owner (outer mesh axis first when two axes
            shard one dim). `None` means replicated; all-`Replicate` becomes `None`.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    owners: tuple[int, ...] | None = field(default=None, kw_only=True)
    mesh_shape: tuple[int, ...] | None = field(default=None, kw_only=True)
    placements: tuple[Placement, ...] | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.owners is None:
            if self.mesh_shape is not None or self.placements is not None:
                raise ValueError(
                    f"parameter {self.name!r}: mesh_shape and placements need owners, "
                    f"got owners=None with mesh_shape={self.mesh_shape!r}, "
                    f"placements={self.placements!r}"
                )
            return
        owners = tuple(self.owners)
        if not owners or not all(_is_rank(r) for r in owners) or len(set(owners)) != len(owners):
            raise ValueError(
                f"parameter {self.name!r}: owners should be distinct non-negative int "
                f"ranks, got {self.owners!r}"
            )
        mesh_shape = (len(owners),) if self.mesh_shape is None else tuple(self.mesh_shape)
        if any(not _is_rank(d) or d == 0 for d in mesh_shape) or math.prod(mesh_shape) != len(
            owners
        ):
            raise ValueError(
                f"parameter {self.name!r}: mesh_shape should cover its {len(owners)} "
                f"owners, got {mesh_shape!r}"
            )
        placements = None if self.placements is None else tuple(self.placements)
        if placements is not None:
            if len(placements) != len(mesh_shape):
                raise ValueError(
                    f"parameter {self.name!r}: placements should have one entry per mesh "
                    f"axis ({len(mesh_shape)}), got {len(placements)}"
                )
            for placement in placements:
                if isinstance(placement, Shard):
                    if not 0 <= placement.dim < len(self.shape):
                        raise ValueError(
                            f"parameter {self.name!r}: Shard dim should be in "
                            f"[0, {len(self.shape)}) for shape {self.shape}, "
                            f"got {placement.dim}"
                        )
                elif not isinstance(placement, Replicate):
                    raise TypeError(
                        f"parameter {self.name!r}: placements should be Shard or "
                        f"Replicate, got {placement!r}"
                    )
            if all(isinstance(p, Replicate) for p in placements):
                placements = None
        object.__setattr__(self, "owners", owners)
        object.__setattr__(self, "mesh_shape", mesh_shape)
        object.__setattr__(self, "placements", placements)

    @property
    def numel(self) -> int:
        """Number of elements of the full tensor."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor on the wire."""
        return self.numel * self.dtype.itemsize
