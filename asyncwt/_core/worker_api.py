"""The worker side of the interface: config, info types and the engine base."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from .protocol import WeightTransferUpdatePayload
from .validate import check_bool, check_host, check_int_in, check_str

__all__ = [
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdateRequest",
]


@dataclass(frozen=True, kw_only=True)
class WeightTransferConfig:
    """Which worker engine to build, and its local (non-wire) options."""

    backend: str = "tcp"
    """Registry key of the worker engine, e.g. `"tcp"`."""

    apply_threads: int = 2
    """Background threads that unpack and load received buckets."""

    transform: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    """Per-parameter hook `(name, tensor) -> tensor` run before loading (cast, quantise).
    It runs on the apply threads; it must not keep the tensor it is given (a view of a
    receive buffer that is reused)."""

    transform_elementwise: bool = False
    """Declare that `transform` works element by element (a cast, a scale, a clamp): it
    may be called with any contiguous run of a parameter's elements, flattened to 1-D,
    and returns as many elements (of any dtype: they are cast into the parameter).

    Then a chunk of a parameter larger than a bucket is transformed as it arrives and
    lands in its element range (no parameter-sized reassembly buffer), and a bucket's
    work is shared among the apply threads, so a large last tensor does not leave one
    thread working alone after the round's last byte. Where the parameter is of the
    wire dtype (and the transport can), the bytes are received straight into it and
    the transform is given that memory: it may work in place and return its input,
    and then nothing is copied. A model with `load_weights` still gets whole tensors.
    Leave it False for a transform that needs the whole tensor (a per-tensor
    quantisation scale, a reshape)."""

    staged: bool = False
    """Receive each round into a shadow copy of the weights and move it into the model
    only at `finish_weight_update`, once every byte arrived and was applied: a round
    that fails halfway leaves the previous weights intact and in use.

    Costs one extra copy of every transferred parameter, allocated at init and kept:
    in the model's dtype and on its device for a plain model; in the wire dtype in
    host memory for a model with `load_weights`, whose `transform` and `load_weights`
    then run at finish (a failure there can still leave the model partly loaded, and
    is reported through `weights_incomplete`). Unstaged (the default), a round writes
    into the live weights as it arrives, and a failed round leaves them mixed until
    the next round completes.

    A worker-side option because the memory is the worker's: the trainer neither
    knows nor needs to know whether a worker stages."""

    relay_host: str | None = None
    """Where a `"tcp"` chain worker listens for its successor: the address its server
    is bound to (`asyncwt worker --host` sets it), so a chain across hosts needs no
    other setting. None: `$ASYNCWT_RELAY_HOST` if set (a vLLM server's workers: set
    it to the server's address), else the address this worker reaches the trainer
    from."""

    def __post_init__(self) -> None:
        check_bool("staged", self.staged)
        if self.relay_host is not None:
            check_host("relay_host", self.relay_host)
        check_str("backend", self.backend, min_chars=1)
        check_int_in("apply_threads", self.apply_threads, 1)
        if self.transform is not None and not callable(self.transform):
            raise ValueError(f"transform should be callable or None, got {self.transform!r}")
        check_bool("transform_elementwise", self.transform_elementwise)
        if self.transform_elementwise and self.transform is None:
            raise ValueError(
                "transform_elementwise=True describes the transform, but transform is None; "
                "set a transform or leave transform_elementwise False"
            )


@dataclass
class WeightTransferInitInfo(ABC):
    """Base of every backend's worker-side init info (what the trainer sends at init)."""


@dataclass
class WeightTransferUpdateInfo(ABC):
    """Base of every backend's per-round update info."""


@dataclass
class WeightTransferInitRequest:
    """Body of the `init_weight_transfer_engine` route."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """Body of the `update_weights` route."""

    update_info: WeightTransferUpdatePayload = field(default_factory=dict)


TInitInfo = TypeVar("TInitInfo", bound=WeightTransferInitInfo)
TUpdateInfo = TypeVar("TUpdateInfo", bound=WeightTransferUpdateInfo)


def _synchronize(device: torch.device) -> None:
    """Wait for `device`'s queued work; nothing to wait for on the CPU (where a
    CPU-only torch could not synchronise anyway)."""
    if device.type == "cpu":
        return
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        accelerator.synchronize(device)
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """The worker's side of a weight transfer: receives rounds, loads the model.

    A round is `start_weight_update()`, one or more `update_weights(info)`, then
    `finish_weight_update()`. An engine with `defers_processing = True` returns from
    `update_weights` once bytes are received and applies them on background threads;
    `finish_weight_update` (or `drain_pending`, for a caller that runs the tail
    itself) is what guarantees they are applied.

    `vllm_config` is optional: asyncwt runs with or without vLLM. Subclasses set
    `init_info_cls` and `update_info_cls`.
    """

    init_info_cls: ClassVar[type[Any]]
    update_info_cls: ClassVar[type[Any]]

    supports_draft_weight_update: ClassVar[bool] = True

    defers_processing: ClassVar[bool] = False
    """Whether `update_weights` returns before the weights are applied.

    When set, `update_weights` does not synchronise the device (that would serialise
    the background pipeline); `finish_weight_update` drains instead. A caller that
    drives the tail itself must call `drain_pending()` first.
    """

    weights_incomplete: bool | None = None
    """Whether a failed round left the model a mix of two versions (see
    `DeferredWorkerEngine`); None: the engine does not say, its driver keeps count."""
    untouched_params: tuple[str, ...] = ()
    """The model's parameters the published version left as they were (a partial
    update); empty: every parameter, or the engine does not say."""

    @property
    def round_bytes(self) -> int | None:
        """Payload bytes of one round, where the engine knows them (None: it does not)."""
        return None

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: Any | None,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.parallel_config = getattr(vllm_config, "parallel_config", None)
        self.model_config = getattr(vllm_config, "model_config", None)
        self.device = device
        self.model = model
        self._default_model = model
        self._default_model_config = self.model_config

    def drain_pending(self) -> None:
        """Block until every deferred update is applied. Idempotent; a no-op here."""

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """Direct the next updates at `model` (e.g. a draft model)."""
        self.model = model
        self.model_config = model_config

    def reset_weight_update_target(self) -> None:
        """Direct updates back at the model the engine was built with."""
        self.model = self._default_model
        self.model_config = self._default_model_config

    def parse_init_info(self, init_dict: dict[str, Any]) -> TInitInfo:
        """Build the typed init info; a bad dict becomes `ValueError`."""
        parsed: TInitInfo = _parse(self.init_info_cls, init_dict, "init_info", type(self).__name__)
        return parsed

    def parse_update_info(self, update_dict: dict[str, Any]) -> TUpdateInfo:
        """Build the typed update info; a bad dict becomes `ValueError`."""
        parsed: TUpdateInfo = _parse(
            self.update_info_cls, update_dict, "update_info", type(self).__name__
        )
        return parsed

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Set up the transport (once, before the first round)."""

    @abstractmethod
    def start_weight_update(self) -> None:
        """Prepare for a new round."""

    @abstractmethod
    def finish_weight_update(self) -> None:
        """Complete the round: after it returns, the weights are applied."""

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Parse `update_info` and receive the weights it announces.

        Without `defers_processing`, the engine's device is synchronised before
        returning (not the thread's current device: they may differ).
        """
        self.receive_weights(self.parse_update_info(update_info))
        if not self.defers_processing:
            _synchronize(self.device)

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo) -> None:
        """Receive the weights `update_info` announces and load (or queue) them."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release transfer resources; the worker itself keeps running."""


def _parse(cls: type[Any], data: object, what: str, owner: str) -> Any:
    """The one place where a dict becomes a typed info object."""
    if not isinstance(data, dict):
        raise ValueError(f"Invalid {what} for {owner}: expected a dict, got {type(data).__name__}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ValueError(f"Invalid {what} for {owner}: {exc}") from exc
