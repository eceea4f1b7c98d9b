"""The deferred worker engine: rounds over any receiver transport, applied in the background.

A backend is not a subclass: it hands the engine a `TransportBackend` (how to
make its `ReceiverTransport`), and `worker_engine_class` makes the class users
name (`TcpWorkerEngine`) from it. Receiving rounds, deferred apply and version
publishing are here, written once.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from .._core.adapter import AdapterConfig
from .._core.errors import (
    ApplyError,
    RoundConflictError,
    StaleRoundError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from .._core.plan import TransferPlan
from .._core.settings import RoundUpdateInfo, WorkerPlanInfo
from .._core.worker_api import WeightTransferConfig, WeightTransferEngine
from .._transports.backend import TransportBackend, bound_class
from .._transports.base import ReceiverTransport
from .._transports.pool import ReceivePool
from .adapters import AdapterCollector, LoraHooks
from .applier import DeferredApplier, ModelTarget, weights_loader
from .delta import WorkerDelta
from .receivers import worker_side

__all__ = ["DeferredWorkerEngine", "worker_engine_class"]

logger = logging.getLogger("asyncwt")


class _Landing:
    """A round's landing target (`ModelTarget`'s own fields) that notes the round's
    first write: a receiver asking where a parameter lands, or a bucket handed to
    the applier. Only then does an unstaged round make `weights_incomplete` true, so
    a round that fails before writing anything leaves the weights as complete as
    they were (and a delta base as it was)."""

    def __init__(self, target: ModelTarget, *, live: bool, engine: DeferredWorkerEngine) -> None:
        self._target = target
        self._live = live
        self._engine = engine
        self.touched = False

    @property
    def direct(self) -> Sequence[bool]:
        return self._target.direct

    @property
    def hands_out_buffers(self) -> bool:
        return self._target.hands_out_buffers

    def landing_view(self, index: int) -> memoryview:
        self.touch()
        return self._target.landing_view(index)

    def touch(self) -> None:
        """The round writes into the model (or its staged copy) from now on."""
        if not self.touched:
            self.touched = True
            if self._live:
                self._engine.weights_incomplete = True


class DeferredWorkerEngine(WeightTransferEngine[Any, RoundUpdateInfo]):
    """Worker engine with deferred (background) apply, over any `ReceiverTransport`.

    `update_weights` returns once every byte of the round is received; unpacking,
    the optional transform and loading run on `config.apply_threads` threads.
    `finish_weight_update(weight_version)` drains them, re-raises the first error
    naming the parameter, and only then publishes `weight_version`.

    Round outcome: `weight_version` is always the version of the last round that
    completed; a failed round never changes it. `weights_incomplete` says whether
    the model's weights are a mix left by a failed round: it becomes true when a
    round starts writing into the model and false again when a round completes.
    With `config.staged` a round writes into a shadow copy and reaches the model
    only at finish, so a failed round leaves `weights_incomplete` false and the
    previous weights in use (at the cost of one extra copy of the weights).

    Every wait is bounded: the connection and handshake by `connect_timeout`, each
    frame by `recv_timeout`, background apply by `drain_timeout` (all from the
    trainer's init info).
    """

    init_info_cls: ClassVar[type[WorkerPlanInfo]]
    backend: ClassVar[TransportBackend]
    """The transport this class receives over (see `worker_engine_class`)."""
    update_info_cls = RoundUpdateInfo
    defers_processing = True

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: Any | None,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.weight_version: str | None = None
        """The version of the last round that finished completely."""
        self.weights_incomplete = False
        """True after a round that started changing the model's weights and did not
        finish: the model holds a mix of two versions until a round completes."""
        self._applier = DeferredApplier(config.apply_threads)
        self.receiver: ReceiverTransport | None = None
        self._plan: TransferPlan | None = None
        self._target: ModelTarget | None = None
        self._last_round = 0
        self._received_round = 0
        """The round received completely since the last start (0: none); a finish
        closes it, so a second finish has nothing to publish."""
        self._round_error: tuple[int, BaseException] | None = None
        """The error that ended a round, with that round's id: it fails that round's
        finish and nothing else, and nothing but a new round clears it."""
        self._trainer_id = ""
        self._partial = False
        """The trainer opted in to sending part of the model (`WorkerPlanInfo.partial`)."""
        self.untouched_params: tuple[str, ...] = ()
        """The model's parameters that the published version left as they were (the
        trainer sent part of the model, with `partial=True`)."""
        self._drain_timeout = WorkerPlanInfo.drain_timeout
        self._recv_timeout = WorkerPlanInfo.recv_timeout
        self._receiving = threading.Lock()
        """Held while a round is received: a late call waits for an aborted one to end."""
        self._delta: WorkerDelta | None = None
        """The previous version's bytes, when the trainer sends delta rounds."""
        self._adapter: tuple[AdapterConfig, AdapterCollector] | None = None
        """The adapter the trainer sends (an `AdapterSource`), and where it lands."""
        self._lora: LoraHooks | None = None

    def make_receiver(self, info: Any, plan: TransferPlan) -> ReceiverTransport:
        """The backend's receiving side for this worker (from one sender)."""
        return self.backend.receiver(info, plan, self)

    @property
    def relay_host(self) -> str | None:
        """Where a relaying receiver listens for its successor (`config.relay_host`)."""
        return self.config.relay_host

    def _resolve(
        self,
        model: torch.nn.Module,
        plan: TransferPlan,
        receiver: ReceiverTransport,
        delta: WorkerDelta | None = None,
        *,
        partial: bool,
    ) -> ModelTarget:
        target = ModelTarget.resolve(
            model,
            plan,
            self.config.transform,
            elementwise=self.config.transform_elementwise,
            in_place=receiver.lands_in_place,
            staged=self.config.staged,
            partial=partial,
        )
        return delta.adapt(target) if delta is not None else target

    def receive_pool(
        self, info: WorkerPlanInfo, plan: TransferPlan, *, on_device: bool = False
    ) -> ReceivePool:
        """Receive buffers for transports that receive into worker memory: host memory
        (pinned when the model is on a GPU), or device memory when `on_device`.

        `num_buffers` of them, or `apply_threads + 1` if that is more and applying is
        slow (a transform or `load_weights` runs): one buffer per apply thread plus
        the one the next bucket arrives in, so every apply thread can work while the
        receive goes on. A plain copy into the model needs no more than `num_buffers`.
        """
        count = info.num_buffers
        if self.config.transform is not None or weights_loader(self.model) is not None:
            count = max(count, self.config.apply_threads + 1)
        return ReceivePool(
            count, plan.bucket_bytes, self.device, info.recv_timeout, on_device=on_device
        )

    # -- init -------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: WorkerPlanInfo) -> None:
        """Rebuild the trainer's plan, match it to the model, and join the trainer.

        Replaces any previous connection: a new `trainer_init` reconnects this way,
        without restarting the worker, after the trainer or the connection died. A
        round still receiving on the old connection fails at once. Raises
        `ApplyError` if the old connection's background apply is still stuck after
        `drain_timeout`.
        """
        side = worker_side(init_info, self.parse_init_info, self.make_receiver, self.model)
        receiver, plan, delta = side.receiver, side.plan, side.delta
        try:
            adapter = None
            if init_info.adapter_config is not None:  # adapter rounds land beside the model
                self.check_adapter(plan, init_info.adapter_config)
                adapter = (init_info.adapter_config, AdapterCollector(plan))
            landing = self.model if adapter is None else adapter[1]
            target = self._resolve(landing, plan, receiver, delta, partial=init_info.partial)
            receiver.connect()
        except BaseException:
            receiver.close()  # nothing of a failed init outlives it (a relay's listener)
            raise
        old, self.receiver = self.receiver, receiver
        self._plan, self._target, self._delta = plan, target, delta
        self._adapter = adapter
        self._last_round = self._received_round = 0
        self._round_error = None
        self._trainer_id = init_info.trainer_id
        self._partial = init_info.partial
        self._drain_timeout = init_info.drain_timeout
        self._recv_timeout = init_info.recv_timeout
        if old is not None:
            old.close()
        self._drain_quietly("before the new connection's first round")

    # -- rounds -----------------------------------------------------------------------

    def start_weight_update(self) -> None:
        """Begin a round: leftovers of an aborted round are drained and forgotten.

        Raises `ApplyError` when a previous round's background apply is still stuck
        after `drain_timeout`.
        """
        if self.receiver is not None:
            self.receiver.abandon()  # a receive still blocked on an older round ends now
        self._drain_quietly("before a new round")
        self._round_error = None
        self._received_round = 0

    def receive_weights(self, update_info: RoundUpdateInfo) -> None:
        """Receive every bucket of the round; queue each for background apply.

        Raises `PlanMismatchError` (before any byte moves) when the round was planned
        differently, `TransferAbortedError` when the trainer aborts, and
        `TransferTimeoutError` when the trainer goes quiet for `recv_timeout`.
        """
        receiver, plan, target = self._require_init()
        plan.check_digest(update_info.plan_digest, where=f"round {update_info.round_id}")
        if self._trainer_id and not hmac.compare_digest(
            update_info.trainer_id.encode(), self._trainer_id.encode()
        ):
            raise RoundConflictError(
                f"update_weights for round {update_info.round_id} refused: it names a trainer "
                f"other than the one this worker was initialised with (a stale trainer, or a "
                f"stranger); run trainer_init to take the worker over"
            )
        if update_info.round_id <= self._last_round:
            raise StaleRoundError(
                f"round_id should increase: got {update_info.round_id} after {self._last_round} "
                f"(a replayed or reordered update_weights)"
            )
        round_id = self._last_round = update_info.round_id
        if not self._receiving.acquire(timeout=self._recv_timeout):
            raise TransferTimeoutError(
                f"round {round_id}: the previous round was still being received after "
                f"recv_timeout={self._recv_timeout}s; init_weight_transfer_engine again to reset"
            )
        delta = self._delta
        base = 0
        if delta is not None:
            base = delta.begin_receive()  # the round its READY names (see `DeltaFrames`)
        landing = _Landing(target, live=target.commit is None, engine=self)
        try:
            applied = delta.applied(target) if delta is not None else target
            for received in receiver.receive_round(round_id, landing):
                landing.touch()  # applying it writes into the weights
                self._applier.submit(
                    applied,
                    round_id,
                    received.bucket,
                    received.buffer,
                    received.release,
                    delta.prepare(applied, received) if delta is not None else None,
                )
        except BaseException as exc:
            if not landing.touched and delta is not None and self._delta is delta:
                delta.published(base)  # nothing was written: the base still holds
            # A receive overtaken by a new init (its trainer died, a new one connected)
            # must not poison the new connection's rounds: record only the current one.
            if self._is_current(receiver, round_id):
                self._round_error = (round_id, exc)
            if not isinstance(exc, TransferAbortedError):
                logger.warning("round %d failed on the worker: %r", round_id, exc)
            raise
        finally:
            self._receiving.release()
        if self._is_current(receiver, round_id):
            self._received_round = round_id

    def _is_current(self, receiver: ReceiverTransport, round_id: int) -> bool:
        return self.receiver is receiver and self._last_round == round_id

    def drain_pending(self) -> None:
        """Block until every received bucket is applied; re-raise the first error.

        Idempotent: a second call returns at once (an error is raised once here). An
        error stays the round's: its `finish_weight_update` still fails. Bounded by
        `drain_timeout`: an apply still running after it raises `ApplyError` naming
        the round, bucket and parameters.
        """
        try:
            self._applier.drain(self._drain_timeout)
        except ApplyError as exc:
            if self._round_error is None or self._round_error[0] != self._last_round:
                self._round_error = (self._last_round, exc)
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Drain background apply, commit a staged round, then publish `weight_version`.

        Raises the first apply error (naming the parameter), an `ApplyError` when the
        drain exceeds `drain_timeout`, or a `TransferError` naming the error that
        ended the round's receive; in every case `weight_version` keeps the last
        completed round's version and `weights_incomplete` says whether the model
        was left half-updated.
        """
        round_id = self._last_round
        received, self._received_round = self._received_round, 0  # a finish closes the round
        failed = self._round_error
        if failed is not None and failed[0] == round_id:
            error = failed[1]
            self._drain_quietly("after the failed round")
            raise TransferError(
                f"round {round_id} did not complete, so version {weight_version!r} is not "
                f"published; {self._outcome()}. Cause: {type(error).__name__}: {error}"
            ) from error
        try:
            self.drain_pending()
        except ApplyError as exc:
            raise ApplyError(f"{exc}; {self._outcome()}") from exc.__cause__
        if round_id == 0 or received != round_id:
            raise TransferError(
                f"finish_weight_update called without a completely received round (last "
                f"round {round_id}); {self._outcome()}"
            )
        target = self._target
        if target is not None and target.commit is not None:
            self.weights_incomplete = True
            try:
                target.commit()
            except Exception as exc:
                raise ApplyError(
                    f"round {round_id}: moving the staged weights into the model failed: "
                    f"{type(exc).__name__}: {exc}; {self._outcome()}"
                ) from exc
        if self._adapter is not None:
            config, collected = self._adapter
            try:
                self.install_adapter(config, collected.take())
            except Exception as exc:
                raise ApplyError(
                    f"round {round_id}: installing adapter {config.name!r} failed: "
                    f"{type(exc).__name__}: {exc}; the previous adapter stays in use"
                ) from exc
        self.weight_version = weight_version
        self.untouched_params = target.untouched if target is not None else ()
        self.weights_incomplete = False
        if self._delta is not None:
            self._delta.published(round_id)

    def _outcome(self) -> str:
        """What a failed round left behind, for error messages."""
        state = (
            "the model holds a mix of versions until a round completes"
            if self.weights_incomplete
            else "the model's weights are unchanged"
        )
        return f"the published version stays {self.weight_version!r} and {state}"

    def _drain_quietly(self, when: str) -> None:
        """Wait for leftover apply work (bounded); drop errors of abandoned rounds."""
        if not self._applier.wait(self._drain_timeout):
            raise self._applier.stuck_error(self._drain_timeout, when)
        try:
            self._applier.drain()
        except ApplyError as exc:  # reported already, or belongs to an abandoned round
            logger.debug("dropping an error from an abandoned round: %r", exc)

    # -- adapters -----------------------------------------------------------------------

    def check_adapter(self, plan: TransferPlan, config: AdapterConfig) -> None:
        """Refuse (`PlanMismatchError`) an adapter that does not fit the model, at init."""
        self._lora_hooks().check(plan, config)

    def install_adapter(self, config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> None:
        """Serve adapter `config` with `tensors` (this worker's own copies) from now on.

        asyncwt's worker applies it on top of its model's linear layers, in place of
        the previous adapter (see `asyncwt._worker.adapters`); vLLM's engine installs
        it in vLLM's LoRA manager instead.
        """
        self._lora_hooks().apply(config, tensors)

    @property
    def adapter_name(self) -> str | None:
        """The name of the adapter applied on top of the model (None: none)."""
        return None if self._lora is None else self._lora.name

    def _lora_hooks(self) -> LoraHooks:
        if self._lora is None or self._lora.model is not self.model:
            if self._lora is not None:
                self._lora.remove()
            self._lora = LoraHooks(self.model)
        return self._lora

    @property
    def round_bytes(self) -> int | None:
        """Payload bytes of one round (the plan's), None before the init."""
        return None if self._plan is None else self._plan.total_bytes

    def _require_init(self) -> tuple[ReceiverTransport, TransferPlan, ModelTarget]:
        receiver, plan, target = self.receiver, self._plan, self._target
        if receiver is None or plan is None or target is None:
            raise TransferError(
                f"the {self.config.backend} worker engine is not initialised: call "
                f"init_weight_transfer_engine first"
            )
        if not receiver.usable:
            raise TransferError(
                "the previous round broke the connection to the trainer: call "
                "init_weight_transfer_engine again (a new trainer_init) to reconnect"
            )
        return receiver, plan, target

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        super().set_weight_update_target(model, model_config)
        if self._plan is not None and self.receiver is not None and self._adapter is None:
            self._target = self._resolve(
                model, self._plan, self.receiver, self._delta, partial=self._partial
            )

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        if self._plan is not None and self.receiver is not None and self._adapter is None:
            self._target = self._resolve(
                self.model, self._plan, self.receiver, self._delta, partial=self._partial
            )

    def shutdown(self) -> None:
        """Disconnect and stop the apply threads (after queued work, up to `drain_timeout`)."""
        if self.receiver is not None:
            self.receiver.close()
        self._applier.shutdown(self._drain_timeout)


def worker_engine_class(
    backend: TransportBackend, *, name: str, module: str
) -> type[DeferredWorkerEngine]:
    """The worker engine class of `backend` that users name (`name`, in `module`):
    `DeferredWorkerEngine` bound to the backend, with no code of its own."""
    return bound_class(
        DeferredWorkerEngine, backend, init_info_cls=backend.worker_info, name=name, module=module
    )
