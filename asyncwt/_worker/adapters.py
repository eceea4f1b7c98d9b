"""Adapter rounds on the worker: collect a LoRA adapter's tensors, apply it to a model.

An adapter round (the trainer's source is an `AdapterSource`) does not write into
the model: its tensors are collected by an `AdapterCollector` (copies, never views of
receive buffers or of the sender's memory), and installed when the round is
published. asyncwt's own worker applies them with `LoraHooks`: each adapted linear
layer's output gains `scale * (x @ A.T) @ B.T`, which equals the layer with the
merged weight `W + scale * B @ A` (what PEFT's `merge_and_unload` computes). The base
weights stay as they are, so base rounds and adapter rounds interleave freely: the
adapter stays applied on top of whatever base was pushed last, and a new adapter
round replaces it. The vLLM plugin installs adapters with vLLM's LoRA manager
instead (see `asyncwt._vllm.adapters`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from .._core.adapter import AdapterConfig, adapter_module
from .._core.errors import PlanMismatchError
from .._core.plan import TransferPlan

__all__ = ["AdapterCollector", "LoraHooks", "adapter_pairs"]


class AdapterCollector(torch.nn.Module):
    """Where an adapter round lands: `load_weights` keeps a private copy of each tensor.

    A module with `load_weights` so that the applier hands it whole tensors by name,
    as it hands them to vLLM's models.
    """

    def __init__(self, plan: TransferPlan) -> None:
        super().__init__()
        self.names = frozenset(m.name for m in plan.params)
        self._tensors: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        copies = {name: tensor.detach().clone() for name, tensor in weights}
        with self._lock:
            self._tensors.update(copies)
        return set(copies)

    def take(self) -> dict[str, torch.Tensor]:
        """Every tensor of the round (and forget them); a missing one is a `ValueError`."""
        with self._lock:
            tensors, self._tensors = self._tensors, {}
        missing = sorted(self.names - tensors.keys())
        if missing:
            raise ValueError(f"the adapter round lacks {len(missing)} tensors: {missing[:5]}")
        return tensors


def adapter_pairs(
    names: Iterable[str],
) -> dict[str, tuple[str, str]]:
    """`{module path: (lora_A name, lora_B name)}` for PEFT-named adapter tensors; a name
    that is no LoRA weight, or a module lacking A or B, is a `PlanMismatchError`."""
    parts: dict[str, dict[str, str]] = {}
    for name in names:
        parsed = adapter_module(name)
        if parsed is None:
            raise PlanMismatchError(
                f"adapter tensor {name!r} should be named <module>.lora_A.weight or "
                f"<module>.lora_B.weight"
            )
        parts.setdefault(parsed[0], {})[parsed[1]] = name
    pairs = {}
    for module, found in parts.items():
        if set(found) != {"A", "B"}:
            raise PlanMismatchError(f"adapter module {module!r} should have lora_A and lora_B")
        pairs[module] = (found["A"], found["B"])
    return pairs


class LoraHooks:
    """A LoRA adapter applied to a plain torch model by forward hooks (see module doc)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.name: str | None = None
        """The adapter applied now (None: none)."""
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def check(self, plan: TransferPlan, config: AdapterConfig) -> None:
        """Fail (`PlanMismatchError`) before any byte moves when the adapter does not fit
        the model: a module it names is no linear layer of the model, or a shape
        disagrees with the layer and rank."""
        modules = dict(self.model.named_modules())
        metas = {m.name: m for m in plan.params}
        for module, (a_name, b_name) in adapter_pairs(metas).items():
            layer = modules.get(module)
            if not isinstance(layer, torch.nn.Linear):
                raise PlanMismatchError(
                    f"adapter module {module!r} should be a torch.nn.Linear of the worker's "
                    f"model, got {type(layer).__name__ if layer is not None else 'no such module'}"
                )
            want = {a_name: (config.r, layer.in_features), b_name: (layer.out_features, config.r)}
            for name, shape in want.items():
                if metas[name].shape != shape:
                    raise PlanMismatchError(
                        f"adapter tensor {name!r}: the worker's layer needs shape {shape} "
                        f"(rank {config.r}), the trainer sends {metas[name].shape}"
                    )

    def apply(self, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> None:
        """Apply the adapter in place of the current one."""
        modules = dict(self.model.named_modules())
        handles = []
        for module, (a_name, b_name) in adapter_pairs(tensors).items():
            layer = modules[module]
            weight = layer.weight
            a = tensors[a_name].to(weight.device, weight.dtype)
            b = (tensors[b_name] * config.scale).to(weight.device, weight.dtype)
            handles.append(layer.register_forward_hook(_lora_hook(a, b)))
        self.remove()
        self._handles = handles
        self.name = config.name

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.name = None


def _lora_hook(a: torch.Tensor, b: torch.Tensor) -> object:
    def hook(
        module: torch.nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor
    ) -> torch.Tensor:
        return out + (args[0] @ a.T) @ b.T

    return hook
