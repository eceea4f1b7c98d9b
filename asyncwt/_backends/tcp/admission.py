"""Admission at a chain worker's relay listener: many handshakes at once, each bounded.

The worker side is synchronous (vLLM calls `update_weights` from a thread), so the
listener cannot lean on the event loop. `Admission.run` drives every pending
connection's handshake from one `selectors` loop (epoll: no limit on descriptor
numbers, unlike `select()`): a connection only costs a few bytes of state while
it waits, a slow one never holds up a fast one, and each has `HANDSHAKE_S` for
its whole handshake, not per read. At most `MAX_PENDING` wait at once: past
that, one that has not sent a whole HELLO goes first, then the one idle longest,
so a flood of strangers does not push out the predecessor, whose bytes come at
once and are read before newcomers are taken in. The control link is watched meanwhile (an ABORT of
the round ends the wait), and so is a wake-up pair that `abandon` and `close`
write to from other threads. Every connection not admitted is closed on the way
out, whatever ends the wait.
"""

from __future__ import annotations

import contextlib
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable

from ..._core.errors import AsyncwtError, TransferAbortedError
from ..._transports.wire import (
    HELLO_SIZE,
    PROOF_SIZE,
    HandshakeStatus,
    pack_challenge,
    pack_result,
    proof_is_valid,
    unpack_hello,
)

__all__ = ["HANDSHAKE_S", "MAX_PENDING", "Admission", "Handshake"]

HANDSHAKE_S = 2.0
"""Seconds a connection has for its whole handshake: a real peer needs two round trips."""
MAX_PENDING = 32
"""Connections whose handshake may be in flight at once."""


class Handshake:
    """The listening side of one connection's handshake on a non-blocking socket,
    advanced each time the socket is readable.

    `feed` returns None while more bytes are needed, True once the peer proved
    `secret` and the plan `digest` (RESULT OK sent), False when it failed.
    """

    def __init__(self, sock: socket.socket, secret: str, digest: bytes, deadline: float) -> None:
        self.sock = sock
        self.secret = secret
        self.digest = digest
        self.deadline = deadline
        self._buffer = b""
        self._hello: tuple[bytes, bytes] | None = None
        self._own = secrets.token_bytes(32)
        self.touched = time.monotonic()
        """When the peer last sent something."""

    def rank(self) -> tuple[bool, float]:
        """The lowest goes first when the listener is full: one that has not sent a
        whole HELLO yet before one that has, then the one idle the longest."""
        return self._hello is not None, self.touched

    def feed(self) -> bool | None:
        data = self.sock.recv(HELLO_SIZE + PROOF_SIZE)
        if not data:
            return False
        self.touched = time.monotonic()
        self._buffer += data
        if self._hello is None:
            if len(self._buffer) < HELLO_SIZE:
                return None
            hello, self._buffer = self._buffer[:HELLO_SIZE], self._buffer[HELLO_SIZE:]
            self._hello = unpack_hello(hello)
            self._send(pack_challenge(self.secret, self._hello[0], self._own, self.digest))
        if len(self._buffer) < PROOF_SIZE:
            return None
        if len(self._buffer) > PROOF_SIZE:
            return False  # a real peer waits for RESULT before it sends anything else
        nonce, peer_digest = self._hello
        if not proof_is_valid(self.secret, nonce, self._own, self.digest, self._buffer):
            status = HandshakeStatus.BAD_PROOF
        elif peer_digest != self.digest:
            status = HandshakeStatus.PLAN_MISMATCH
        else:
            status = HandshakeStatus.OK
        self._send(pack_result(status))
        return status == HandshakeStatus.OK

    def _send(self, data: bytes) -> None:
        """A peer that follows the handshake reads everything before it writes again,
        so its socket takes these few bytes at once; one that does not is dropped."""
        if self.sock.send(data) != len(data):
            raise ConnectionError("the peer does not read its handshake")


class Admission:
    """Serves a listener's pending handshakes concurrently (see the module)."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.listener.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # stops unread pile up to a full buffer, no further
        self._lock = threading.Lock()
        self.stops = 0
        """How many times `stop` ran: a wait begun at `epoch=stops` ends at the next."""
        self._why = ""
        self._closed = False
        self._running = False
        """Whether `run` is under way (it then closes the sockets once `close` ran)."""

    def run(
        self,
        secret: str,
        digest: bytes,
        deadline: float,
        control: socket.socket,
        on_control: Callable[[], None],
        epoch: int,
    ) -> socket.socket | None:
        """The first connection that proves `secret` (a blocking socket), or None at
        `deadline`. `on_control` runs when `control` is readable (it raises to end
        the wait). A `stop` (or `close`) after `stops` read `epoch` ends it with
        `TransferAbortedError`, even one that came before the wait began."""
        with self._lock:
            self._drain_wake()
            if self._closed or self.stops != epoch:
                raise self._stopped_error()
            self._running = True
        pending: dict[socket.socket, Handshake] = {}
        selector = selectors.DefaultSelector()
        try:
            for sock in (self.listener, control, self._wake_r):
                selector.register(sock, selectors.EVENT_READ)
            while True:
                now = time.monotonic()
                for conn in [c for c, h in pending.items() if h.deadline <= now]:
                    _drop(selector, pending, conn)
                if now >= deadline:
                    return None
                wait = min([deadline, *(h.deadline for h in pending.values())]) - now
                ready: list[socket.socket] = []
                for key, _ in selector.select(wait):
                    if key.fileobj is self._wake_r:
                        raise self._stopped_error()
                    if key.fileobj is control:
                        on_control()
                    elif isinstance(key.fileobj, socket.socket):
                        ready.append(key.fileobj)
                # The connections already pending first, then the newcomers.
                admitted = _advance(selector, pending, [s for s in ready if s in pending])
                if admitted is None and self.listener in ready:
                    taken = self._accept(selector, pending, secret, digest)
                    admitted = _advance(selector, pending, taken)
                if admitted is not None:
                    return admitted
        finally:
            for conn in pending:
                conn.close()
            selector.close()
            with self._lock:
                self._running = False
                if self._closed:
                    self._release()

    def _accept(
        self,
        selector: selectors.BaseSelector,
        pending: dict[socket.socket, Handshake],
        secret: str,
        digest: bytes,
    ) -> list[socket.socket]:
        """Take the connections waiting in the backlog (to be read at once: a real
        peer's HELLO is there already); past `MAX_PENDING`, the lowest `rank` goes."""
        taken: list[socket.socket] = []
        while len(taken) < MAX_PENDING:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break  # a connection reset before it was taken, or descriptors ran out
            conn.setblocking(False)
            if len(pending) >= MAX_PENDING:
                _drop(selector, pending, min(pending.values(), key=Handshake.rank).sock)
            pending[conn] = Handshake(conn, secret, digest, time.monotonic() + HANDSHAKE_S)
            selector.register(conn, selectors.EVENT_READ)
            taken.append(conn)
        return taken

    def _drain_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(64):
                pass

    def _stopped_error(self) -> TransferAbortedError:
        return TransferAbortedError(
            f"the relay listener stopped waiting: {self._why}", buckets_received=0
        )

    def stop(self, why: str) -> None:
        """End the running `run`, or the one of the current epoch (from any thread)."""
        with self._lock:
            self.stops += 1
            self._why = why
            if not self._closed:
                with contextlib.suppress(OSError):  # BlockingIOError: one is unread already
                    self._wake_w.send(b"x")

    def close(self) -> None:
        """End a running `run` for good and close the listener."""
        self.stop("the engine shut down")
        with self._lock:
            self._closed = True
            if not self._running:
                self._release()

    def _release(self) -> None:
        self.listener.close()
        self._wake_w.close()
        self._wake_r.close()


def _advance(
    selector: selectors.BaseSelector,
    pending: dict[socket.socket, Handshake],
    ready: list[socket.socket],
) -> socket.socket | None:
    """Step the handshakes of `ready`: the first admitted connection (made blocking),
    else None; each that failed is dropped."""
    for conn in ready:
        if conn not in pending:
            continue  # dropped meanwhile
        outcome = _step(pending[conn])
        if outcome is False:
            _drop(selector, pending, conn)
        elif outcome:
            selector.unregister(conn)
            del pending[conn]
            conn.setblocking(True)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn
    return None


def _step(handshake: Handshake) -> bool | None:
    """Advance one handshake: True admitted, False failed, None not done yet."""
    try:
        return handshake.feed()
    except (BlockingIOError, InterruptedError):
        return None
    except (OSError, AsyncwtError):
        return False  # a stranger, or a connection left over from another round


def _drop(
    selector: selectors.BaseSelector, pending: dict[socket.socket, Handshake], conn: socket.socket
) -> None:
    with contextlib.suppress(KeyError, ValueError, OSError):
        selector.unregister(conn)
    pending.pop(conn, None)
    conn.close()
