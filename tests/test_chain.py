"""The `"tcp"` chain across real processes (issue 25): each byte leaves the trainer
once and every worker is bit-exact; with `on_worker_failure="drop"` a middle worker
killed at seeded points of a round is cut out and the round completes on the
survivors, who publish; with `"fail"` the same kills end in a typed error and
nobody publishes; a worker that joins between rounds is bit-exact after its first.
Nothing leaks (file descriptors, tasks, threads, here and in the survivors).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import _models
import anyio
import pytest
import torch
from _faults import (
    SMALL_TIMEOUTS,
    FaultySource,
    info_for,
    open_fds,
    read_line,
    round_wire_bytes,
    threads_in_asyncwt,
    wait_until,
    worker_env,
)

from asyncwt import (
    AsyncwtError,
    Chain,
    HttpClient,
    LocalClient,
    ModuleSource,
    ParamMeta,
    TcpTrainerInitInfo,
    Timeouts,
    WeightTransferConfig,
    model_checksum,
    trainer_init,
)
from asyncwt._backends.tcp.backend import TcpTrainerEngine
from asyncwt._backends.tcp.chain import ChainSender
from asyncwt._backends.tcp.fleet import TcpFleet
from asyncwt._backends.tcp.members import Members
from asyncwt._core.registry import create_worker_engine
from asyncwt._core.worker_api import WeightTransferEngine

SEED = 20261202
KILL_POINTS = 10
PARAMS = len(list(_models.mixed().parameters()))


class KillingSource(FaultySource):
    """Kills a process while the trainer iterates: before parameter `index`, after
    sleeping `pause` seconds (the round cannot end before the kill lands)."""

    def __init__(self, model: torch.nn.Module, sig: int = signal.SIGKILL) -> None:
        super().__init__(model)
        self.kill: tuple[int, float, int] | None = None
        self.sig = sig

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, pair in enumerate(super().iter_full()):
            if self.kill is not None and index == self.kill[0]:
                _, pause, pid = self.kill
                self.kill = None
                time.sleep(pause)
                os.kill(pid, self.sig)
            yield pair


class Worker:
    """One forked worker process: its pid and URL."""

    def __init__(self, pid: int, url: str) -> None:
        self.pid = pid
        self.url = url

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def gone(self) -> bool:
        return not os.path.exists(f"/proc/{self.pid}")


class Pool:
    """Forks `asyncwt worker` processes from one warm process (`_forker`)."""

    def __init__(self) -> None:
        self.forker = subprocess.Popen(
            [sys.executable, "-m", "_forker", "--model", "_models:mixed", "--backend", "tcp"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=worker_env(),
        )

    def take(self, fds: int = 0) -> Worker:
        """A fresh worker; `fds`: how many more descriptors it holds open."""
        assert self.forker.stdin is not None
        self.forker.stdin.write(f"fds={fds}\n" if fds else "\n")
        self.forker.stdin.flush()
        pid, url = read_line(self.forker, 120).split()  # type: ignore[arg-type]
        return Worker(int(pid), url)

    def close(self) -> None:
        assert self.forker.stdin is not None
        self.forker.stdin.close()
        self.forker.wait(30)
        assert self.forker.stdout is not None
        self.forker.stdout.close()


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    pool = Pool()
    try:
        yield pool
    finally:
        pool.close()


def chain_info(timeouts: Timeouts | None = None, **kwargs: object) -> TcpTrainerInitInfo:
    """A chain's info, `timeouts` defaulting to `SMALL_TIMEOUTS` with a shorter connect:
    a round stuck connecting to a stalled peer ends before the next round gives up
    waiting for it."""
    if timeouts is None:
        timeouts = dataclasses.replace(SMALL_TIMEOUTS, connect=1.5)
    info = info_for("tcp", fanout=Chain(), timeouts=timeouts, **kwargs)
    assert isinstance(info, TcpTrainerInitInfo)
    return info


def members_of(engine: Any) -> Members:
    """The engine's workers one by one, as its tcp fleet layer tracks them."""
    assert isinstance(engine.fleet, TcpFleet)
    return engine.fleet.members


def chain_of(engine: Any) -> list[str]:
    """The workers' URLs in chain order."""
    sender, members = engine.transport, members_of(engine)
    assert isinstance(sender, ChainSender)
    return [members.label(sender.listings[peer].member) for peer in sender.links.peers]


async def status(url: str) -> dict[str, object]:
    async with HttpClient(url) as client:
        (answer,) = await client.weights_status(checksum=True)
        return answer


async def assert_holds(urls: list[str], model: torch.nn.Module, version: str) -> None:
    expected = model_checksum(model)
    for url in urls:
        answer = await status(url)
        assert (answer["weight_version"], answer["checksum"]) == (version, expected), url
        assert answer["weights_incomplete"] is False


class Leaks:
    """This process's fds, tasks and asyncwt threads, and some workers' fds."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = dict(pids)
        self.fds = open_fds()
        self.tasks = asyncio.all_tasks()
        self.worker_fds = {url: open_fds(pid) for url, pid in pids.items()}

    def check(self, survivors: list[str], slack: int = 2) -> None:
        wait_until(lambda: not threads_in_asyncwt(), 10, "asyncwt threads to finish")
        assert asyncio.all_tasks() == self.tasks
        assert open_fds() <= self.fds + slack
        for url in survivors:
            pid = self.pids[url]
            assert open_fds(pid) <= self.worker_fds[url] + slack, url


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_chain_is_bit_exact_everywhere_and_the_trainer_sends_each_byte_once(
    pool: Pool,
) -> None:
    workers = [pool.take() for _ in range(3)]
    urls = [w.url for w in workers]
    model = _models.mixed()
    async with HttpClient(urls, timeout=20) as client:
        engine = await trainer_init(chain_info(), client=client, source=FaultySource(model))
        async with engine:
            assert isinstance(engine, TcpTrainerEngine)
            for round_ in range(3):
                _models.randomize(model, seed=round_)
                stats = await engine.send_weights(weight_version=f"v{round_}")
                assert stats.workers == 3 and stats.dropped == ()
                await assert_holds(urls, model, f"v{round_}")
            sender = engine.transport
            assert isinstance(sender, ChainSender)
            # The trainer's link carries the model once per round, whatever N is.
            assert sender.wire_bytes == 3 * round_wire_bytes(engine.plan, "tcp")
    for worker in workers:
        worker.kill()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_drop_cuts_out_a_middle_worker_killed_mid_round_and_a_joined_one_catches_up(
    pool: Pool,
) -> None:
    """Ten seeded kill points: each round completes on the two survivors, bit-exact,
    naming the dropped worker; a fresh worker then joins at the tail and is
    bit-exact after its first round."""
    live = {w.url: w for w in (pool.take() for _ in range(3))}
    rng = random.Random(SEED)
    model = _models.mixed()
    source = KillingSource(model)
    async with HttpClient(list(live), timeout=20) as client:
        engine = await trainer_init(
            chain_info(on_worker_failure="drop"), client=client, source=source
        )
        assert isinstance(engine, TcpTrainerEngine)
        async with engine:
            await engine.send_weights(weight_version="v0")
            for case in range(KILL_POINTS):
                chain = chain_of(engine)
                assert len(chain) == 3
                victim = chain[1]
                leaks = Leaks({url: w.pid for url, w in live.items()})
                source.kill = (rng.randrange(PARAMS), rng.uniform(0, 0.02), live[victim].pid)
                _models.randomize(model, seed=100 + case)
                with anyio.fail_after(20):
                    stats = await engine.send_weights(weight_version=f"d{case}")
                assert stats.dropped == (victim,)
                assert stats.workers == 2
                survivors = [url for url in chain if url != victim]
                await assert_holds(survivors, model, f"d{case}")
                wait_until(live.pop(victim).gone, 10, "the killed worker to go")
                leaks.check(survivors)
                # A worker joins between rounds: bit-exact after its first round.
                newcomer = pool.take()
                live[newcomer.url] = newcomer
                async with HttpClient(newcomer.url, timeout=20) as joining:
                    assert await engine.add_workers(joining) == 1
                assert chain_of(engine) == [*survivors, newcomer.url]
                _models.randomize(model, seed=200 + case)
                stats = await engine.send_weights(weight_version=f"j{case}")
                assert stats.dropped == () and stats.workers == 3
                await assert_holds(list(live), model, f"j{case}")
    for worker in live.values():
        worker.kill()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_fail_ends_the_round_with_a_typed_error_and_nobody_publishes(pool: Pool) -> None:
    """The same ten kill points with `on_worker_failure="fail"`: a typed error within
    the timeouts, and no survivor publishes the round."""
    live = {w.url: w for w in (pool.take() for _ in range(2))}
    rng = random.Random(SEED)
    model = _models.mixed()
    source = KillingSource(model)
    for case in range(KILL_POINTS):
        newcomer = pool.take()
        live[newcomer.url] = newcomer
        async with HttpClient(list(live), timeout=20) as client:
            engine = await trainer_init(chain_info(), client=client, source=source)
            assert isinstance(engine, TcpTrainerEngine)
            async with engine:
                _models.randomize(model, seed=300 + case)
                await engine.send_weights(weight_version=f"base{case}")
                published = model_checksum(model)
                victim = chain_of(engine)[1]
                source.kill = (rng.randrange(PARAMS), rng.uniform(0, 0.02), live[victim].pid)
                _models.randomize(model, seed=400 + case)
                with anyio.fail_after(15), pytest.raises(AsyncwtError):
                    await engine.send_weights(weight_version=f"killed{case}")
        wait_until(live.pop(victim).gone, 10, "the killed worker to go")
        for url in live:
            answer = await status(url)
            assert answer["weight_version"] == f"base{case}"
            assert answer["weights_incomplete"] or answer["checksum"] == published
    for worker in live.values():
        worker.kill()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_star_drop_cuts_out_a_killed_worker_too(pool: Pool) -> None:
    """`on_worker_failure="drop"` is no chain feature: a star drops the same way."""
    live = {w.url: w for w in (pool.take() for _ in range(3))}
    model = _models.mixed()
    source = KillingSource(model)
    info = info_for("tcp", on_worker_failure="drop", timeouts=SMALL_TIMEOUTS)
    async with HttpClient(list(live), timeout=20) as client:
        engine = await trainer_init(info, client=client, source=source)
        async with engine:
            await engine.send_weights(weight_version="v0")
            victim = list(live)[1]
            source.kill = (PARAMS // 2, 0.005, live[victim].pid)
            _models.randomize(model, seed=500)
            with anyio.fail_after(20):
                stats = await engine.send_weights(weight_version="v1")
            assert stats.dropped == (victim,) and stats.workers == 2
            survivors = [url for url in live if url != victim]
            await assert_holds(survivors, model, "v1")
    for url in survivors:
        live[url].kill()


# -- in one process: settings, the relay listener's admission, join's preconditions ------


def test_fanout_and_failure_policy_name_the_bad_value() -> None:
    with pytest.raises(ValueError, match=r"^fanout should be a Star or Chain, got 'chain'$"):
        TcpTrainerInitInfo(rank=0, fanout="chain")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_worker_failure should be one of .*got 'retry'"):
        TcpTrainerInitInfo(rank=0, on_worker_failure="retry")


@pytest.mark.asyncio
async def test_combinations_a_tracked_fleet_cannot_run_are_refused_at_init() -> None:
    with pytest.raises(
        ValueError, match=r"^delta=Delta\(.*\) cannot be combined with fanout=Chain\(\): "
    ):
        TcpTrainerInitInfo(rank=0, delta=True, fanout=Chain())
    with pytest.raises(
        ValueError, match=r"^delta=Delta\(.*\) cannot be combined with on_worker_failure='drop': "
    ):
        TcpTrainerInitInfo(rank=0, delta=True, on_worker_failure="drop")
    with pytest.raises(
        ValueError, match=r"^senders='owners' cannot be combined with on_worker_failure='drop': "
    ):
        TcpTrainerInitInfo(rank=0, senders="owners", on_worker_failure="drop")

    class Sharded(ModuleSource):  # a parameter rank 1 holds too: a drop's re-run would hang
        @functools.cached_property
        def metadata(self) -> list[ParamMeta]:
            return [
                dataclasses.replace(m, owners=(0, 1)) for m in ModuleSource(self._module).metadata
            ]

    info = TcpTrainerInitInfo(rank=0, on_worker_failure="drop")
    client = LocalClient(local_engines(1))
    with pytest.raises(ValueError, match=r"got 'drop' with parameter '.*' owned by ranks \(0, 1\)"):
        await trainer_init(info, client=client, source=Sharded(_models.mixed()))


def local_engines(count: int) -> list[WeightTransferEngine[Any, Any]]:
    config = WeightTransferConfig(backend="tcp")
    return [
        create_worker_engine(config, model=_models.mixed(), device=torch.device("cpu"))
        for _ in range(count)
    ]


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_stranger_at_a_relay_listener_is_refused_and_the_round_goes_on() -> None:
    engines = local_engines(2)
    model = _models.mixed()
    client = LocalClient(engines)
    # Strangers at the listener: each is refused or dropped, holding up no one.
    info = chain_info(dataclasses.replace(SMALL_TIMEOUTS, connect=10.0, recv=10.0))
    engine = await trainer_init(info, client=client, source=FaultySource(model))
    async with engine:
        listener = engines[1].receiver.listener  # type: ignore[attr-defined]
        strangers = []
        for payload in (b"GET / HTTP/1.0\r\n\r\n", bytes(200), b""):
            sock = socket.create_connection(("127.0.0.1", listener.port))
            sock.sendall(payload)
            strangers.append(sock)
        try:
            _models.randomize(model, seed=9)
            with anyio.fail_after(20):
                await engine.send_weights(weight_version="v1")
        finally:
            for sock in strangers:
                sock.close()
        for worker in engines:
            assert model_checksum(worker.model) == model_checksum(model)
    await client.shutdown()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_add_workers_needs_a_tracked_fleet() -> None:
    engines = local_engines(1)
    client = LocalClient(engines)
    engine = await trainer_init(
        info_for("tcp"), client=client, source=FaultySource(_models.mixed())
    )
    async with engine:
        assert isinstance(engine, TcpTrainerEngine)
        with pytest.raises(ValueError, match="add_workers needs a tracked fleet"):
            await engine.add_workers(LocalClient(local_engines(1)))
    await client.shutdown()


def _negate(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return -tensor


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_worker_forwards_what_it_received_not_what_its_transform_made() -> None:
    """A chain of a worker that negates every tensor it loads and one that does not:
    the plain one holds the trainer's weights bit-exact wherever it stands."""
    model = _models.mixed()
    for negating_first in (True, False):
        plain = local_engines(1)[0]
        negating = create_worker_engine(
            WeightTransferConfig(backend="tcp", transform=_negate),
            model=_models.mixed(),
            device=torch.device("cpu"),
        )
        order = [negating, plain] if negating_first else [plain, negating]
        client = LocalClient(order)
        engine = await trainer_init(chain_info(), client=client, source=FaultySource(model))
        async with engine:
            assert isinstance(engine, TcpTrainerEngine)
            members, sender = members_of(engine), engine.transport
            assert isinstance(members, Members) and isinstance(sender, ChainSender)

            def engine_of(peer: Any, members: Members = members, sender: Any = sender) -> Any:
                return members.members[sender.listings[peer].member].client.engines[0]

            # Put the chain in the order under test (admission order is a race).
            sender.links.peers.sort(key=lambda peer: order.index(engine_of(peer)))
            assert [engine_of(peer) for peer in sender.links.peers] == order
            _models.randomize(model, seed=11)
            await engine.send_weights(weight_version="v1")
            assert model_checksum(plain.model) == model_checksum(model)
            negated = _models.mixed()
            negated.load_state_dict({k: -v for k, v in model.state_dict().items()})
            assert model_checksum(negating.model) == model_checksum(negated)
        await client.shutdown()


STALL_POINTS = 2


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_drop_cuts_out_a_middle_worker_stopped_mid_round(pool: Pool) -> None:
    """A middle worker stopped (SIGSTOP) mid-round: the round fails within the
    timeouts, the stalled worker shows itself by not answering the next start within
    rpc_timeout, and the round completes on the survivors, naming it."""
    live = {w.url: w for w in (pool.take() for _ in range(2))}
    rng = random.Random(SEED + 1)
    model = _models.mixed()
    source = KillingSource(model, sig=signal.SIGSTOP)
    for case in range(STALL_POINTS):
        newcomer = pool.take()
        live[newcomer.url] = newcomer
        async with HttpClient(list(live), timeout=20) as client:
            info = chain_info(on_worker_failure="drop")
            engine = await trainer_init(info, client=client, source=source)
            assert isinstance(engine, TcpTrainerEngine)
            async with engine:
                await engine.send_weights(weight_version="v0")
                chain = chain_of(engine)
                victim = chain[1]
                source.kill = (rng.randrange(PARAMS), rng.uniform(0, 0.02), live[victim].pid)
                _models.randomize(model, seed=600 + case)
                with anyio.fail_after(30):
                    stats = await engine.send_weights(weight_version=f"s{case}")
                assert stats.dropped == (victim,)
                survivors = [url for url in chain if url != victim]
                await assert_holds(survivors, model, f"s{case}")
        stopped = live.pop(victim)
        stopped.kill()
        wait_until(stopped.gone, 10, "the stopped worker to go")
    for worker in live.values():
        worker.kill()


class KillThenFail(FaultySource):
    """While `failures` is positive, each iteration kills `victim` (if set) once the
    round is under way, then fails before yielding the first parameter: the round
    ends before the trainer sent any byte."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.victim: int | None = None
        self.failures = 0

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.failures:
            self.failures -= 1
            time.sleep(0.5)  # every worker is in the round
            if self.victim is not None:
                os.kill(self.victim, signal.SIGKILL)
                self.victim = None
                time.sleep(1.0)  # the trainer sees the worker go first
            raise RuntimeError("the source fails before its first parameter")
        yield from super().iter_full()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_chain_round_that_fails_before_any_byte_leaves_the_weights_complete(
    pool: Pool,
) -> None:
    """The chain's tail is killed once the round is under way, and the round fails
    before the trainer sent a byte: the middle worker's forward breaks, yet nothing
    landed, so the head and the middle keep the previous version complete
    (`weights_incomplete` false); the next round drops the dead tail and is
    bit-exact on both without a new trainer_init."""
    workers = [pool.take() for _ in range(3)]
    model = _models.mixed()
    source = KillThenFail(model)
    async with HttpClient([w.url for w in workers], timeout=20) as client:
        info = chain_info(on_worker_failure="drop")
        engine = await trainer_init(info, client=client, source=source)
        async with engine:
            _models.randomize(model, seed=700)
            await engine.send_weights(weight_version="v0")
            published = model_checksum(model)
            *survivors, tail = chain_of(engine)
            # The round runs again without the dead tail, and fails again the same way.
            source.victim, source.failures = next(w.pid for w in workers if w.url == tail), 2
            _models.randomize(model, seed=701)
            with anyio.fail_after(20), pytest.raises(RuntimeError, match=r"^the source fails"):
                await engine.send_weights(weight_version="never")
            held = []
            for url in survivors:
                answer = await status(url)
                held.append((answer["weight_version"], answer["weights_incomplete"]))
                assert answer["checksum"] == published, "no byte of the round was sent"
            assert held == [("v0", False), ("v0", False)]
            stats = await engine.send_weights(weight_version="v1")
            assert stats.workers == 2
            await assert_holds(survivors, model, "v1")
    for worker in workers:
        if worker.url != tail:
            worker.kill()
