"""SyncTrainerEngine: the blocking façade, against a worker server in another process."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import _models
import pytest
import torch

from asyncwt import HttpClient, ModuleSource, SyncTrainerEngine, TcpTrainerInitInfo
from asyncwt._core.checksum import model_checksum
from asyncwt._core.worker_api import WeightTransferConfig
from asyncwt._worker.launch import worker_process

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def worker_url() -> Iterator[str]:
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    with worker_process("_models:mixed", env=env) as url:
        yield url


def info() -> TcpTrainerInitInfo:
    return TcpTrainerInitInfo(rank=0, bucket_bytes=_models.BUCKET_BYTES)


class _StatusReader:
    """Reads the worker's status with a private client and loop (test side only)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __call__(self) -> dict[str, object]:
        import anyio

        async def read() -> dict[str, object]:
            async with HttpClient(self.url) as client:
                return (await client.weights_status(checksum=True))[0]

        return anyio.run(read)


def test_plain_loop_pushes_bit_exact_rounds(worker_url: str) -> None:
    model = _models.mixed()
    status = _StatusReader(worker_url)
    with SyncTrainerEngine(
        info(), client=HttpClient(worker_url), source=ModuleSource(model)
    ) as engine:
        for step in range(1, 3):
            _models.randomize(model, seed=step)
            stats = engine.send_weights(weight_version=f"sync-{step}")
            assert stats.round_id == step and stats.weight_version == f"sync-{step}"
            got = status()
            assert (got["weight_version"], got["checksum"]) == (
                f"sync-{step}",
                model_checksum(model),
            )


@pytest.mark.asyncio
async def test_refuses_to_run_inside_an_event_loop(worker_url: str) -> None:
    with pytest.raises(
        RuntimeError,
        match=r"^SyncTrainerEngine\.__init__ was called from inside a running event loop, where "
        r"it would block the loop; use the async engine instead: ",
    ):
        SyncTrainerEngine(
            info(), client=HttpClient(worker_url), source=ModuleSource(_models.mixed())
        )


class _InterruptingSource(ModuleSource):
    """Presses Ctrl-C (a real SIGINT to this process) after `after` tensors when armed."""

    def __init__(self, model: torch.nn.Module, after: int) -> None:
        super().__init__(model)
        self.after = after
        self.armed = False
        self.fired = 0
        """SIGINTs sent."""

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, pair in enumerate(super().iter_full()):
            if self.armed and index == self.after:
                os.kill(os.getpid(), signal.SIGINT)
                self.fired += 1
                threading.Event().wait(1.0)  # let the interrupt land mid-round
            yield pair


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler, whatever an earlier test left installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("default_sigint")
def test_ctrl_c_cancels_the_round_and_the_next_one_works(worker_url: str) -> None:
    model = _models.mixed()
    source = _InterruptingSource(model, after=3)
    status = _StatusReader(worker_url)
    with SyncTrainerEngine(info(), client=HttpClient(worker_url), source=source) as engine:
        _models.randomize(model, seed=1)
        engine.send_weights(weight_version="before")
        source.armed = True
        _models.randomize(model, seed=2)
        try:
            engine.send_weights(weight_version="interrupted")
        except KeyboardInterrupt:
            pass
        else:
            pytest.fail(
                f"send_weights returned without KeyboardInterrupt; SIGINTs sent: {source.fired}"
            )
        assert source.fired == 1
        assert status()["weight_version"] == "before"
        source.armed = False
        _models.randomize(model, seed=3)
        engine.send_weights(weight_version="after")
        got = status()
        assert (got["weight_version"], got["checksum"]) == ("after", model_checksum(model))
    assert not [t for t in threading.enumerate() if "asyncwt" in t.name.lower()]


def test_config_is_unchanged_by_the_wrapper() -> None:
    # The wrapper adds no options of its own: it takes exactly trainer_init's arguments.
    import inspect

    from asyncwt import trainer_init

    sync_params = list(inspect.signature(SyncTrainerEngine.__init__).parameters)[1:]
    assert sync_params == list(inspect.signature(trainer_init).parameters)
    assert WeightTransferConfig().backend == "tcp"
