"""Adapter-only rounds: a PEFT LoRA adapter's tensors as a `WeightSource`.

RL with LoRA trains a few megabytes on top of a frozen base: `AdapterSource` sends
those tensors only, named as PEFT saves them (`base_model.model.<module>.lora_A.weight`,
which vLLM's LoRA loader reads too), and the adapter's config (`AdapterConfig`) travels
in the workers' init info. A worker installs the adapter in memory when the round is
published: asyncwt's own worker applies it on top of its model's linear layers (see
`asyncwt._worker.adapters`), the vLLM plugin registers it with vLLM's LoRA manager
under `name` (see `asyncwt._vllm.adapters`).

Nothing here imports peft: a peft model is read through `peft_config` and
`named_parameters()`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import torch

from .meta import ParamMeta
from .source import WeightSource
from .validate import check_str

__all__ = ["AdapterConfig", "AdapterSource", "adapter_module", "parse_adapter_config"]

_LORA_SUFFIX = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
MAX_TARGET_MODULES = 4096


@dataclass(frozen=True)
class AdapterConfig:
    """What a worker needs besides the tensors to apply a LoRA adapter."""

    name: str
    """The adapter's name: what vLLM serves it as (`model=<name>`)."""
    r: int
    """The rank (rows of `lora_A`)."""
    lora_alpha: float
    """The scale's numerator: `lora_alpha / r` (or `/ sqrt(r)` with `use_rslora`)."""
    target_modules: tuple[str, ...]
    """The modules adapted, as PEFT names them (`q_proj`, `v_proj`, ...)."""
    use_rslora: bool = False

    def __post_init__(self) -> None:
        check_str("adapter name", self.name, max_chars=256)
        if not self.name:
            raise ValueError("adapter name should be a non-empty str, got ''")
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"adapter r should be a positive int, got {self.r!r}")
        alpha = self.lora_alpha
        if (
            isinstance(alpha, bool)
            or not isinstance(alpha, (int, float))
            or not math.isfinite(alpha)
        ):
            raise ValueError(f"adapter lora_alpha should be a finite number, got {alpha!r}")
        if (
            not isinstance(self.target_modules, (tuple, list))
            or len(self.target_modules) > MAX_TARGET_MODULES
            or not all(isinstance(m, str) and m for m in self.target_modules)
        ):
            raise ValueError(
                f"adapter target_modules should be a list of at most {MAX_TARGET_MODULES} "
                f"non-empty str, got {self.target_modules!r}"
            )
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if not isinstance(self.use_rslora, bool):
            raise ValueError(f"adapter use_rslora should be a bool, got {self.use_rslora!r}")

    @property
    def scale(self) -> float:
        """The factor of `B @ A` in the adapted weight `W + scale * B @ A`."""
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_wire(self) -> dict[str, Any]:
        """JSON-safe form, for the workers' init info."""
        wire = asdict(self)
        wire["target_modules"] = list(self.target_modules)
        return wire

    def peft_config(self) -> dict[str, Any]:
        """The adapter config as PEFT writes `adapter_config.json` (what vLLM reads)."""
        return {
            "peft_type": "LORA",
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "target_modules": list(self.target_modules),
            "use_rslora": self.use_rslora,
            "bias": "none",
            "lora_dropout": 0.0,
        }


def parse_adapter_config(wire: object) -> AdapterConfig:
    """An `AdapterConfig` from its wire form; a bad one is a `ValueError` naming the field."""
    if not isinstance(wire, dict):
        raise ValueError(f"adapter should be a dict, got {type(wire).__name__}")
    try:
        return AdapterConfig(**wire)
    except TypeError as exc:
        raise ValueError(f"adapter: {exc}") from exc


def adapter_module(name: str) -> tuple[str, str] | None:
    """`(module path, "A" | "B")` of a tensor named as PEFT saves it, without PEFT's
    `base_model.model.` prefix; None for any other name."""
    match = _LORA_SUFFIX.match(name)
    if match is None:
        return None
    return match["module"].removeprefix("base_model.model."), match["part"]


class AdapterSource(WeightSource):
    """A PEFT model's LoRA adapter `name` as a `WeightSource`: only its tensors travel.

        source = asyncwt.AdapterSource(peft_model, name="policy")
        engine = await asyncwt.trainer_init(TcpTrainerInitInfo(rank=0), client=..., source=source)
        await engine.send_weights()   # vLLM then serves model="policy" with these tensors

    Yields every `lora_A`/`lora_B` weight of PEFT adapter `adapter` ("default" unless
    given), named as PEFT saves it (`base_model.model.<module>.lora_A.weight`). `name`
    is what the workers serve it as. The adapter's rank, alpha and target modules are
    read from `peft_model.peft_config[adapter]` and sent to the workers at init.
    Only LoRA adapters without trained biases or DoRA are supported. The tensors are
    read anew on every round; the workers copy them (the trainer may keep training).
    """

    def __init__(self, peft_model: torch.nn.Module, *, name: str, adapter: str = "default") -> None:
        check_str("name", name, max_chars=256)
        configs = getattr(peft_model, "peft_config", None)
        if not isinstance(configs, dict) or adapter not in configs:
            raise ValueError(
                f"peft_model should be a PEFT model with adapter {adapter!r} in its peft_config, "
                f"got {type(peft_model).__name__} with adapters "
                f"{sorted(configs) if isinstance(configs, dict) else None}"
            )
        peft = configs[adapter]
        if str(getattr(peft, "peft_type", "LORA")).split(".")[-1].upper() != "LORA":
            raise ValueError(f"adapter {adapter!r} should be a LoRA adapter, got {peft.peft_type}")
        if getattr(peft, "use_dora", False) or getattr(peft, "bias", "none") != "none":
            raise ValueError(
                f"adapter {adapter!r}: DoRA and trained biases are not supported "
                f"(use_dora={getattr(peft, 'use_dora', False)}, bias={peft.bias!r})"
            )
        targets = peft.target_modules
        self.config = AdapterConfig(
            name=name,
            r=int(peft.r),
            lora_alpha=float(peft.lora_alpha),
            target_modules=tuple(sorted([targets] if isinstance(targets, str) else targets)),
            use_rslora=bool(getattr(peft, "use_rslora", False)),
        )
        """What the workers receive at init besides the plan."""
        self._model = peft_model
        self._adapter = adapter
        if not self.metadata:
            raise ValueError(f"peft_model has no lora_A/lora_B weights of adapter {adapter!r}")

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        infix = f".{self._adapter}.weight"
        for name, param in self._model.named_parameters():
            if (".lora_A." in name or ".lora_B." in name) and name.endswith(infix):
                yield name.removesuffix(infix) + ".weight", param

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._tensors()]

    def device(self) -> torch.device | None:
        first = next(self._tensors(), None)
        return None if first is None else first[1].device

    def adapter_config(self) -> dict[str, Any] | None:
        return self.config.to_wire()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._tensors():
            yield name, param.detach()
