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

It also makes what vLLM serves after a round the round's weights only
(`reset_caches_after_rounds`): once every worker finished a round, vLLM's engine core
resets its prefix cache, and requests in flight are preempted and recomputed on the
new weights; the user calls nothing else. And it lets vLLM's LoRA loader read
adapters pushed by adapter rounds from memory (see `asyncwt._vllm.adapters`).

Nothing here runs when asyncwt is imported: vLLM is imported by `register()` only.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["register", "register_backend", "reset_caches_after_rounds"]

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

    from .._core import registry as _registry
    from .._worker.engine import DeferredWorkerEngine
    from .trainer import vllm_trainer_engine_class
    from .worker import vllm_backend_name, vllm_worker_engine_class

    name = vllm_backend_name(backend)
    if name in _REGISTERED:
        return name
    worker_cls = _registry.registered_class(_registry._WORKER_ENGINES, backend)
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

    from .._core import registry as _registry
    from .._worker.engine import DeferredWorkerEngine
    from .adapters import resolve_adapters_by_name, serve_adapters_from_memory

    names = []
    for backend in asyncwt.registered_backends()["worker"]:
        cls = _registry.registered_class(_registry._WORKER_ENGINES, backend)
        if (
            isinstance(cls, type)
            and issubclass(cls, DeferredWorkerEngine)
            and backend in _registry._TRAINER_ENGINES
        ):
            names.append(register_backend(backend))
    reset_caches_after_rounds()
    serve_adapters_from_memory()
    resolve_adapters_by_name()
    logger.debug("asyncwt registered its vLLM weight-transfer backends: %s", ", ".join(names))


def reset_caches_after_rounds() -> None:
    """Make vLLM's engine core reset its prefix cache after each finished round.

    vLLM's prefix cache keeps the KV blocks of earlier prompts, computed with the
    weights of their time, and reuses them for any later prompt that starts alike (RL
    prompts share long system prompts): without a reset, a prompt of more than one KV
    block generated after a round matches neither the old weights nor the new. The
    engine core runs `finish_weight_update` on the workers through `collective_rpc`;
    this wraps that method so that, in the same engine call (no model step between),
    it then calls `reset_prefix_cache(reset_running_requests=True)`: the cache is
    emptied and running requests are preempted, to be recomputed on the new weights
    (vLLM's own `pause(clear_cache=True)` does the same). Only engines whose
    weight-transfer backend is asyncwt's are affected. Idempotent.
    """
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError as exc:  # pragma: no cover - a vLLM without the v1 engine core
        logger.warning("cannot reset vLLM's prefix cache after rounds: %r", exc)
        return
    original = EngineCore.collective_rpc
    if getattr(original, "_asyncwt_resets_caches", False):
        return

    def collective_rpc(
        self: Any,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        result = original(self, method, timeout, args, kwargs)
        if method == "finish_weight_update" and _uses_asyncwt(self):
            self.reset_prefix_cache(reset_running_requests=True)
        return result

    collective_rpc._asyncwt_resets_caches = True  # type: ignore[attr-defined]
    collective_rpc.__doc__ = original.__doc__
    EngineCore.collective_rpc = collective_rpc


def _uses_asyncwt(engine_core: Any) -> bool:
    """Whether `engine_core`'s weight-transfer backend is one of asyncwt's."""
    from .worker import VLLM_BACKEND_PREFIX

    config = getattr(getattr(engine_core, "vllm_config", None), "weight_transfer_config", None)
    backend = getattr(config, "backend", None)
    return isinstance(backend, str) and backend.startswith(VLLM_BACKEND_PREFIX)
