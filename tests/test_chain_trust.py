"""A chain worker's relay listener under attack, across real processes (issue 32):
a connection trickling a byte every 1.5 s, a worker process holding more than 1024
descriptors, and an impostor that holds the data-plane token (every worker does)
pre-connecting to the tail's listener to feed it a round of its own. After each,
every round completes bit-exact on every worker without a new trainer_init, and
SIGTERM stops the attacked worker promptly.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator

import _models
import anyio
import pytest
import torch
from _faults import FaultySource, wait_until
from test_chain import Pool, Worker, assert_holds, chain_info, chain_of

from asyncwt import AsyncwtError, AuthenticationError, HttpClient, trainer_init
from asyncwt._transports.sockio import recv_exact
from asyncwt._transports.tcp.chain import ChainSender
from asyncwt._transports.tcp.trainer import TcpTrainerEngine
from asyncwt._transports.wire import (
    CHALLENGE_SIZE,
    RESULT_SIZE,
    Frame,
    FrameKind,
    check_result,
    digest_prefix,
    pack_hello,
    pack_proof,
    verify_challenge,
)

EXTRA_FDS = 1100
"""Descriptors a worker holds on top of its own: its sockets get numbers past 1023."""


@pytest.fixture(scope="module")
def pool() -> Iterator[Pool]:
    pool = Pool()
    try:
        yield pool
    finally:
        pool.close()


def listener_of(engine: TcpTrainerEngine, place: int) -> tuple[str, int]:
    """The relay listener of the worker at `place` in the chain, as it announced it."""
    sender = engine.transport
    assert isinstance(sender, ChainSender)
    listing = sender.listings[sender.links.peers[place]]
    return listing.host, listing.port


class Trickler:
    """Keeps one connection to `address` open, sending one byte every 1.5 s (and
    connecting again whenever the listener cuts it off)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.stopped = threading.Event()
        self.connections = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                with socket.create_connection(self.address, timeout=5) as sock:
                    self.connections += 1
                    while True:
                        sock.sendall(b"A")
                        if self.stopped.wait(1.5):
                            break
            except OSError:
                self.stopped.wait(0.1)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(10)


def stop_with_sigterm(worker: Worker) -> float:
    """SIGTERM `worker`; the seconds it took to exit (it must, within 10 s)."""
    started = time.monotonic()
    os.kill(worker.pid, signal.SIGTERM)
    wait_until(worker.gone, 10, "the worker to exit on SIGTERM")
    return time.monotonic() - started


async def rounds_hold(
    engine: TcpTrainerEngine, model: torch.nn.Module, urls: list[str], count: int, seed: int
) -> None:
    """`count` rounds of `model`, each completed by every worker (none dropped), bit-exact."""
    for round_ in range(count):
        _models.randomize(model, seed=seed + round_)
        with anyio.fail_after(20):
            stats = await engine.send_weights(weight_version=f"r{seed + round_}")
        assert stats.dropped == () and stats.workers == len(urls)
        await assert_holds(urls, model, f"r{seed + round_}")


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_trickling_connection_holds_up_no_round_and_no_sigterm(pool: Pool) -> None:
    """One trickler at each worker's relay listener: every round completes on both
    workers (on_worker_failure="drop" drops nobody), and SIGTERM ends the worker."""
    workers = [pool.take() for _ in range(2)]
    urls = [w.url for w in workers]
    model = _models.mixed()
    async with HttpClient(urls, timeout=20) as client:
        info = chain_info(on_worker_failure="drop")
        engine = await trainer_init(info, client=client, source=FaultySource(model))
        assert isinstance(engine, TcpTrainerEngine)
        async with engine:
            await rounds_hold(engine, model, urls, 1, seed=0)
            tricklers = [Trickler(listener_of(engine, place)) for place in (0, 1)]
            try:
                wait_until(lambda: all(t.connections for t in tricklers), 10, "tricklers")
                await rounds_hold(engine, model, urls, 3, seed=10)
                tail = {w.url: w for w in workers}[chain_of(engine)[1]]
                print(f"SIGTERM exit: {stop_with_sigterm(tail):.2f}s")
            finally:
                for trickler in tricklers:
                    trickler.stop()
    for worker in workers:
        if not worker.gone():
            worker.kill()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_chain_rounds_in_workers_holding_over_1024_descriptors(pool: Pool) -> None:
    """Relay sockets numbered past 1023 (a vLLM server holds that many): rounds work."""
    workers = [pool.take(fds=EXTRA_FDS) for _ in range(2)]
    assert all(len(os.listdir(f"/proc/{w.pid}/fd")) > EXTRA_FDS for w in workers)
    urls = [w.url for w in workers]
    model = _models.mixed()
    async with HttpClient(urls, timeout=20) as client:
        engine = await trainer_init(chain_info(), client=client, source=FaultySource(model))
        assert isinstance(engine, TcpTrainerEngine)
        async with engine:
            await rounds_hold(engine, model, urls, 2, seed=20)
            print(f"SIGTERM exit: {stop_with_sigterm(workers[1]):.2f}s")
    workers[0].kill()


class Impostor:
    """Holds the data-plane token and pre-connects to the relay listener at `place`
    (HELLO sent at once); once admitted, it streams the next round of its own: every
    bucket zeroed, then END. What ended its attempt lands in `outcome`."""

    def __init__(self, engine: TcpTrainerEngine, place: int) -> None:
        sender = engine.transport
        assert isinstance(sender, ChainSender)
        self.token = sender.links.settings.token
        self.plan = engine.plan
        self.round_id = engine._rounds + 1
        self.nonce = secrets.token_bytes(32)
        self.sock = socket.create_connection(listener_of(engine, place), timeout=20)
        self.sock.sendall(pack_hello(self.nonce, bytes.fromhex(self.plan.digest)))
        self.outcome: list[Exception | None] = []
        self.thread = threading.Thread(target=self._attack, daemon=True)
        self.thread.start()

    def _attack(self) -> None:
        digest, prefix = bytes.fromhex(self.plan.digest), digest_prefix(self.plan.digest)
        try:
            with self.sock as sock:
                challenge = recv_exact(sock, CHALLENGE_SIZE)
                nonce = verify_challenge(self.token, self.nonce, digest, challenge)
                sock.sendall(pack_proof(self.token, self.nonce, nonce, digest))
                check_result(recv_exact(sock, RESULT_SIZE))
                for bucket in self.plan.buckets:
                    size = bucket.payload_bytes
                    header = Frame(FrameKind.BUCKET, self.round_id, bucket.index, prefix, size)
                    sock.sendall(header.pack() + bytes(size))
                ends = len(self.plan.buckets)
                sock.sendall(Frame(FrameKind.END, self.round_id, ends, prefix, 0).pack())
            self.outcome.append(None)
        except (OSError, AsyncwtError) as exc:
            self.outcome.append(exc)


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_token_holding_impostor_is_refused_at_the_tails_relay(pool: Pool) -> None:
    """An impostor with the token pre-connects to the tail's listener before a round:
    the tail admits only the predecessor the trainer named for the round, so the
    impostor fails its handshake and every round stays bit-exact."""
    workers = [pool.take() for _ in range(2)]
    urls = [w.url for w in workers]
    model = _models.mixed()
    async with HttpClient(urls, timeout=20) as client:
        info = chain_info(on_worker_failure="drop")
        engine = await trainer_init(info, client=client, source=FaultySource(model))
        assert isinstance(engine, TcpTrainerEngine)
        async with engine:
            await rounds_hold(engine, model, urls, 1, seed=30)
            impostor = Impostor(engine, 1)
            try:
                await rounds_hold(engine, model, urls, 1, seed=31)
            finally:
                impostor.thread.join(30)
            (outcome,) = impostor.outcome
            assert isinstance(outcome, AuthenticationError), outcome
            await rounds_hold(engine, model, urls, 2, seed=32)
            tail = {w.url: w for w in workers}[chain_of(engine)[1]]
            print(f"SIGTERM exit: {stop_with_sigterm(tail):.2f}s")
    for worker in workers:
        if not worker.gone():
            worker.kill()
