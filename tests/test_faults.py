"""Fault injection across real processes: no hang, no silent half-update.

Each case breaks a round on purpose (the data connection cut at a random byte, a
peer killed or stopped, a cancellation, an apply that never returns) and checks
the same guarantees: the surviving side fails with a typed `AsyncwtError` within
its timeout; the worker publishes nothing (its `weight_version` stays, and
`weights_incomplete` says whether the model was touched); nothing leaks (file
descriptors, threads, tasks, shared-memory segments); and the next round (after
a new `trainer_init` where the connection broke) is bit-exact. Random choices are
seeded, so a failure replays.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _models
import anyio
import pytest
from _faults import (
    BACKENDS,
    SMALL_TIMEOUTS,
    FaultySource,
    ProxyClient,
    assert_worker_has,
    info_for,
    open_fds,
    read_line,
    round_wire_bytes,
    shm_leftovers,
    start_trainer,
    threads_in_asyncwt,
    wait_until,
    worker_env,
)

from asyncwt import (
    AsyncwtError,
    ControlPlaneError,
    HttpClient,
    ModuleSource,
    Timeouts,
    TransferError,
    model_checksum,
    trainer_init,
)
from asyncwt._worker.launch import start_worker, stop_worker, worker_process

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])

SEED = 20261129


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name: str = request.param
    yield name
    assert not shm_leftovers(), "shm leftovers"


@pytest.fixture(scope="module")
def worker(backend: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A `_models:mixed` worker of the backend under test, shared by the module."""
    proc, url = start_worker("_models:mixed", "--backend", backend, env=worker_env())
    try:
        yield proc, url
    finally:
        stop_worker(proc)


async def status_of(client: HttpClient) -> dict[str, Any]:
    (status,) = await client.weights_status(checksum=True)
    return status


def assert_nothing_published(status: dict[str, Any], version: str, checksum: str) -> None:
    """The failed round published nothing; the weights are the last version's unless
    `weights_incomplete` says the round touched them."""
    assert status["weight_version"] == version
    assert status["weights_incomplete"] or status["checksum"] == checksum


class LeakCheck:
    """This process's fds, asyncio tasks and asyncwt threads, and a worker's fds."""

    def __init__(self, worker_pid: int | None = None) -> None:
        self.worker_pid = worker_pid
        self.fds = open_fds()
        self.tasks = asyncio.all_tasks()
        self.worker_fds = open_fds(worker_pid) if worker_pid else 0

    def check(self, *, slack: int = 0) -> None:
        wait_until(lambda: not threads_in_asyncwt(), 10, "asyncwt threads to finish")
        assert asyncio.all_tasks() == self.tasks
        # Pooled HTTP connections may be dropped by a failed call: fewer is fine.
        assert open_fds() <= self.fds + slack
        if self.worker_pid:
            assert open_fds(self.worker_pid) <= self.worker_fds + slack
        assert not shm_leftovers()


# -- the data connection cut at random byte offsets -----------------------------------


CUT_OFFSETS = 30


@uvloop_only
async def test_data_connection_cut_at_random_offsets_fails_cleanly_and_recovers(
    backend: str, worker: tuple[subprocess.Popen[str], str]
) -> None:
    proc, url = worker
    rng = random.Random(SEED)
    errors: collections.Counter[str] = collections.Counter()
    async with ProxyClient(url, timeout=30) as client:
        model = _models.mixed()
        leaks: LeakCheck | None = None
        for i in range(CUT_OFFSETS):
            info = info_for(backend, timeouts=SMALL_TIMEOUTS)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=1000 + i)
                await engine.send_weights(weight_version=f"good-{i}")
                await assert_worker_has(client, model, f"good-{i}")
                good = model_checksum(model)
                assert client.proxy is not None
                offset = rng.randrange(round_wire_bytes(engine.plan, backend))
                client.proxy.arm(offset)
                _models.randomize(model, seed=2000 + i)
                started = time.monotonic()
                with anyio.fail_after(15), pytest.raises(AsyncwtError) as caught:
                    await engine.send_weights(weight_version=f"cut-{i}")
                errors[type(caught.value).__name__] += 1
                assert time.monotonic() - started < 10, f"offset {offset}: ended by a timeout"
                status = await status_of(client)
                # A cut before the round's first bytes landed (in a header, say) leaves
                # the weights `good` and complete; any later one says they are a mix.
                assert_nothing_published(status, f"good-{i}", good)
            client.close_proxy()
            if leaks is None:
                leaks = LeakCheck(proc.pid)  # steady state after one cut and recovery
        assert leaks is not None
        leaks.check(slack=1)
        # The last cut, too, is followed by a bit-exact round after a new init.
        engine = await trainer_init(info_for(backend), client=client, source=ModuleSource(model))
        async with engine:
            _models.randomize(model, seed=3000)
            await engine.send_weights(weight_version="after")
            await assert_worker_has(client, model, "after")
        client.close_proxy()
    assert sum(errors.values()) == CUT_OFFSETS
    print(f"{backend}: errors after a cut: {dict(errors)}")


# -- cancellation at random points ------------------------------------------------------


CANCEL_POINTS = 20


@uvloop_only
async def test_send_weights_cancelled_at_random_points_leaves_nothing_behind(
    backend: str, worker: tuple[subprocess.Popen[str], str]
) -> None:
    """Cancellation anywhere in a round: the round is aborted on the worker (or, if it
    came during finish, completed there), nothing leaks, and the next round works
    without a new init."""
    proc, url = worker
    rng = random.Random(SEED + 1)
    delay = 0.03  # per parameter: a round of ~0.25 s
    async with HttpClient(url) as client:
        model = _models.mixed()
        source = FaultySource(model)
        engine = await trainer_init(info_for(backend), client=client, source=source)
        async with engine:
            _models.randomize(model, seed=1)
            await engine.send_weights(weight_version="v0")
            leaks = LeakCheck(proc.pid)
            for i in range(1, CANCEL_POINTS + 1):
                good = model_checksum(model)
                source.delay = delay
                _models.randomize(model, seed=100 + i)
                cancel_after = rng.uniform(0.0, delay * 10)
                with anyio.fail_after(20):  # the cancelled round must end, not hang
                    with anyio.move_on_after(cancel_after) as scope:
                        await engine.send_weights(weight_version=f"cancelled-{i}")
                status = await status_of(client)
                if scope.cancelled_caught and status["weight_version"] != f"cancelled-{i}":
                    assert_nothing_published(status, f"v{i - 1}", good)
                else:  # cancelled during finish (or too late): the round completed
                    assert status["checksum"] == model_checksum(model)
                leaks.check(slack=1)
                source.delay = 0.0
                _models.randomize(model, seed=200 + i)
                await engine.send_weights(weight_version=f"v{i}")
                await assert_worker_has(client, model, f"v{i}")


# -- a peer killed or stopped mid-round -------------------------------------------------


async def wait_for_round_to_begin(client: HttpClient, timeout: float = 15) -> None:
    """Poll until the worker reports that the round started writing its weights."""
    with anyio.fail_after(timeout):
        while not (await status_of(client))["weights_incomplete"]:
            await anyio.sleep(0.02)


@uvloop_only
async def test_killed_worker_ends_the_round_with_an_error_and_a_new_worker_recovers(
    backend: str, worker: tuple[subprocess.Popen[str], str]
) -> None:
    proc, url = start_worker("_models:mixed", "--backend", backend, env=worker_env())
    try:
        async with HttpClient(url, timeout=20) as client:
            model = _models.mixed()
            source = FaultySource(model)
            engine = await trainer_init(
                info_for(backend, timeouts=SMALL_TIMEOUTS), client=client, source=source
            )
            async with engine:
                await engine.send_weights(weight_version="alive")
                leaks = LeakCheck()
                source.delay = 0.2
                started = time.monotonic()
                with anyio.fail_after(20):  # a hang fails here; the timeouts are 2-3 s
                    async with anyio.create_task_group() as tg:

                        async def kill_mid_round() -> None:
                            await wait_for_round_to_begin(client)
                            os.kill(proc.pid, signal.SIGKILL)

                        tg.start_soon(kill_mid_round)
                        with pytest.raises((TransferError, ControlPlaneError)) as caught:
                            await engine.send_weights(weight_version="killed")
                elapsed = time.monotonic() - started
                print(
                    f"{backend}: worker killed: {type(caught.value).__name__} after {elapsed:.2f}s"
                )
                assert elapsed < 10
                # The worker is gone: the next round fails at once too.
                with anyio.fail_after(10), pytest.raises((TransferError, ControlPlaneError)):
                    await engine.send_weights(weight_version="after")
            leaks.check()
    finally:
        stop_worker(proc)
    # Another worker in its place (the module's): a new trainer_init, a bit-exact round.
    async with HttpClient(worker[1]) as client:
        engine = await trainer_init(info_for(backend), client=client, source=source)
        async with engine:
            source.delay = 0.0
            _models.randomize(model, seed=7)
            await engine.send_weights(weight_version="replaced")
            await assert_worker_has(client, model, "replaced")


@uvloop_only
async def test_killed_trainer_leaves_the_worker_incomplete_and_a_new_trainer_recovers_it(
    backend: str, worker: tuple[subprocess.Popen[str], str]
) -> None:
    proc, url = worker
    async with HttpClient(url) as client:
        # Steady state first: one in-process round, so the worker's descriptors can be
        # compared after the recovery.
        model = _models.mixed()
        engine = await trainer_init(info_for(backend), client=client, source=ModuleSource(model))
        async with engine:
            await engine.send_weights(weight_version="warm")
            worker_fds = open_fds(proc.pid)
        trainer = start_trainer(url, backend)
        try:
            first = read_line(trainer, 60)
            assert read_line(trainer, 30) == "sending"
            checksum = json.loads(first)["checksum"]
            with anyio.fail_after(30):  # until the round's first buckets landed
                while (await status_of(client))["checksum"] == checksum:
                    await anyio.sleep(0.02)
            trainer.kill()
            trainer.wait(10)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait(10)
            assert trainer.stdout is not None
            trainer.stdout.close()
        status = await status_of(client)
        assert status["weight_version"] == "from-child"
        assert status["weights_incomplete"] is True
        # A new trainer re-inits the same worker process, and the round is bit-exact.
        engine = await trainer_init(info_for(backend), client=client, source=ModuleSource(model))
        async with engine:
            _models.randomize(model, seed=9)
            await engine.send_weights(weight_version="recovered")
            await assert_worker_has(client, model, "recovered")
            assert open_fds(proc.pid) <= worker_fds + 1
    assert not shm_leftovers()


@uvloop_only
async def test_stopped_worker_ends_the_round_within_its_timeouts_then_recovers(
    backend: str, worker: tuple[subprocess.Popen[str], str]
) -> None:
    """SIGSTOP mid-round: the trainer fails within its timeouts (a blocked send, a
    missing release, a collective, or an update RPC that never returns), and once
    the worker runs again a new init brings it back."""
    proc, url = worker
    try:
        async with HttpClient(url, timeout=20) as client:
            model = _models.mixed()
            source = FaultySource(model)
            engine = await trainer_init(
                info_for(backend, timeouts=SMALL_TIMEOUTS), client=client, source=source
            )
            async with engine:
                _models.randomize(model, seed=1)
                await engine.send_weights(weight_version="before")
                good = model_checksum(model)
                leaks = LeakCheck()
                source.delay = 0.05
                _models.randomize(model, seed=2)
                started = time.monotonic()
                with anyio.fail_after(20):
                    async with anyio.create_task_group() as tg:

                        async def stop_mid_round() -> None:
                            await wait_for_round_to_begin(client)
                            os.kill(proc.pid, signal.SIGSTOP)

                        tg.start_soon(stop_mid_round)
                        with pytest.raises(AsyncwtError) as caught:
                            await engine.send_weights(weight_version="stalled")
                elapsed = time.monotonic() - started
                os.kill(proc.pid, signal.SIGCONT)
                print(f"{backend}: worker stopped: {caught.value!r} after {elapsed:.2f}s")
            leaks.check()
            assert elapsed < 3 * SMALL_TIMEOUTS.rpc
            status = await status_of(client)
            assert_nothing_published(status, "before", good)
            engine = await trainer_init(info_for(backend), client=client, source=source)
            async with engine:
                source.delay = 0.0
                _models.randomize(model, seed=3)
                await engine.send_weights(weight_version="resumed")
                await assert_worker_has(client, model, "resumed")
    finally:
        os.kill(proc.pid, signal.SIGCONT)


# -- apply that never returns; an RPC that never returns --------------------------------


@uvloop_only
@pytest.mark.parametrize("staged", [False, True], ids=["unstaged", "staged"])
@pytest.mark.slow
async def test_stuck_apply_fails_finish_after_drain_timeout_naming_the_bucket(
    tmp_path: Path, staged: bool
) -> None:
    flag = tmp_path / "hang"
    env = worker_env(ASYNCWT_TEST_HANG=str(flag), ASYNCWT_TEST_HANG_S="2.5")
    args = ["--transform", "_models:hanging_transform", *(["--staged"] if staged else [])]
    with worker_process("_models:mixed", *args, env=env) as url:
        async with HttpClient(url) as client:
            model = _models.mixed()
            info = info_for("tcp", timeouts=Timeouts(drain=1.0, rpc=3.0))
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=1)
                await engine.send_weights(weight_version="good")
                good = model_checksum(model)
                flag.touch()
                _models.randomize(model, seed=2)
                started = time.monotonic()
                with pytest.raises(
                    ControlPlaneError,
                    match=r"HTTP 500: ApplyError: round 2, bucket \d+ \(parameters .*'w16'.*\): "
                    r"background apply did not finish within drain_timeout=1\.0s while "
                    r"draining \(\d+ bucket\(s\) unapplied\)",
                ):
                    await engine.send_weights(weight_version="stuck")
                assert time.monotonic() - started < 3.0
                status = await status_of(client)
                assert status["weight_version"] == "good"
                assert status["weights_incomplete"] is not staged
                if staged:  # the failed round never reached the model
                    assert status["checksum"] == good
                flag.unlink()
                # Until the stuck apply returns, a new round refuses to start (bounded);
                # then rounds work again without a new init.
                _models.randomize(model, seed=3)
                with anyio.fail_after(15):
                    while True:
                        try:
                            await engine.send_weights(weight_version="unstuck")
                            break
                        except ControlPlaneError as exc:
                            assert "background apply did not finish" in str(exc)
                await assert_worker_has(client, model, "unstuck")


class WedgedSyncClient:
    """A synchronous client over an in-process engine whose `update_weights`, once
    the round failed, does not return until released: an RPC wedged after an abort."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.release = threading.Event()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.engine.init_transfer_engine(self.engine.parse_init_info(init_info))

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        try:
            self.engine.update_weights(update_info)
        except Exception:
            self.release.wait(60)
            raise

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine.finish_weight_update(weight_version)


@uvloop_only
async def test_a_sync_client_wedged_after_an_abort_is_abandoned_after_rpc_timeout() -> None:
    from asyncwt import SourceMismatchError, WeightTransferConfig, create_worker_engine

    worker_model = _models.mixed()
    worker_engine = create_worker_engine(WeightTransferConfig(backend="tcp"), model=worker_model)
    client = WedgedSyncClient(worker_engine)
    model = _models.mixed()
    source = FaultySource(model)
    try:
        info = info_for("tcp", timeouts=Timeouts(rpc=1.0))
        engine = await trainer_init(info, client=client, source=source)
        async with engine:
            await engine.send_weights(weight_version="good")
            source.fault = lambda pairs: pairs[:-1]
            started = time.monotonic()
            with anyio.fail_after(10), pytest.raises(SourceMismatchError):
                await engine.send_weights(weight_version="broken")
            assert 1.0 <= time.monotonic() - started < 5.0  # rpc_timeout, not 60 s
            assert worker_engine.weight_version == "good"
            client.release.set()
            wait_until(lambda: not threads_in_asyncwt(), 10, "the abandoned RPC thread")
            source.fault = None
            _models.randomize(model, seed=4)
            await engine.send_weights(weight_version="after")
            assert model_checksum(worker_model) == model_checksum(model)
    finally:
        client.release.set()
        worker_engine.shutdown()


# -- a staged worker: a failed round never reaches the model ----------------------------


@uvloop_only
@pytest.mark.slow
async def test_staged_worker_keeps_its_previous_weights_when_the_connection_is_cut() -> None:
    rng = random.Random(SEED + 2)
    with worker_process("_models:mixed", "--staged", env=worker_env()) as url:
        async with ProxyClient(url) as client:
            model = _models.mixed()
            for i in range(10):
                engine = await trainer_init(
                    info_for("tcp"), client=client, source=ModuleSource(model)
                )
                async with engine:
                    _models.randomize(model, seed=10 + i)
                    await engine.send_weights(weight_version=f"good-{i}")
                    await assert_worker_has(client, model, f"good-{i}")
                    good = model_checksum(model)
                    assert client.proxy is not None
                    client.proxy.arm(rng.randrange(round_wire_bytes(engine.plan, "tcp")))
                    _models.randomize(model, seed=100 + i)
                    with anyio.fail_after(15), pytest.raises(AsyncwtError):
                        await engine.send_weights(weight_version=f"cut-{i}")
                    status = await status_of(client)
                    assert status["weight_version"] == f"good-{i}"
                    assert status["weights_incomplete"] is False
                    assert status["checksum"] == good  # untouched: the round was staged
                client.close_proxy()
