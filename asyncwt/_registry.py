"""Backend registries: pick a trainer or worker engine by its backend name."""

from __future__ import annotations

from typing import Any

import torch

from ._client import AnyWeightSyncClient
from ._source import WeightSource
from ._trainer import TrainerInitInfo, TrainerWeightTransferEngine
from ._worker import WeightTransferConfig, WeightTransferEngine

__all__ = [
    "create_worker_engine",
    "register_trainer_engine",
    "register_worker_engine",
    "registered_backends",
    "trainer_init",
]

_UNAVAILABLE: dict[str, str] = {}
"""Backends that ship with asyncwt but cannot run here, with the reason."""
_TRAINER_ENGINES: dict[str, type[TrainerWeightTransferEngine[Any]]] = {}
_WORKER_ENGINES: dict[str, type[WeightTransferEngine[Any, Any]]] = {}


def _register(registry: dict[str, Any], kind: str, backend: str, cls: type) -> None:
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend should be a non-empty str, got {backend!r}")
    if backend in registry:
        raise ValueError(
            f"{kind} engine backend {backend!r} is already registered "
            f"(to {registry[backend].__name__}); got {cls.__name__} for it too"
        )
    registry[backend] = cls


def _lookup(registry: dict[str, Any], kind: str, backend: str) -> Any:
    try:
        return registry[backend]
    except KeyError:
        known = ", ".join(repr(b) for b in sorted(registry)) or "none"
        if backend in _UNAVAILABLE:
            raise ValueError(
                f"{kind} backend {backend!r} is not available: {_UNAVAILABLE[backend]}; "
                f"registered backends: {known}"
            ) from None
        raise ValueError(
            f"unknown {kind} backend {backend!r}; registered backends: {known}"
        ) from None


def mark_unavailable(backend: str, why: str) -> None:
    """Record that built-in `backend` cannot run here, so asking for it says why."""
    _UNAVAILABLE[backend] = why


def register_trainer_engine(backend: str, cls: type[TrainerWeightTransferEngine[Any]]) -> None:
    """Register the trainer engine class for `backend`; a name registers once."""
    _register(_TRAINER_ENGINES, "trainer", backend, cls)


def register_worker_engine(backend: str, cls: type[WeightTransferEngine[Any, Any]]) -> None:
    """Register the worker engine class for `backend`; a name registers once."""
    _register(_WORKER_ENGINES, "worker", backend, cls)


def registered_backends() -> dict[str, list[str]]:
    """The registered backend names, by side."""
    return {"trainer": sorted(_TRAINER_ENGINES), "worker": sorted(_WORKER_ENGINES)}


async def trainer_init(
    init_info: TrainerInitInfo,
    *,
    client: AnyWeightSyncClient,
    source: WeightSource | None = None,
) -> TrainerWeightTransferEngine[Any]:
    """Build the trainer engine that `init_info.backend` names and rendezvous.

    Call on every trainer rank. Cancellation: the rendezvous is abandoned and its
    endpoint closed; no engine is returned.
    """
    if not isinstance(init_info, TrainerInitInfo):
        raise TypeError(
            f"init_info should be a TrainerInitInfo subclass instance, "
            f"got {type(init_info).__name__}"
        )
    cls = _lookup(_TRAINER_ENGINES, "trainer", init_info.backend)
    engine: TrainerWeightTransferEngine[Any] = await cls.trainer_init(
        init_info, client=client, source=source
    )
    return engine


def worker_engine_class(backend: str) -> type[WeightTransferEngine[Any, Any]]:
    """The worker engine class registered for `backend` (unknown: `ValueError`)."""
    cls: type[WeightTransferEngine[Any, Any]] = _lookup(_WORKER_ENGINES, "worker", backend)
    return cls


def create_worker_engine(
    config: WeightTransferConfig,
    *,
    model: torch.nn.Module,
    device: torch.device | str | None = None,
    vllm_config: Any | None = None,
) -> WeightTransferEngine[Any, Any]:
    """Build the worker engine that `config.backend` names.

    `device` defaults to the device of the model's first parameter (CPU if none).
    """
    cls = worker_engine_class(config.backend)
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    engine: WeightTransferEngine[Any, Any] = cls(config, vllm_config, torch.device(device), model)
    return engine
