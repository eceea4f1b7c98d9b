"""Harness shared by the security tests and the fuzz tests (test_security, test_fuzz).

- a fake trainer that answers a worker's HELLO with whatever a test chooses;
- the trainer's handshake fed raw bytes over a socket pair;
- a worker's frame reader (tcp or the shared ring over host buffers) fed a raw
  trainer → worker stream, with every header-sized read it asks for recorded;
- a valid round's stream, to break in one place;
- an event loop in a thread, for tests that are not coroutines (hypothesis drives
  its examples from a plain function).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import _models
import anyio
import torch

from asyncwt import (
    AuthenticationError,
    ModuleSource,
    PlanMismatchError,
    ProtocolError,
    TcpWorkerInitInfo,
    TransferError,
    TransferPlan,
)
from asyncwt._backends.shm.ring import RingReceiver
from asyncwt._backends.tcp.worker import TcpReceiver
from asyncwt._transports import link as _link
from asyncwt._transports import sockio as _sockio
from asyncwt._transports.link import LinkSettings, Peer, TrainerLinks, WorkerLink
from asyncwt._transports.pool import ReceivePool
from asyncwt._transports.wire import HELLO_SIZE, Frame, FrameKind, digest_prefix
from asyncwt._worker.applier import ModelTarget

T = TypeVar("T")

TOKEN = "t" * 32
EXPECTED = (ProtocolError, AuthenticationError, PlanMismatchError, TransferError)
"""What a bad input may end in (TransferError covers aborts, timeouts and EOF)."""

FIELDS = {  # offset, struct format of each frame-header field after the magic
    "kind": (4, "<B"),
    "reserved": (5, "<3s"),
    "round": (8, "<Q"),
    "index": (16, "<I"),
    "slot": (20, "<I"),
    "digest": (24, "<16s"),
    "nbytes": (40, "<Q"),
}
EXTREMES = [0, 1, 2, 3, 4, 5, 6, 255, 2**31, 2**32 - 1, 2**63, 2**64 - 1]
"""Integer field values at the edges: each frame kind, and the limits of u8/u32/u64."""


def small_plan() -> TransferPlan:
    """The plan of `_models.mixed()` in test-sized buckets (several buckets)."""
    return TransferPlan.build(
        ModuleSource(_models.mixed()).metadata, bucket_bytes=_models.BUCKET_BYTES
    )


# -- handshakes -------------------------------------------------------------------------


def recv_all(conn: socket.socket, nbytes: int) -> bytes:
    """Up to `nbytes`, until EOF or a reset (a peer closing with unread input resets)."""
    data = b""
    while len(data) < nbytes:
        try:
            chunk = conn.recv(nbytes - len(data))
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def fake_trainer(reply: Callable[[bytes], bytes]) -> tuple[int, threading.Thread]:
    """A listener that reads a HELLO and answers `reply(hello)`, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            listener.settimeout(10)
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    hello = recv_all(conn, HELLO_SIZE)
                    conn.sendall(reply(hello))
                    conn.shutdown(socket.SHUT_WR)
                    recv_all(conn, 1 << 16)  # until the worker closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def trainer_links(**overrides: Any) -> TrainerLinks:
    """The trainer's side of the links for `small_plan()`, with short timeouts."""
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "advertise_host": None,
        "token": TOKEN,
        "max_workers": 4,
        "connect_timeout": 5.0,
        "send_timeout": 2.0,
        "ready_timeout": 2.0,
        "max_pending_handshakes": 4,
        "handshake_timeout": 0.5,
    }
    settings.update(overrides)
    return TrainerLinks(LinkSettings(**settings), small_plan())


async def run_trainer_handshake(links: TrainerLinks, inbound: bytes) -> tuple[list[Peer], bytes]:
    """Feed `inbound` to the trainer's handshake (then EOF); what it admitted and said."""
    ours, theirs = socket.socketpair()
    peers: list[Peer] = []
    slots = anyio.Semaphore(1)
    await slots.acquire()
    try:
        theirs.sendall(inbound)
        theirs.shutdown(socket.SHUT_WR)
        with anyio.fail_after(5):
            await links._handshake(ours, "fuzz", peers, slots)
        theirs.settimeout(2)
        answer = recv_all(theirs, 1 << 16)
    finally:
        theirs.close()
    assert slots.value == 1  # the handshake slot came back
    return peers, answer


# -- the worker's frame reader ----------------------------------------------------------


def valid_round(plan: TransferPlan, round_id: int, payload: Callable[[int], bytes]) -> list[bytes]:
    """The trainer → worker stream of a valid round: [header, payload, header, ..., END].

    `payload(nbytes)` makes each bucket's payload bytes.
    """
    digest = digest_prefix(plan.digest)
    parts = []
    for bucket in plan.buckets:
        parts.append(
            Frame(FrameKind.BUCKET, round_id, bucket.index, digest, bucket.payload_bytes).pack()
        )
        parts.append(payload(bucket.payload_bytes))
    parts.append(Frame(FrameKind.END, round_id, len(plan.buckets), digest, 0).pack())
    return parts


@contextlib.contextmanager
def bounded_reads(limit: int) -> Iterator[list[int]]:
    """Record every `recv_exact` size the link asks for; fail one larger than `limit`."""
    sizes: list[int] = []
    original = _sockio.recv_exact

    def recording(sock: socket.socket, nbytes: int) -> bytes:
        sizes.append(nbytes)
        assert nbytes <= limit, f"asked to read {nbytes} bytes at once"
        return original(sock, nbytes)

    _link.recv_exact = recording  # type: ignore[attr-defined]
    try:
        yield sizes
    finally:
        _link.recv_exact = original  # type: ignore[attr-defined]


def receive(
    receiver: Any, target: ModelTarget, stream: bytes, sock: socket.socket, feed: socket.socket
) -> int:
    """Write `stream` (then EOF) from a thread while `receiver` reads round 1.

    Returns how many buckets the receiver yielded (if the round completes).
    """

    def write() -> None:
        with contextlib.suppress(OSError):
            feed.sendall(stream)
            feed.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    yielded = 0
    try:
        for received in receiver.receive_round(1, target):
            received.release()
            yielded += 1
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        writer.join(10)
    return yielded


class HostRing(RingReceiver):
    """The shared ring's receiver over two plain host buffers (no shared memory)."""

    def map_ring(self) -> list[torch.Tensor]:
        return [torch.empty(self.plan.bucket_bytes, dtype=torch.uint8) for _ in range(2)]


RING_SLOTS = 2
"""Slots of `HostRing` (a BUCKET header may name slot 0 or 1)."""


def frame_receiver(
    transport: str,
    plan: TransferPlan,
    model: torch.nn.Module,
    sock: socket.socket,
    pool: ReceivePool,
) -> tuple[Any, ModelTarget]:
    """A worker's receiver for `transport` ("tcp" or "ring") reading `sock`, and its target.

    The tcp receiver stages through `pool`; the ring receiver reads its own two slots
    (and copies out into `pool` for a target that hands out buffers).
    """
    info = TcpWorkerInitInfo(
        plan=plan.to_wire(), host="127.0.0.1", port=1, token=TOKEN, recv_timeout=2.0
    )
    if transport == "tcp":
        receiver: Any = TcpReceiver(info, plan, pool)
        receiver.link = WorkerLink(sock, plan, 2.0, slots=1)
        return receiver, ModelTarget.resolve(model, plan, None)
    receiver = HostRing(info, plan, lambda: pool)
    receiver.buffers = receiver.map_ring()
    receiver.link = WorkerLink(sock, plan, 2.0, slots=RING_SLOTS)
    return receiver, ModelTarget.resolve(model, plan, None, in_place=False)


# -- an event loop in a thread ----------------------------------------------------------


class LoopThread:
    """An asyncio loop running in a daemon thread; `run` waits for a coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coro` on the loop without waiting; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        """Run `coro` on the loop and wait (at most `timeout` seconds) for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Cancel what still runs, stop the loop and close it."""

        async def cancel_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        self.run(cancel_rest(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@contextlib.contextmanager
def loop_thread() -> Iterator[LoopThread]:
    """A `LoopThread` for the duration of the block."""
    looper = LoopThread()
    try:
        yield looper
    finally:
        looper.close()
