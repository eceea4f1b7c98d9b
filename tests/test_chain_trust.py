"""A chain worker's relay listener under attack, across real processes (issue 32):
a connection trickling a byte every 1.5 s, a worker process holding more than 1024
descriptors, and an impostor that holds the data-plane token (every worker does)
pre-connecting to the tail's listener to feed it a round of its own. After each,
every round completes bit-exact on every worker without a new trainer_init, and
SIGTERM stops the attacked worker promptly.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import _models
import anyio
import pytest
import torch
from _faults import FaultySource, wait_until
from test_chain import Pool, Worker, assert_holds, chain_info, chain_of

from asyncwt import (
    AsyncwtError,
    AuthenticationError,
    HttpClient,
    TransferAbortedError,
    trainer_init,
)
from asyncwt._backends.tcp.admission import MAX_PENDING, Admission
from asyncwt._backends.tcp.backend import TcpTrainerEngine
from asyncwt._backends.tcp.chain import ChainSender
from asyncwt._transports.sockio import recv_exact
from asyncwt._transports.wire import (
    CHALLENGE_SIZE,
    HELLO_SIZE,
    RESULT_SIZE,
    Frame,
    FrameKind,
    check_result,
    digest_prefix,
    edge_secret,
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


def _hello(address: tuple[str, int], digest: bytes) -> tuple[socket.socket, bytes]:
    """A connection that opened the link's handshake (HELLO sent); and its nonce."""
    nonce = secrets.token_bytes(32)
    sock = socket.create_connection(address, timeout=20)
    sock.sendall(pack_hello(nonce, digest))
    return sock, nonce


def _finish(sock: socket.socket, nonce: bytes, secret: str, digest: bytes) -> None:
    """The rest of the handshake, proving `secret`; a refusal raises."""
    theirs = verify_challenge(secret, nonce, digest, recv_exact(sock, CHALLENGE_SIZE))
    sock.sendall(pack_proof(secret, nonce, theirs, digest))
    check_result(recv_exact(sock, RESULT_SIZE))


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
        self.digest = bytes.fromhex(self.plan.digest)
        self.sock, self.nonce = _hello(listener_of(engine, place), self.digest)
        self.outcome: list[Exception | None] = []
        self.thread = threading.Thread(target=self._attack, daemon=True)
        self.thread.start()

    def _attack(self) -> None:
        prefix = digest_prefix(self.plan.digest)
        try:
            with self.sock as sock:
                _finish(sock, self.nonce, self.token, self.digest)
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


# -- in one process: the listener's admission loop ---------------------------------------


def _closed_by_peer(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class Running:
    """`Admission.run` in a thread; what it returned or raised lands in `result`."""

    def __init__(self, admission: Admission, secret: str, wait: float = 30.0) -> None:
        self.control, self._peer = socket.socketpair()  # a control link that stays quiet
        self.result: list[object] = []
        deadline = time.monotonic() + wait
        args = (secret, DIGEST, deadline, self.control, lambda: None, admission.stops)
        self.thread = threading.Thread(target=self._run, args=(admission, args), daemon=True)
        self.thread.start()

    def _run(self, admission: Admission, args: tuple[Any, ...]) -> None:
        try:
            self.result.append(admission.run(*args))
        except TransferAbortedError as exc:
            self.result.append(exc)

    def outcome(self) -> object:
        self.thread.join(10)
        self.control.close()
        self._peer.close()
        (result,) = self.result
        return result


DIGEST = bytes(32)


def _connect(port: int, first: bytes = b"A") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(first)
    return sock


def test_admission_caps_pending_and_closes_what_it_holds_on_abandon_and_close() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    admission = Admission(listener)
    try:
        running = Running(admission, "s")
        conns = [_connect(port) for _ in range(MAX_PENDING + 4)]
        # Past MAX_PENDING, the connections that waited longest are closed.
        wait_until(lambda: all(_closed_by_peer(c) for c in conns[:4]), 10, "the oldest dropped")
        assert not any(_closed_by_peer(c) for c in conns[4:])
        admission.stop("a newer round began")  # what abandon() does
        assert isinstance(running.outcome(), TransferAbortedError)
        wait_until(lambda: all(_closed_by_peer(c) for c in conns[4:]), 10, "every one closed")
        # The next run starts afresh and admits the peer that proves its secret.
        running = Running(admission, edge_secret("t", b"k"))
        peer = threading.Thread(target=lambda: conns.append(_prove(port, "t", b"k")))
        peer.start()
        peer.join(10)
        admitted = running.outcome()
        assert isinstance(admitted, socket.socket)
        admitted.close()
        # close() ends a running wait and the listener.
        running = Running(admission, "s")
        stranger = _connect(port)
        admission.close()
        assert isinstance(running.outcome(), TransferAbortedError)
        wait_until(lambda: _closed_by_peer(stranger), 10, "the stranger closed")
        assert listener.fileno() == -1
        conns.append(stranger)
    finally:
        admission.close()
        for conn in conns:
            conn.close()


def _prove(port: int, token: str, key: bytes) -> socket.socket:
    """Pass the relay handshake with the round's `key`, as a predecessor does."""
    sock, nonce = _hello(("127.0.0.1", port), DIGEST)
    _finish(sock, nonce, edge_secret(token, key), DIGEST)
    return sock


def test_a_burst_of_strangers_behind_the_predecessor_does_not_evict_it() -> None:
    """The predecessor connected (HELLO sent) before the wait began, then more than
    MAX_PENDING strangers: the one whose bytes are there is served first."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=4 * MAX_PENDING)
    port = listener.getsockname()[1]
    admission = Admission(listener)
    predecessor, nonce = _hello(("127.0.0.1", port), DIGEST)
    strangers = [_connect(port) for _ in range(MAX_PENDING + 8)]
    try:
        running = Running(admission, edge_secret("t", b"k"))
        _finish(predecessor, nonce, edge_secret("t", b"k"), DIGEST)
        admitted = running.outcome()
        assert isinstance(admitted, socket.socket)
        admitted.close()
    finally:
        admission.close()
        predecessor.close()
        for sock in strangers:
            sock.close()


def test_a_handshake_is_bounded_as_a_whole_not_per_read() -> None:
    """A connection that sends a byte every 0.3 s (each read makes progress) is
    dropped before it has sent a whole HELLO."""
    listener = socket.create_server(("127.0.0.1", 0))
    admission = Admission(listener)
    running = Running(admission, "s")
    sent = 0
    try:
        with _connect(listener.getsockname()[1]) as sock:
            sent = 1
            while not _closed_by_peer(sock) and sent < HELLO_SIZE:
                time.sleep(0.3)
                with contextlib.suppress(OSError):
                    sock.sendall(b"A")
                sent += 1
            assert sent < HELLO_SIZE
    finally:
        admission.close()
        running.outcome()
