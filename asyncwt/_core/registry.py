"""Backend registries: pick a trainer or worker engine by its backend name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .device import resolve_device
from .protocol import AnyWeightSyncClient
from .source import WeightSource
from .trainer_api import TrainerInitInfo, TrainerWeightTransferEngine
from .validate import check_str
from .worker_api import WeightTransferConfig, WeightTransferEngine

__all__ = [
    "create_worker_engine",
    "register_trainer_engine",
    "register_worker_engine",
    "registered_backends",
    "trainer_init",
]

_REQUIREMENTS: dict[str, Callable[[], str | None]] = {}
"""Backends that need something of the machine: a check that returns why it is
missing (or None), run when the backend is asked for, never at import."""
_TRAINER_ENGINES: dict[str, type[TrainerWeightTransferEngine[Any]]] = {}
_WORKER_ENGINES: dict[str, type[WeightTransferEngine[Any, Any]]] = {}


def _register(registry: dict[str, Any], kind: str, backend: str, cls: type) -> None:
    check_str("backend", backend, min_chars=1)
    if backend in registry:
        raise ValueError(
            f"{kind} engine backend {backend!r} is already registered "
            f"(to {registry[backend].__name__}); got {cls.__name__} for it too"
        )
    registry[backend] = cls


def _lookup(registry: dict[str, Any], kind: str, backend: str) -> Any:
    known = ", ".join(repr(b) for b in sorted(registry)) or "none"
    if backend not in registry:
        raise ValueError(f"unknown {kind} backend {backend!r}; registered backends: {known}")
    check = _REQUIREMENTS.get(backend)
    missing = check() if check is not None else None
    if missing is not None:
        raise ValueError(
            f"{kind} backend {backend!r} is not available: {missing}; registered backends: {known}"
        )
    return registry[backend]


def require(backend: str, check: Callable[[], str | None]) -> None:
    """Make asking for `backend` run `check` first: what it returns (why the machine
    cannot run the backend) is the error, `None` lets it through. Checks run on
    use, so that importing asyncwt touches no device (CUDA's initialisation in a
    process that forks later breaks its children)."""
    _REQUIREMENTS[backend] = check


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

    `device` defaults to the device of the model's first parameter (CPU if none);
    a bare `"cuda"` is the calling thread's current CUDA device.
    """
    cls = worker_engine_class(config.backend)
    if device is None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else torch.device("cpu")
    resolved = resolve_device(device)
    engine: WeightTransferEngine[Any, Any] = cls(config, vllm_config, resolved, model)
    return engine
