"""The vLLM plugin: asyncwt's backends in vLLM's weight-transfer factories.

Installed as an entry point of the `vllm.general_plugins` group, which vLLM loads in
every one of its processes (API server, engine core and each worker; on the CPU the
workers are spawned, so registering in the driver alone would not reach them):

    [project.entry-points."vllm.general_plugins"]
    asyncwt = "asyncwt._vllm.plugin:register"

`register()` adds, for every asyncwt backend with a deferred worker engine (`tcp`,
`shm`, `torch_dist`, and any registered with asyncwt before it runs):

- to `WeightTransferEngineFactory`, `asyncwt_<backend>`: the backend's worker engine
  with vLLM's round lifecycle (see `asyncwt._vllm.worker`); select it with
  `--weight-transfer-config '{"backend": "asyncwt_tcp"}'`;
- to `WeightTransferTrainerFactory`, the same name: a blocking adapter over asyncwt's
  trainer engine (see `asyncwt._vllm.trainer`).

Nothing here runs when asyncwt is imported: vLLM is imported by `register()` only.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["register", "register_backend"]

logger = logging.getLogger("asyncwt")

_REGISTERED: set[str] = set()
"""vLLM names this process registered (vLLM may load a plugin more than once)."""


def register_backend(backend: str) -> str:
    """Register asyncwt's `backend` in both of vLLM's factories; return its vLLM name.

    The backend must be registered with asyncwt on both sides (else `ValueError`), with
    a worker engine that is a `DeferredWorkerEngine` (else `TypeError`). Registering a
    name twice in one process is a no-op; a name that something else registered in
    vLLM is a `ValueError` (vLLM's).
    """
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    from .. import _registry
    from .._worker.engine import DeferredWorkerEngine
    from .trainer import vllm_trainer_engine_class
    from .worker import vllm_backend_name, vllm_worker_engine_class

    name = vllm_backend_name(backend)
    if name in _REGISTERED:
        return name
    worker_cls = _registry._WORKER_ENGINES.get(backend)
    if not (isinstance(worker_cls, type) and issubclass(worker_cls, DeferredWorkerEngine)):
        raise TypeError(
            f"asyncwt backend {backend!r} should have a DeferredWorkerEngine worker engine "
            f"to run inside vLLM, got {worker_cls!r}"
        )
    if backend not in _registry._TRAINER_ENGINES:
        raise ValueError(f"asyncwt backend {backend!r} has no trainer engine registered")
    # Typed Any: their vLLM bases are mixed in at run time, where mypy cannot see them.
    worker_engine: Any = vllm_worker_engine_class(backend, worker_cls)
    trainer_engine: Any = vllm_trainer_engine_class()
    WeightTransferEngineFactory.register_engine(name, worker_engine)
    WeightTransferTrainerFactory.register_engine(name, trainer_engine)
    _REGISTERED.add(name)
    return name


def register() -> None:
    """The `vllm.general_plugins` entry point: register every asyncwt backend that can
    run inside vLLM. Safe to call more than once."""
    import asyncwt

    from .. import _registry
    from .._worker.engine import DeferredWorkerEngine

    names = []
    for backend in asyncwt.registered_backends()["worker"]:
        cls = _registry._WORKER_ENGINES[backend]
        if issubclass(cls, DeferredWorkerEngine) and backend in _registry._TRAINER_ENGINES:
            names.append(register_backend(backend))
    logger.debug("asyncwt registered its vLLM weight-transfer backends: %s", ", ".join(names))
