"""Models and a fake worker engine for the control-plane tests (importable by subprocesses).

Importing this module registers the `fake-http-test` worker backend: a
`WeightTransferEngine` whose "transfer" is the update info itself (`{"fill": x}`
fills every parameter with x), so the clients and the server can be tested across
real processes before any real transport exists. It is a control-plane fake only.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

import asyncwt
from asyncwt import TransferAbortedError, TransferTimeoutError

FAKE_BACKEND = "fake-http-test"


def tiny() -> torch.nn.Module:
    """A small deterministic model (a model factory for `asyncwt worker --model`)."""
    torch.manual_seed(0)
    return torch.nn.Linear(4, 3)


@dataclass
class FakeInitInfo(asyncwt.WeightTransferInitInfo):
    """What the fake trainer sends at init: a label, kept to prove it arrived."""

    label: str = ""


@dataclass
class FakeUpdateInfo(asyncwt.WeightTransferUpdateInfo):
    """One fake round.

    `fill`: the value every parameter takes. `fail`: if set, the engine raises
    `TransferAbortedError(fail)` instead. `rendezvous`: a directory where `parties`
    engines meet before any applies (proves they were called concurrently).
    """

    fill: float
    fail: str | None = None
    rendezvous: str | None = None
    parties: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.fill, bool) or not isinstance(self.fill, (int, float)):
            raise TypeError(f"fill should be a number, got {self.fill!r}")


class FakeEngine(asyncwt.WeightTransferEngine[FakeInitInfo, FakeUpdateInfo]):
    """A worker engine whose rounds fill the model's parameters with a value."""

    init_info_cls = FakeInitInfo
    update_info_cls = FakeUpdateInfo

    RENDEZVOUS_TIMEOUT_S = 5.0

    def __init__(
        self,
        config: asyncwt.WeightTransferConfig,
        vllm_config: object | None,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.init_info: FakeInitInfo | None = None
        self.weight_version: str | None = None
        self.rounds_started = 0
        self.shut_down = False

    def init_transfer_engine(self, init_info: FakeInitInfo) -> None:
        self.init_info = init_info

    def start_weight_update(self) -> None:
        self.rounds_started += 1

    def receive_weights(self, update_info: FakeUpdateInfo) -> None:
        if update_info.rendezvous is not None:
            self._meet(Path(update_info.rendezvous), update_info.parties)
        if update_info.fail is not None:
            raise TransferAbortedError(update_info.fail)
        with torch.no_grad():
            for param in self.model.parameters():
                param.fill_(update_info.fill)

    def _meet(self, directory: Path, parties: int) -> None:
        """Arrive at `directory`, then wait until `parties` engines arrived there."""
        (directory / f"{os.getpid()}-{uuid.uuid4().hex}").touch()
        deadline = time.monotonic() + self.RENDEZVOUS_TIMEOUT_S
        while len(list(directory.iterdir())) < parties:
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"only {len(list(directory.iterdir()))} of {parties} engines arrived: "
                    "were they called one after the other?"
                )
            time.sleep(0.005)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.weight_version = weight_version

    def shutdown(self) -> None:
        self.shut_down = True


# Imported under two names (`_server_models` by pytest, `tests._server_models` by a
# subprocess) the module must not register twice.
if FAKE_BACKEND not in asyncwt.registered_backends()["worker"]:
    asyncwt.register_worker_engine(FAKE_BACKEND, FakeEngine)


# -- a naive deferred engine, for the round state machine's randomized test -------------

NAIVE_DEFERRED_BACKEND = "naive-deferred-test"


@dataclass
class NaiveInitInfo(asyncwt.WeightTransferInitInfo):
    """The trainer's id, as asyncwt's trainers send it."""

    trainer_id: str = ""


@dataclass
class NaiveUpdateInfo(asyncwt.WeightTransferUpdateInfo):
    """One update: every parameter takes `fill`, unless `fail_apply`: then the
    background apply writes the first parameter and fails (the weights are a mix)."""

    fill: float
    round_id: int | None = None
    trainer_id: str = ""
    fail_apply: bool = False


class NaiveDeferredEngine(asyncwt.WeightTransferEngine[NaiveInitInfo, NaiveUpdateInfo]):
    """Applies in the background and keeps no round state at all: one error slot that
    any drain consumes, a start that drops it, a finish that publishes what it is
    given. Only the worker's round state machine keeps its status honest."""

    init_info_cls = NaiveInitInfo
    update_info_cls = NaiveUpdateInfo
    defers_processing = True

    def __init__(
        self,
        config: asyncwt.WeightTransferConfig,
        vllm_config: object | None,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.weight_version: str | None = None
        self.weights_incomplete = False
        self._pending: list[Future[None]] = []
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="naive-apply")

    def init_transfer_engine(self, init_info: NaiveInitInfo) -> None:
        self.drain_quietly()

    def start_weight_update(self) -> None:
        self.drain_quietly()

    def receive_weights(self, update_info: NaiveUpdateInfo) -> None:
        self.weights_incomplete = True
        self._pending.append(self._executor.submit(self._apply, update_info))

    def _apply(self, info: NaiveUpdateInfo) -> None:
        with torch.no_grad():
            for index, param in enumerate(self.model.parameters()):
                if index == 1 and info.fail_apply:
                    raise RuntimeError(f"applying fill {info.fill} failed on purpose")
                param.fill_(info.fill)

    def drain_pending(self) -> None:
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise asyncwt.ApplyError(str(first))

    def drain_quietly(self) -> None:
        try:
            self.drain_pending()
        except asyncwt.ApplyError:
            pass

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.drain_pending()
        self.weight_version = weight_version
        self.weights_incomplete = False

    def shutdown(self) -> None:
        self.drain_quietly()
        self._executor.shutdown(wait=True)


if NAIVE_DEFERRED_BACKEND not in asyncwt.registered_backends()["worker"]:
    asyncwt.register_worker_engine(NAIVE_DEFERRED_BACKEND, NaiveDeferredEngine)
