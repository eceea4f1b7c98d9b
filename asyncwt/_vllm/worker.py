"""asyncwt's worker engines as vLLM weight-transfer engines (built only inside vLLM).

`vllm_worker_engine_class(backend)` turns any `DeferredWorkerEngine` subclass
(`TcpWorkerEngine`, `ShmWorkerEngine`, ...) into a class that vLLM's
`WeightTransferEngineFactory` can build: it mixes vLLM's own `WeightTransferEngine`
in as a base and adds vLLM's round lifecycle. Receiving is the backend's, unchanged.

What a round does inside vLLM, on each worker:

- `start_weight_update`: nothing in the model changes (an abandoned round is drained).
- `update_weights`: `initialize_layerwise_reload(model)`, then the backend receives
  every bucket; the applier hands each parameter to `model.load_weights` on its
  thread, overlapped with the receive; then `finalize_layerwise_reload(model,
  model_config)` processes the layers and copies the results into the tensors vLLM
  serves from. vLLM has processed the loaded weights (on the CPU it repacks linear
  weights and leaves parameters of shape `(0,)`), so checkpoint-format weights can
  only be loaded through this lifecycle. Each tensor is copied out of the receive
  buffer first: the layerwise loader keeps the tensors it is given until the layer is
  complete, while asyncwt reuses its receive buffers.
- `finish_weight_update`: the round is published as asyncwt's engine publishes it.
  The plugin then resets vLLM's prefix cache (see `asyncwt._vllm.plugin`).

An adapter round (an `AdapterSource`) receives the adapter's tensors beside the model,
which it leaves alone, and publishes them for vLLM's LoRA loader to read from memory
(see `asyncwt._vllm.adapters`).

The whole reload runs inside `update_weights`, one call of vLLM's engine core: its
scheduler runs no model step during an engine call, so a step never meets a layer
being reloaded (vLLM's layerwise reload leaves meta tensors behind until a layer is
complete), whatever requests are in flight. Between `start_weight_update` and
`update_weights`, and after it, steps run on whole weights: the old ones, then the
new ones.

vLLM passes no `weight_version` to the engine (its engine core records the version
after the workers finished), so `weight_version` on these engines stays `None`;
read the served version from vLLM (`GET /weight_info`).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch

from .._core.adapter import AdapterConfig
from .._core.errors import AsyncwtError, PlanMismatchError, TransferError
from .._core.lanes import wait_for_stream
from .._core.plan import TransferPlan
from .._core.settings import RoundUpdateInfo
from .._core.worker_api import WeightTransferConfig
from .._worker.engine import DeferredWorkerEngine
from .._worker.slices import LAYOUT_ATTRIBUTE
from .adapters import publish
from .slices import SlicedLoading, rank_boxes, refresh_tied_lm_head

__all__ = ["VLLM_BACKEND_PREFIX", "VllmRoundMixin", "vllm_backend_name", "vllm_worker_engine_class"]

logger = logging.getLogger("asyncwt")

VLLM_BACKEND_PREFIX = "asyncwt_"
"""vLLM's name of an asyncwt backend is this prefix and asyncwt's name: `asyncwt_tcp`."""

_CLASSES: dict[str, type[DeferredWorkerEngine]] = {}


def vllm_backend_name(backend: str) -> str:
    """The name vLLM knows asyncwt's `backend` by (`"tcp"` -> `"asyncwt_tcp"`)."""
    return VLLM_BACKEND_PREFIX + backend


def _own_copy(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The applier's transform inside vLLM: a tensor that outlives the receive buffer.

    vLLM's layerwise loader keeps the tensors it is given until their layer is
    complete, then uploads them (on this apply thread's stream). On a GPU worker
    the copy is pinned host memory: not GPU memory outside vLLM's memory budget
    (a device receive buffer's bytes go down once, and the host waits for them,
    as the loader may read them there), and an upload from it is a DMA, not a
    synchronous copy staged through pageable memory. The apply stream first waits
    for the device's default stream, where vLLM queues its own work (the reload's
    allocations, inference reading the weights), so that what this apply writes
    is ordered after it.
    """
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return tensor.clone()
    stream = torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.default_stream(stream.device))
    copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    copy.copy_(tensor, non_blocking=tensor.is_cuda)
    if tensor.is_cuda:
        wait_for_stream(stream)
    return copy


class VllmRoundMixin(DeferredWorkerEngine):
    """vLLM's round lifecycle over a `DeferredWorkerEngine` (see the module docstring).

    Not used on its own: `vllm_worker_engine_class` puts it in front of a backend's
    engine class and vLLM's `WeightTransferEngine`.
    """

    asyncwt_backend: ClassVar[str]
    """asyncwt's registry name of the backend this class wraps."""

    def __init__(
        self,
        config: Any,
        vllm_config: Any,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        # vLLM's config carries only the backend's (vLLM) name. One apply thread:
        # vLLM's layerwise loaders keep per-layer state that is not thread-safe.
        self._sliced = SlicedLoading()
        own = WeightTransferConfig(
            backend=self.asyncwt_backend, apply_threads=1, transform=self._loader_tensor
        )
        super().__init__(own, vllm_config, device, model)
        self.vllm_weight_transfer_config = config
        """The `WeightTransferConfig` vLLM built this engine with."""
        self._layerwise = False
        self._live: LiveTensors = {}
        """Per layer, the tensors the open reload leaves live, and copies of them."""
        self._apply_failure: BaseException | None = None

    def _loader_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """What vLLM's loaders get of a received tensor: its own copy, and, for a
        slice this rank holds, that copy standing in for the full tensor."""
        return self._sliced.wrap(name, _own_copy(name, tensor))

    def init_transfer_engine(self, init_info: Any) -> None:
        """Join the trainer (see the base class). When the trainer sends slices, this
        rank declares the box of each checkpoint tensor its parallel layers hold
        (`rank_boxes`), and receives only those bytes."""
        plan = init_info.transfer_plan
        boxes = rank_boxes(self.model) if init_info.slices else {}
        full = {meta.name: meta.shape for meta in plan.params}
        declared = {name: box for name, box in boxes.items() if name in full}
        setattr(self.model, LAYOUT_ATTRIBUTE, declared)  # the worker's side of the plan reads it
        super().init_transfer_engine(init_info)
        # Only once joined: a failed init keeps the previous connection, and its
        # rounds must keep being loaded as that init declared them.
        self._sliced.declare(declared, full)

    def start_weight_update(self) -> None:
        """Begin a round: drain an abandoned one. The model is not touched yet."""
        super().start_weight_update()
        self._end_layerwise(failed=True)
        self._apply_failure = None

    def receive_weights(self, update_info: RoundUpdateInfo) -> None:
        """Reload the model in place: start vLLM's layerwise reload, receive and load
        every parameter, finalize, all before returning.

        Loading ends inside this call because vLLM sets its current config (which
        weight loaders may read) only for the duration of each engine call, and its
        engine core runs no model step during one (see the module docstring). On any
        error the layerwise reload is finalized at once, so the model vLLM serves is
        never left with unloaded layers: each layer then holds either this round's
        weights (all of them arrived) or the previous ones (see `_end_layerwise`), and
        the round cannot be finished.
        """
        if self._adapter is not None:  # an adapter round leaves the model alone
            super().receive_weights(update_info)
            self.drain_pending()
            return
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._layerwise = True
        try:
            self._live = _live_tensors(self.model)
            super().receive_weights(update_info)
        except BaseException:
            self._end_layerwise(failed=True)
            raise
        try:
            self.drain_pending()
        except BaseException as exc:
            self._apply_failure = exc
            self._end_layerwise(failed=True)
            raise
        self._end_layerwise()

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Publish the round (see the base class); its weights are loaded already.

        Raises `TransferError` when this round's loading failed; the weights are then
        incomplete (`weights_incomplete` stays true) and no version is published.
        """
        try:
            self.drain_pending()
        finally:
            self._end_layerwise(failed=True)  # a no-op unless a receive was cut short
        failure, self._apply_failure = self._apply_failure, None
        if failure is not None:
            raise TransferError(f"the round did not complete: {failure}") from failure
        super().finish_weight_update(weight_version)

    def check_adapter(self, plan: TransferPlan, config: AdapterConfig) -> None:
        """Refuse an adapter round on a vLLM that serves no LoRA adapters, or one whose
        rank exceeds vLLM's `max_lora_rank`; vLLM checks the rest when it loads it."""
        lora = getattr(self.vllm_config, "lora_config", None)
        if lora is None:
            raise PlanMismatchError(
                f"adapter {config.name!r}: this vLLM serves no LoRA adapters; start it with "
                f"--enable-lora (LLM(enable_lora=True))"
            )
        if config.r > lora.max_lora_rank:
            raise PlanMismatchError(
                f"adapter {config.name!r}: rank {config.r} should be at most vLLM's "
                f"max_lora_rank={lora.max_lora_rank} (--max-lora-rank)"
            )

    def install_adapter(self, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> None:
        """Serve the adapter from memory: vLLM drops its adapters after every round
        and loads this one again for the next request naming `adapter_path(name)`
        (see `asyncwt._vllm.adapters`)."""
        publish(config, tensors)

    def shutdown(self) -> None:
        """Release the trainer connection; the engine stays usable for a new init.

        vLLM keeps one engine per worker for the worker's whole life and calls this to
        release a trainer, so the apply thread is kept (it is idle between rounds).
        """
        self._end_layerwise(failed=True)
        if self.receiver is not None:
            self.receiver.close()

    def _end_layerwise(self, *, failed: bool = False) -> None:
        """Finalize an open layerwise reload once the applier went quiet.

        After a `failed` round, layers that received only some of their weights get
        their previous weights back instead of being processed half-loaded (vLLM's
        finalize would fill the missing part with uninitialised memory), the tensors
        the reload kept live (biases, loaded on arrival) included.
        """
        if not self._layerwise:
            return
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            self.drain_pending()
        except AsyncwtError as exc:  # the round failed already; its error is reported there
            logger.debug("dropping an apply error while finalizing vLLM's reload: %r", exc)
        self._layerwise = False
        live, self._live = self._live, {}
        if failed:
            _forget_partial_layers(self.model, live)
        finalize: Any = finalize_layerwise_reload  # untyped in vLLM
        finalize(self.model, self.model_config)
        refresh_tied_lm_head(self.model)


LiveTensors = dict[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]]]
"""Per layer: each tensor a layerwise reload left live, and a copy of its values."""


def _live_tensors(model: torch.nn.Module) -> LiveTensors:
    """Copies of the parameters `initialize_layerwise_reload` left in place.

    vLLM's reload moves a layer's parameters to the meta device and buffers what
    arrives until the layer is complete, except those it never moves (`bias`, see
    `SKIP_TENSORS` in its `reload/meta.py`): their loader writes into the served
    parameter as soon as the tensor arrives. A failed round puts these copies back.
    Biases are small (a row of the weight), so the copies cost little.
    """
    live: LiveTensors = {}
    for layer in model.modules():
        kept = [p for p in layer.parameters(recurse=False) if not p.is_meta]
        if kept:
            live[layer] = [(p, p.detach().clone()) for p in kept]
    return live


def _forget_partial_layers(model: torch.nn.Module, live: LiveTensors) -> None:
    """Drop what half-loaded layers buffered, so finalizing restores their old weights.

    Uses vLLM's per-layer reload state (`get_layerwise_info`): a layer still waiting
    for weights (`can_load()`) that buffered some is reset to "nothing loaded", which
    `finalize_layerwise_reload` answers by putting the layer's previous tensors back;
    its live tensors (`_live_tensors`) get their previous values here.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError as exc:  # pragma: no cover - a vLLM without this internal
        logger.warning("cannot restore half-loaded layers with this vLLM: %r", exc)
        return
    for layer in model.modules():
        info: Any = get_layerwise_info(layer)
        if info.can_load() and info.load_numel > 0:
            info.loaded_weights = []
            info.load_numel = 0
            with torch.no_grad():
                for tensor, before in live.get(layer, ()):
                    tensor.copy_(before)


def vllm_worker_engine_class(
    backend: str, engine_cls: type[DeferredWorkerEngine]
) -> type[DeferredWorkerEngine]:
    """The vLLM engine class for asyncwt's `backend`, implemented by `engine_cls`.

    Its bases are `VllmRoundMixin`, `engine_cls` and vLLM's `WeightTransferEngine`
    (so `isinstance(engine, vllm...WeightTransferEngine)` holds); the class is built
    once per backend. Imports vLLM.
    """
    if not (isinstance(engine_cls, type) and issubclass(engine_cls, DeferredWorkerEngine)):
        raise TypeError(f"engine_cls should be a DeferredWorkerEngine subclass, got {engine_cls!r}")
    cached = _CLASSES.get(backend)
    if cached is not None:
        if not issubclass(cached, engine_cls):
            raise ValueError(
                f"backend {backend!r} already has a vLLM engine class built from "
                f"{cached.__mro__[2].__name__}; got {engine_cls.__name__} for it too"
            )
        return cached
    from vllm.distributed.weight_transfer.base import WeightTransferEngine as VllmBase

    name = f"Vllm{engine_cls.__name__}"
    namespace = {
        "__module__": __name__,
        "__qualname__": name,
        "__doc__": (
            f"vLLM's `{vllm_backend_name(backend)}` weight-transfer engine: asyncwt's "
            f"{engine_cls.__name__} with vLLM's round lifecycle (see `VllmRoundMixin`)."
        ),
        "asyncwt_backend": backend,
    }
    cls: type[DeferredWorkerEngine] = type(name, (VllmRoundMixin, engine_cls, VllmBase), namespace)
    _CLASSES[backend] = cls
    return cls
