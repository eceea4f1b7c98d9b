"""A worker engine in a Ray actor: what `asyncwt worker` serves over HTTP, as actor methods.

`WorkerActor` is a plain class (this module does not import Ray): wrap it with
`ray.remote(WorkerActor)` or `worker_actor(...)` and place it with Ray's scheduling.
Its methods are coroutines, so Ray runs it as an async actor: a status or a shutdown
is answered while `update_weights` waits for the whole round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .._core.registry import create_worker_engine
from .._core.worker_api import WeightTransferConfig, WeightTransferEngine
from .round_driver import RoundDriver, weights_status

__all__ = ["WorkerActor", "worker_actor"]

Engine = WeightTransferEngine[Any, Any]


def _field(request: Any, name: str) -> dict[str, Any]:
    """`request.name` or `request[name]`: vLLM's request object or its dict form."""
    value = request.get(name, {}) if isinstance(request, dict) else getattr(request, name, None)
    if not isinstance(value, dict):
        raise ValueError(f"{name} should be a dict, got {type(value).__name__}")
    return value


class WorkerActor:
    """A model and an asyncwt worker engine, driven by `RayClient` over Ray.

    The same rounds as the worker server (`asyncwt worker`), through the same
    `RoundDriver`: a call out of order, for another round or from another trainer
    is refused with a `RoundConflictError`; a version is published only by the
    finish that closes a round that fully succeeded. The weights arrive on the
    engine's transport (the trainer's `Listen.advertise_host` for tcp), never through Ray's
    object store.

    Args:
        model: a zero-argument callable returning the worker's `torch.nn.Module`
            (same parameter names and shapes as the trainer's, or a
            `load_weights` method that maps them); called once, in the actor.
        config: which engine to build and its local options (default: tcp).
        device: where the engine receives; default the model's device.
    """

    def __init__(
        self,
        model: Callable[[], torch.nn.Module],
        *,
        config: WeightTransferConfig | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if not callable(model) or isinstance(model, torch.nn.Module):
            raise TypeError(
                "model should be a zero-argument callable that builds the model in the actor, "
                f"got {type(model).__name__}"
            )
        self.config = config if config is not None else WeightTransferConfig()
        self.model = model()
        if not isinstance(self.model, torch.nn.Module):
            raise TypeError(f"model() should return a torch.nn.Module, got {type(self.model)}")
        config_ = self.config

        def create() -> Engine:
            return create_worker_engine(config_, model=self.model, device=device)

        self._driver = RoundDriver(create(), create=create)

    async def init_weight_transfer_engine(self, request: Any) -> None:
        """Connect to the trainer (`request.init_info`, or `{"init_info": ...}`).

        A second init re-initialises: that is how a new `trainer_init` reconnects.
        """
        await self._driver.init(_field(request, "init_info"))

    async def start_weight_update(
        self, *, round_id: int | None = None, trainer_id: str | None = None
    ) -> None:
        """Open a round (abandoning an open one); the ids tie it to its finish."""
        await self._driver.start(round_id=round_id, trainer_id=trainer_id)

    async def update_weights(self, request: Any) -> None:
        """Receive the round (`request.update_info`, or `{"update_info": ...}`); returns
        once every byte arrived."""
        await self._driver.update(_field(request, "update_info"))

    async def finish_weight_update(
        self,
        weight_version: str | None = None,
        *,
        round_id: int | None = None,
        trainer_id: str | None = None,
    ) -> None:
        """Drain the background applies, then publish `weight_version` if the whole
        round succeeded."""
        await self._driver.finish(weight_version, round_id=round_id, trainer_id=trainer_id)

    async def shutdown_weight_transfer_engine(self) -> None:
        """Release the transport; the actor keeps its model and a later init reconnects."""
        await self._driver.shutdown(drop=True)

    async def weights_status(self, *, checksum: bool = False) -> dict[str, Any]:
        """`weight_version`, `weights_incomplete`, `checksum` (None unless asked for:
        it hashes every weight), `backend`, `initialized` (the worker server's
        `GET /weights_status`)."""
        return await weights_status(
            self._driver, self.model, self.config.backend, checksum=checksum
        )

    async def get_weight_version(self) -> str | None:
        """The version of the last round that completed (vLLM's name for it)."""
        return self._driver.state.weight_version


def worker_actor(**options: Any) -> Any:
    """`ray.remote(WorkerActor)`, with Ray's actor `options` (`num_cpus`, `num_gpus`,
    `resources`, `scheduling_strategy`, ...) if any are given.

    Spawn it as `worker_actor(num_cpus=1).remote(make_model)`.
    """
    from .._core.optional import import_ray

    actor_class = import_ray().remote(WorkerActor)
    return actor_class.options(**options) if options else actor_class
