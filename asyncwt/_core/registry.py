"""Backend registries: pick a trainer or worker engine by its backend name."""

from __future__ import annotations

import importlib
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
    "register_lazy",
    "register_trainer_engine",
    "register_worker_engine",
    "registered_backends",
    "registered_class",
    "trainer_init",
]

_REQUIREMENTS: dict[str, Callable[[], str | None]] = {}
"""Backends that need something of the machine: a check that returns why it is
missing (or None), run when the backend is asked for, never at import."""
_TRAINER_ENGINES: dict[str, type[TrainerWeightTransferEngine[Any]] | str] = {}
_WORKER_ENGINES: dict[str, type[WeightTransferEngine[Any, Any]] | str] = {}
"""Backend name -> its engine class, or where it lives (`"module:Class"`) until first use."""


def _class_name(entry: type | str) -> str:
    return entry.rsplit(":", 1)[-1] if isinstance(entry, str) else entry.__name__


def _register(registry: dict[str, Any], kind: str, backend: str, cls: type | str) -> None:
    check_str("backend", backend, min_chars=1)
    if backend in registry:
        raise ValueError(
            f"{kind} engine backend {backend!r} is already registered "
            f"(to {_class_name(registry[backend])}); got {_class_name(cls)} for it too"
        )
    registry[backend] = cls


def register_lazy(backend: str, *, trainer: str, worker: str) -> None:
    """Register `backend` by where its engine classes live (`"module:Class"` each): the
    module is imported when the backend is first asked for, not at registration."""
    for where in (trainer, worker):
        module, _, name = where.partition(":")
        if not (module and name):
            raise ValueError(f"a lazy engine should be given as 'module:Class', got {where!r}")
    _register(_TRAINER_ENGINES, "trainer", backend, trainer)
    _register(_WORKER_ENGINES, "worker", backend, worker)


def registered_class(registry: dict[str, Any], backend: str) -> Any | None:
    """The class `registry` holds for `backend` (its module imported now if it was
    registered lazily), or None if none is registered."""
    entry = registry.get(backend)
    if isinstance(entry, str):
        module, _, name = entry.partition(":")
        entry = registry[backend] = getattr(importlib.import_module(module), name)
    return entry


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
    return registered_class(registry, backend)


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
