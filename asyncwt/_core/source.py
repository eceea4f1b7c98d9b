"""Weight sources: the trainer's weights as metadata plus iteration modes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

import torch

from .layerwise import in_layer_stack
from .meta import ParamMeta, Placement, Replicate, Shard

__all__ = ["ModuleSource", "WeightSource", "materialize_full_tensor"]


def materialize_full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Return `tensor` whole and local, ready to send.

    A DTensor (FSDP2 shard) is gathered with `full_tensor()`, a collective among its
    mesh: every owner must call this in the same order. A plain tensor comes back as
    is. Reading `.shape`/`.dtype` never gathers; only this call does.
    """
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if callable(full_tensor) else tensor


class WeightSource(ABC):
    """The trainer's weights: `metadata` plus one or both iteration modes.

    - `metadata` declares every parameter of the whole model on every rank (see
      `ParamMeta`) and moves no data. It must be a `functools.cached_property`:
      engines read it repeatedly and plan from it, so it must not change.
    - `iter_full()` yields each parameter this rank owns as the full tensor.
    - `iter_local()` yields this rank's piece, shaped as `ParamMeta.placements` say.

    Both yield `(name, tensor)` for exactly `owned_names(rank)`, in metadata order,
    and may run collectives among a parameter's owners; because every owner walks the
    same order, those collectives line up. Each call starts a new pass. Nothing is
    derived from one mode to the other: a source implements the modes it can.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        metadata = cls.__dict__.get("metadata")
        if metadata is not None and not isinstance(metadata, cached_property):
            raise TypeError(
                f"{cls.__name__}.metadata should be a functools.cached_property "
                f"(engines read it repeatedly and it must not change), "
                f"got {type(metadata).__name__}"
            )

    @property
    @abstractmethod
    def metadata(self) -> list[ParamMeta]:
        """Every parameter of the model, identical on every rank; moves no data."""

    def owned_names(self, rank: int) -> list[str]:
        """The names `rank` owns, in metadata order: exactly what it iterates."""
        return [m.name for m in self.metadata if m.owners is None or rank in m.owners]

    def device(self) -> torch.device | None:
        """The device this rank's tensors live on, or `None` if the source cannot say.

        Engines stage on it when no device is configured (see `resolve_device`);
        an asyncwt extension of the interface, with a default every source has.
        """
        return None

    def adapter_config(self) -> dict[str, Any] | None:
        """The LoRA adapter these tensors are (`AdapterConfig.to_wire()`), or `None` for
        model weights; workers receive it at init. An asyncwt extension of the
        interface (see `AdapterSource`)."""
        return None

    def implements_iter_full(self) -> bool:
        """Whether this source overrides `iter_full`."""
        return type(self).iter_full is not WeightSource.iter_full

    def implements_iter_local(self) -> bool:
        """Whether this source overrides `iter_local`."""
        return type(self).iter_local is not WeightSource.iter_local

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, full tensor)` for each name this rank owns."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_full")

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield `(name, local piece)` for each name this rank owns."""
        raise NotImplementedError(f"{type(self).__name__} does not implement iter_local")


_Layout = tuple[tuple[int, ...], tuple[int, ...], "tuple[Placement, ...] | None"]


def _dtensor_layout(param: torch.Tensor) -> _Layout | None:
    """`(owners, mesh_shape, placements)` of a DTensor, `None` for a plain tensor.

    Placements are `None` when any of them is not a plain Shard/Replicate (Partial,
    strided shards of FSDP+TP): such a parameter is declared replicated.
    """
    mesh = getattr(param, "device_mesh", None)
    if mesh is None:
        return None
    from torch.distributed.tensor import Replicate as TorchReplicate
    from torch.distributed.tensor import Shard as TorchShard

    grid = mesh.mesh
    owners = tuple(int(r) for r in grid.flatten().tolist())
    mesh_shape = tuple(int(d) for d in grid.shape)
    placements: list[Placement] = []
    for placement in param.placements:  # type: ignore[attr-defined]
        if type(placement) is TorchShard:
            placements.append(Shard(placement.dim))
        elif type(placement) is TorchReplicate:
            placements.append(Replicate())
        else:
            return owners, mesh_shape, None
    return owners, mesh_shape, tuple(placements)


def _is_member(param: torch.Tensor) -> bool:
    """Whether this process holds a piece of `param` (always, for a plain tensor)."""
    mesh = getattr(param, "device_mesh", None)
    return mesh is None or mesh.get_coordinate() is not None


_COMPILED_PREFIX = "_orig_mod."


def _uncompiled(name: str) -> str:
    """`name` without the `_orig_mod.` segments `torch.compile` adds (the compiled
    module's own parameters are its original module's, one level down)."""
    if _COMPILED_PREFIX not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


class ModuleSource(WeightSource):
    """A `WeightSource` over `module.named_parameters()`: plain, FSDP2 or DTensor.

    A plain tensor is owned by every rank. A DTensor is owned by the global ranks of
    its device mesh, with the mesh's shape and its placements; `iter_full` gathers it
    (`full_tensor()`, a collective), `iter_local` yields `to_local()`, except for
    placements other than plain Shard/Replicate, which are declared replicated and
    gathered. Ranks outside a parameter's mesh skip it. `metadata` reads global
    shapes, never gathers, and is cached on first read: shard the module first.
    Mesh ranks are global ranks of the default group, so they must equal the
    trainer ranks given in `TrainerInitInfo.rank`.

    Order: with `layers_last` (the default), the parameters outside the repeated
    layers (embeddings, final norm, LM head: the largest tensors of a language
    model) come first, then the layers' parameters, each part in registration
    order. A round cannot end before the last-gathered tensor is sent, so ending on
    one layer's tensors instead of a vocabulary-sized LM head shortens what no
    pipeline can hide.
    `layers_last=False` keeps `named_parameters()` order.

    Names: a `torch.compile`d module (or one with compiled submodules) is read through
    to the module it wraps, so the names are the model's own, without `_orig_mod.`.
    `rename` maps each name to the one the workers' model uses, or to None to leave
    the parameter out (a frozen tower, a head the rollout model lacks):

        ModuleSource(model, rename=lambda name: name.removeprefix("policy."))
        ModuleSource(model, rename=lambda name: None if "lora_" in name else name)

    It runs once per parameter on every pass, so it must be a pure function.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        layers_last: bool = True,
        rename: Callable[[str], str | None] | None = None,
    ) -> None:
        if rename is not None and not callable(rename):
            raise ValueError(f"rename should be a callable or None, got {type(rename).__name__}")
        self._module = module
        self.layers_last = layers_last
        self.rename = rename

    def _parameters(self) -> list[tuple[str, torch.Tensor]]:
        """`named_parameters()` renamed, in this source's order (read anew on every pass)."""
        named: list[tuple[str, torch.Tensor]] = []
        seen: dict[str, str] = {}
        for original, param in self._module.named_parameters():
            name = _uncompiled(original)
            if self.rename is not None:
                renamed = self.rename(name)
                if renamed is None:
                    continue
                if not isinstance(renamed, str) or not renamed:
                    raise ValueError(
                        f"rename should return a non-empty str or None, got {renamed!r} for "
                        f"{original!r}"
                    )
                name = renamed
            if name in seen:
                raise ValueError(
                    f"rename maps both {seen[name]!r} and {original!r} to {name!r}; "
                    "names should stay unique"
                )
            seen[name] = original
            named.append((name, param))
        if self.layers_last:
            named.sort(key=lambda item: in_layer_stack(item[0]))  # stable: False first
        return named

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        metas = []
        for name, param in self._parameters():
            layout = _dtensor_layout(param)
            if layout is None:
                metas.append(ParamMeta(name, param.dtype, tuple(param.shape)))
            else:
                owners, mesh_shape, placements = layout
                metas.append(
                    ParamMeta(
                        name,
                        param.dtype,
                        tuple(param.shape),
                        owners=owners,
                        mesh_shape=mesh_shape,
                        placements=placements,
                    )
                )
        return metas

    def device(self) -> torch.device | None:
        """The device of the module's first parameter (None for a module without any)."""
        first = next(iter(self._module.parameters()), None)
        return None if first is None else first.device

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._parameters():
            if _is_member(param):
                yield name, materialize_full_tensor(param.detach())

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._parameters():
            if not _is_member(param):
                continue
            layout = _dtensor_layout(param)
            if layout is None:
                yield name, param.detach()
            elif layout[2] is None:
                yield name, materialize_full_tensor(param.detach())
            else:
                yield name, param.detach().to_local()  # type: ignore[attr-defined]
