"""The `"tcp"` chain, worker side: receive from a predecessor, forward to a successor.

Each worker keeps its authenticated link to the trainer as a control link (READY
out, ROUTE in) and listens, on its relay address, for the one predecessor that
feeds it. Every round:

1. the worker sends READY on the control link and reads its ROUTE: the successor's
   address (none for the tail) and the round's keys of its two edges;
2. it connects to its successor (the handshake of the trainer's link, proving the
   token with the outgoing edge's key, `edge_secret`, and the plan digest, both
   ways), then accepts its predecessor (the trainer itself for the head) on its
   listener: the one connection that proves the incoming edge's key, which only
   the trainer and the predecessor it named know (see `admission`);
3. it reads the round's stream from its predecessor: every chunk the socket hands
   over is sent on to the successor as it is (`Tee`), before anything else is
   done with it, and meanwhile lands where a star worker would put it. What goes
   on is what came in, byte for byte, never a transformed copy; headers and
   payload alike, so END and ABORT travel down the chain by themselves;
4. the round's relay connections close; the control link stays.

The update returns once END was received and forwarded, so a worker publishes
(at finish, after its drain) only what it applied and passed on. A broken relay
connection fails only this round (the trainer decides what comes next); a broken
control link needs a new init, as in the star.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from ..._core.errors import (
    AsyncwtError,
    ProtocolError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from ..._core.plan import TransferPlan
from ..._core.validate import MAX_HOST_CHARS, check_host
from ..._transports.base import LandingTarget, ReceivedBucket, ReceiverTransport
from ..._transports.link import WorkerLink, connect_link, read_abort_reason
from ..._transports.pool import ReceivePool
from ..._transports.sockio import recv_exact
from ..._transports.wire import EDGE_KEY_BYTES, FRAME_SIZE, Frame, FrameKind, edge_secret
from .admission import MAX_PENDING, Admission
from .receive import receive_buckets
from .settings import TcpWorkerInitInfo

__all__ = ["ChainReceiver", "Route", "Tee", "announce"]

_WILDCARDS = ("0.0.0.0", "::", "")
_KEYS = 2 * EDGE_KEY_BYTES


def announce(link: WorkerLink, member: int, host: str, port: int) -> None:
    """Tell the trainer this worker's member number and relay listener (LISTEN)."""
    payload = host.encode()
    link.send(Frame(FrameKind.LISTEN, 0, member, link.digest, len(payload), port), payload)


@dataclass(frozen=True)
class Route:
    """This worker's place in a round's chain, and the round's keys for its two edges:
    `key_in` admits its predecessor, `key_out` admits it at its successor's."""

    position: int
    successor: tuple[str, int] | None
    key_in: bytes
    key_out: bytes


def read_route(link: WorkerLink, round_id: int) -> Route:
    """Read this round's ROUTE from the control link; a stale ABORT is skipped, this
    round's is a `TransferAbortedError`. Every field is checked before use."""
    while True:
        frame = Frame.unpack(recv_exact(link.sock, FRAME_SIZE))
        if frame.kind == FrameKind.ABORT:
            reason = read_abort_reason(link.sock, frame)
            if frame.round_id < round_id:
                continue
            raise TransferAbortedError(
                f"round {round_id}: the trainer aborted the round before it began: {reason}",
                buckets_received=0,
            )
        if (
            frame.kind == FrameKind.ROUTE
            and frame.round_id < round_id
            and frame.nbytes <= _KEYS + MAX_HOST_CHARS
        ):
            recv_exact(link.sock, frame.nbytes)  # a round this worker gave up waiting for
            continue
        if frame.kind != FrameKind.ROUTE or frame.round_id != round_id:
            raise ProtocolError(
                f"round {round_id}: expected the round's ROUTE, got {frame.kind.name} for "
                f"round {frame.round_id}"
            )
        if frame.digest != link.digest:
            raise ProtocolError(f"round {round_id}: ROUTE for another plan")
        host_bytes = frame.nbytes - _KEYS
        if not 0 <= host_bytes <= MAX_HOST_CHARS or (frame.slot == 0) != (host_bytes == 0):
            raise ProtocolError(
                f"round {round_id}: ROUTE should carry {_KEYS} bytes of keys and a host of "
                f"1-{MAX_HOST_CHARS} bytes with a port, or the keys alone; got {frame.nbytes} "
                f"bytes and port {frame.slot}"
            )
        if frame.slot > 65535:
            raise ProtocolError(f"round {round_id}: ROUTE port {frame.slot} is out of range")
        payload = recv_exact(link.sock, frame.nbytes)
        key_in, key_out = payload[:EDGE_KEY_BYTES], payload[EDGE_KEY_BYTES:_KEYS]
        if frame.slot == 0:
            return Route(frame.index, None, key_in, key_out)
        host = payload[_KEYS:].decode("utf-8", "replace")
        try:
            check_host("ROUTE host", host)
        except ValueError as exc:
            raise ProtocolError(f"round {round_id}: {exc}") from None
        return Route(frame.index, (host, frame.slot), key_in, key_out)


class RelayListener:
    """Where a chain worker waits for its predecessor: bound for the engine's life,
    read only during a round; only the round's predecessor is admitted."""

    def __init__(self, bind: str, token: str, plan: TransferPlan) -> None:
        self.token = token
        self.digest = bytes.fromhex(plan.digest)
        self.sock = socket.create_server((bind, 0), backlog=MAX_PENDING)
        self.port: int = self.sock.getsockname()[1]
        self.admission = Admission(self.sock)

    def accept(
        self, control: WorkerLink, round_id: int, key: bytes, timeout: float, epoch: int
    ) -> socket.socket:
        """The predecessor's authenticated connection for `round_id`: the one that
        proves the round's key for this edge (`edge_secret`), which only the trainer
        and the predecessor it named hold.

        Waits at most `timeout` seconds; every other connection is refused or closed
        (see `Admission`). An ABORT of this round on the control link, or `abandon`
        since the round began (`epoch`), ends the wait (`TransferAbortedError`).
        """

        def on_control() -> None:
            with control.guard(round_id):  # only an ABORT (raised) may come now
                read_route(control, round_id)
                raise ProtocolError(f"round {round_id}: a second ROUTE for the round")

        secret = edge_secret(self.token, key)
        deadline = time.monotonic() + timeout
        conn = self.admission.run(secret, self.digest, deadline, control.sock, on_control, epoch)
        if conn is None:
            raise TransferTimeoutError(
                f"round {round_id}: no predecessor connected to this worker's relay "
                f"listener within connect_timeout={timeout}s"
            )
        return conn

    def close(self) -> None:
        self.admission.close()


class Tee:
    """A socket's reading side that forwards every byte it reads.

    `recvmsg_into` reads from `upstream` and, before it returns, sends the bytes it
    got to `downstream` (if any), straight from the buffers they landed in: cut-through
    at the granularity of what the socket hands over. The link code reads through it
    as through a socket.
    """

    def __init__(self, upstream: socket.socket, downstream: socket.socket | None) -> None:
        self.upstream = upstream
        self.downstream = downstream

    def recvmsg_into(self, buffers: Sequence[memoryview], *args: Any) -> Any:
        result = self.upstream.recvmsg_into(buffers, *args)
        left = result[0]
        if left and self.downstream is not None:
            for buffer in buffers:
                chunk = buffer[: min(left, buffer.nbytes)]
                self.downstream.sendall(chunk)
                left -= chunk.nbytes
                if not left:
                    break
        return result

    def settimeout(self, timeout: float | None) -> None:
        self.upstream.settimeout(timeout)
        if self.downstream is not None:
            self.downstream.settimeout(timeout)

    def shutdown(self, how: int) -> None:
        for sock in (self.upstream, self.downstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(how)

    def close(self) -> None:
        self.upstream.close()
        if self.downstream is not None:
            self.downstream.close()


class _RelayLink(WorkerLink):
    """The round's stream from the predecessor: READY went on the control link."""

    def send(self, frame: Frame, payload: bytes = b"") -> None:
        return None


RELAY_HOST_ENV = "ASYNCWT_RELAY_HOST"
"""Where a chain worker listens when its config names no `relay_host` (a vLLM
server's workers, say: set it to the address the server is bound to)."""


def relay_address(control: socket.socket, configured: str | None) -> tuple[str, str]:
    """`(bind, advertise)`: the configured relay host, else `$ASYNCWT_RELAY_HOST`
    (a wildcard binds everywhere and advertises the address the trainer is reached
    from), else the address the trainer is reached from."""
    reached_from = str(control.getsockname()[0])
    if configured is None and os.environ.get(RELAY_HOST_ENV):
        configured = os.environ[RELAY_HOST_ENV]
        check_host(RELAY_HOST_ENV, configured)
    if configured is None:
        return reached_from, reached_from
    if configured in _WILDCARDS:
        return configured, reached_from
    return configured, configured


class ChainReceiver(ReceiverTransport):
    """Receives each round from its predecessor and forwards it (see the module)."""

    def __init__(
        self,
        info: TcpWorkerInitInfo,
        plan: TransferPlan,
        pool: ReceivePool,
        relay_host: str | None,
    ) -> None:
        self.info = info
        self.plan = plan
        self.pool = pool
        self.relay_host = relay_host
        self.control: WorkerLink | None = None
        self.listener: RelayListener | None = None
        self._relays: list[socket.socket] = []
        """The relay connections of the round being received."""

    def connect(self) -> None:
        info = self.info
        sock = connect_link(info.host, info.port, info.token, self.plan, info.connect_timeout)
        try:
            bind, advertise = relay_address(sock, self.relay_host)
            self.listener = RelayListener(bind, info.token, self.plan)
            self.control = WorkerLink(sock, self.plan, info.recv_timeout)
            announce(self.control, max(info.member, 0), advertise, self.listener.port)
        except BaseException:
            self.close()
            sock.close()
            raise

    @property
    def usable(self) -> bool:
        return self.control is not None and not self.control.broken

    def receive_round(self, round_id: int, target: LandingTarget) -> Iterator[ReceivedBucket]:
        control, listener, info = self.control, self.listener, self.info
        assert control is not None and listener is not None
        epoch = listener.admission.stops  # an abandon from now on ends this round's wait
        control.sock.settimeout(info.recv_timeout)
        with control.guard(round_id):  # a broken control link needs a new init
            control.send(Frame(FrameKind.READY, round_id, 0, control.digest, 0, 0))
        route = self._route(control, round_id)
        downstream: socket.socket | None = None
        upstream: socket.socket | None = None
        try:
            if route.successor is not None:
                host, port = route.successor
                downstream = self._track(
                    connect_link(
                        host,
                        port,
                        edge_secret(info.token, route.key_out),
                        self.plan,
                        info.connect_timeout,
                        peer=f"the next worker in the chain (place {route.position + 1})",
                    )
                )
            upstream = self._track(
                listener.accept(control, round_id, route.key_in, info.connect_timeout, epoch)
            )
            stream = _RelayLink(Tee(upstream, downstream), self.plan, info.recv_timeout)  # type: ignore[arg-type]
            yield from receive_buckets(stream, self.plan, self.pool, round_id, target)
        finally:
            for sock in (upstream, downstream):
                if sock is not None:
                    sock.close()
            self._relays = []

    def _route(self, control: WorkerLink, round_id: int) -> Route:
        """This round's ROUTE. Waiting past `recv_timeout` fails the round but keeps the
        control link (a late ROUTE is skipped next round); anything else that breaks
        the link closes it (a new init is needed)."""
        try:
            return read_route(control, round_id)
        except TimeoutError:
            raise TransferTimeoutError(
                f"round {round_id}: no ROUTE from the trainer within recv_timeout="
                f"{control.recv_timeout}s; the round is off, the link to the trainer stays"
            ) from None
        except TransferAbortedError:
            raise
        except (OSError, AsyncwtError) as exc:
            control.close()
            raise TransferError(
                f"round {round_id}: the link to the trainer failed while waiting for the "
                f"round's ROUTE: {exc}; a new trainer_init (init_weight_transfer_engine) "
                f"reconnects"
            ) from exc

    def _track(self, sock: socket.socket) -> socket.socket:
        self._relays.append(sock)
        return sock

    def abandon(self) -> None:
        """End the older round at once: its wait for a predecessor (every pending
        connection closed), a forward blocked on a stalled successor, or a read on a
        stalled predecessor."""
        if self.listener is not None:
            self.listener.admission.stop("a newer round began")
        for sock in list(self._relays):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.abandon()
        if self.listener is not None:
            self.listener.close()
        if self.control is not None:
            self.control.close()
