"""The authenticated, framed stream connection between a trainer and each worker.

The TCP backend carries its payload on it; the shared-memory backend carries only
frame headers and slot releases on it (the payload sits in shared memory). Either
way the trainer listens during init only, and every worker proves the token with
the challenge–response in `asyncwt._transports.wire` before it is admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import anyio

from .._core.concurrency import single_error
from .._core.errors import (
    AsyncwtError,
    ProtocolError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from .._core.plan import Bucket, TransferPlan
from .base import (
    InitWorkers,
    LandingTarget,
    ReceiveBuffers,
    ReceivedBucket,
    ReceiverTransport,
    Segment,
    SenderTransport,
    Settle,
)
from .sockio import async_recv_exact, async_send_segments, recv_exact, send_all
from .wire import (
    ABORT_REASON_MAX,
    CHALLENGE_SIZE,
    FRAME_SIZE,
    HELLO_SIZE,
    PROOF_SIZE,
    RESULT_SIZE,
    Frame,
    FrameKind,
    HandshakeStatus,
    check_result,
    digest_prefix,
    pack_challenge,
    pack_hello,
    pack_proof,
    pack_result,
    proof_is_valid,
    unpack_hello,
    verify_challenge,
)

__all__ = [
    "FrameCodec",
    "LinkSettings",
    "LinkedReceiver",
    "LinkedSender",
    "Peer",
    "TrainerLinks",
    "WorkerLink",
    "connect_link",
    "read_abort_reason",
]

logger = logging.getLogger("asyncwt")


@dataclass(frozen=True)
class LinkSettings:
    """What the trainer side of the links needs to know."""

    host: str
    port: int
    advertise_host: str | None
    token: str
    max_workers: int
    connect_timeout: float
    send_timeout: float
    ready_timeout: float
    max_pending_handshakes: int = 16
    handshake_timeout: float = 10.0


@dataclass(eq=False)
class Peer:
    """One authenticated worker connection (trainer side)."""

    sock: socket.socket
    address: str
    broken: str | None = None
    reads_directly: bool = False
    """Whether its last READY said it reads buckets from this process's memory
    (BUCKET_AT frames, same host) rather than from a shared ring."""
    held: int = 0
    """What its last READY said it holds (the frame's `index`, 32 bits): opaque to
    the link, 0 unless a codec layer above declared it reads it (`accept_held`)."""

    def close(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class TrainerLinks:
    """The trainer's connections to every worker, and frame I/O over all of them."""

    def __init__(self, settings: LinkSettings, plan: TransferPlan) -> None:
        self.settings = settings
        self.plan = plan
        self.digest = digest_prefix(plan.digest)
        self.peers: list[Peer] = []
        self.round_id = 0
        self.direct_reads = False
        """Whether workers may read buckets from this process's memory: READY's
        `slot` 1 says a worker does (see `Peer.reads_directly`)."""
        self.carries_held = False
        """Whether READY may carry a held value (`Peer.held`); see `accept_held`."""

    def accept_held(self) -> None:
        """Let READY carry a nonzero held value from now on: a codec layer above the
        link reads it from `Peer.held` (without one, it is a protocol error)."""
        self.carries_held = True

    # -- init -------------------------------------------------------------------------

    async def rendezvous(
        self,
        worker_fields: dict[str, Any],
        init_workers: Callable[[dict[str, Any]], Awaitable[None]],
    ) -> None:
        """Listen, run `init_workers(init_info)` while admitting workers, stop listening.

        Cancellation: the listener and every accepted connection are closed.
        """
        s = self.settings
        listener = socket.create_server((s.host, s.port), backlog=128)
        listener.setblocking(False)
        peers: list[Peer] = []
        try:
            port = listener.getsockname()[1]
            init_info = {"host": s.advertise_host or s.host, "port": port, "token": s.token}
            init_info.update(worker_fields)
            with single_error():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._accept, listener, peers)
                    await init_workers(init_info)
                    tg.cancel_scope.cancel()
        except BaseException:
            for peer in peers:
                peer.close("init failed")
            raise
        finally:
            listener.close()
        if not peers:
            raise TransferError(
                "no worker connected during init_weight_transfer_engine; check that the "
                f"workers can reach {s.advertise_host or s.host}"
            )
        logger.info("asyncwt: %d worker(s) connected and authenticated", len(peers))
        self.peers = peers

    async def _accept(self, listener: socket.socket, peers: list[Peer]) -> None:
        """Accept connections and authenticate each in its own task.

        At most `max_pending_handshakes` handshakes run at once. When that many are in
        flight and one more connection comes, the handshake that has waited longest
        on its peer (for the worker's HELLO or PROOF, which a real worker sends at
        once) is dropped to make room: a flood of idle or stalled connections only
        evicts its own, and a worker whose bytes are there is never kept waiting
        behind them. While every handshake is busy on this side, the listener is not
        read, so further connections wait in the kernel's backlog instead of costing
        this process a descriptor and a task each.
        """
        loop = asyncio.get_running_loop()
        slots = anyio.Semaphore(self.settings.max_pending_handshakes)
        waiting: dict[anyio.CancelScope, None] = {}
        """Handshakes waiting on their peer, the longest-waiting first."""
        async with anyio.create_task_group() as tg:
            while True:
                sock, address = await loop.sock_accept(listener)
                try:
                    if slots.value == 0 and waiting:
                        victim = next(iter(waiting))
                        del waiting[victim]
                        victim.cancel()  # its task releases its slot and closes its socket
                    await slots.acquire()
                except BaseException:
                    sock.close()
                    raise
                scope = anyio.CancelScope()
                where = f"{address[0]}:{address[1]}"
                tg.start_soon(self._handshake, sock, where, peers, slots, scope, waiting)

    async def _handshake(
        self,
        sock: socket.socket,
        address: str,
        peers: list[Peer],
        slots: anyio.Semaphore,
        scope: anyio.CancelScope | None = None,
        waiting: dict[anyio.CancelScope, None] | None = None,
    ) -> None:
        """Authenticate one worker; a failure refuses it without stopping init.

        Bounded by `handshake_timeout`, and cancelled through `scope` when a newer
        connection needs its slot while it waits on its peer; every outcome other
        than admission closes the connection. Never raises: a misbehaving peer must
        not end the rendezvous.
        """
        loop = asyncio.get_running_loop()
        s = self.settings
        digest = bytes.fromhex(self.plan.digest)
        registered = answered = False
        scope = anyio.CancelScope() if scope is None else scope
        waiting = {} if waiting is None else waiting

        async def from_peer(nbytes: int) -> bytes:
            waiting[scope] = None  # the newest to be evicted
            try:
                return await async_recv_exact(sock, nbytes)
            finally:
                waiting.pop(scope, None)

        try:
            with scope:
                sock.setblocking(False)
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with anyio.fail_after(min(s.handshake_timeout, s.connect_timeout)):
                    worker_nonce, worker_digest = unpack_hello(await from_peer(HELLO_SIZE))
                    trainer_nonce = secrets.token_bytes(32)
                    challenge = pack_challenge(s.token, worker_nonce, trainer_nonce, digest)
                    await loop.sock_sendall(sock, challenge)
                    proof = await from_peer(PROOF_SIZE)
                    if not proof_is_valid(s.token, worker_nonce, trainer_nonce, digest, proof):
                        status = HandshakeStatus.BAD_PROOF
                    elif worker_digest != digest:
                        status = HandshakeStatus.PLAN_MISMATCH
                    elif len(peers) >= s.max_workers:
                        status = HandshakeStatus.FULL
                    else:
                        status = HandshakeStatus.OK
                        peer = Peer(sock, address)
                        peers.append(peer)  # before the await: concurrent handshakes count it
                        registered = True
                    await loop.sock_sendall(sock, pack_result(status))
                    if status != HandshakeStatus.OK:
                        logger.warning("asyncwt: refused worker %s: %s", address, status.name)
                    answered = True
            if scope.cancelled_caught:
                logger.warning(
                    "asyncwt: dropped the handshake with %s: it waited longest on its peer "
                    "while max_pending_handshakes=%d were in flight",
                    address,
                    s.max_pending_handshakes,
                )
        except (TimeoutError, OSError, AsyncwtError) as exc:
            logger.warning("asyncwt: handshake with %s failed: %r", address, exc)
        finally:
            waiting.pop(scope, None)
            slots.release()
            if registered and not answered:  # failed or cancelled before the worker knew
                peers.remove(peer)
                registered = False
            if not registered:
                sock.close()

    # -- rounds -----------------------------------------------------------------------

    def check_usable(self) -> None:
        for peer in self.peers:
            if peer.broken is not None:
                raise TransferError(
                    f"the connection to worker {peer.address} is closed ({peer.broken}); "
                    f"call trainer_init again to reconnect"
                )

    async def each(
        self,
        fn: Callable[..., Coroutine[Any, Any, None]],
        *args: Any,
        among: list[Peer] | None = None,
    ) -> None:
        """Run `fn(peer, *args)` for every peer (or every peer `among`) concurrently.

        A single peer's call is awaited in place: on loopback the sending thread's
        Python bounds a round, and a task group per bucket was a measurable share of it.
        """
        peers = self.peers if among is None else among
        if len(peers) == 1:
            await fn(peers[0], *args)
            return
        with single_error():
            async with anyio.create_task_group() as tg:
                for peer in peers:
                    tg.start_soon(fn, peer, *args)

    async def send_frame(self, peer: Peer, segments: list[memoryview], what: str) -> None:
        """Send one whole frame, or break the connection: never leave it mid-frame.

        Shielded from cancellation (a half-sent frame would desynchronise the
        stream) and bounded by `send_timeout` instead.
        """
        timeout = self.settings.send_timeout
        # One scope does both (a scope per frame is a measurable share of a bucket's
        # Python): shielded from the caller's cancellation, cancelled at its deadline.
        with anyio.CancelScope(shield=True, deadline=anyio.current_time() + timeout) as scope:
            try:
                await async_send_segments(peer.sock, segments)
            except TransferError as exc:
                peer.close(str(exc))
                raise TransferError(
                    f"round {self.round_id}: sending {what} to worker {peer.address} failed: {exc}"
                ) from exc
        if scope.cancelled_caught:
            peer.close(f"timed out sending {what}")
            raise TransferTimeoutError(
                f"round {self.round_id}: worker {peer.address} did not take {what} within "
                f"timeouts.send={timeout}s"
            )

    async def send_header(self, peer: Peer, frame: Frame, what: str) -> None:
        await self.send_frame(peer, [memoryview(frame.pack())], what)

    async def wait_ready(
        self, round_id: int, on_release: Callable[[Peer, Frame], None] | None = None
    ) -> None:
        """Wait for every worker's READY for `round_id` (stale READYs are skipped).

        RELEASE frames that arrive meanwhile go to `on_release` (shared memory).
        """
        self.round_id = round_id
        await self.each(self._wait_ready_one, round_id, on_release)

    def check_from_worker(self, peer: Peer, frame: Frame) -> Frame:
        """Validate a worker → trainer frame (READY, RELEASE): they carry no payload."""
        if frame.kind not in (FrameKind.READY, FrameKind.RELEASE):
            raise self.protocol_error(
                peer, f"sent a {frame.kind.name} frame, which only the trainer sends"
            )
        if frame.nbytes != 0:
            raise self.protocol_error(
                peer,
                f"sent a {frame.kind.name} frame announcing {frame.nbytes} payload bytes; it has none",
            )
        if frame.digest != self.digest:
            raise self.protocol_error(
                peer, f"sent a {frame.kind.name} frame for another plan ({frame.digest.hex()})"
            )
        if frame.round_id > self.round_id:
            raise self.protocol_error(
                peer, f"sent {frame.kind.name} for round {frame.round_id}, ahead of this trainer"
            )
        if frame.kind == FrameKind.RELEASE and frame.index >= len(self.plan.buckets):
            raise self.protocol_error(
                peer, f"released bucket {frame.index}; the plan has {len(self.plan.buckets)}"
            )
        if frame.kind == FrameKind.READY and (
            (frame.index and not self.carries_held) or frame.slot > self.direct_reads
        ):
            raise self.protocol_error(
                peer,
                f"sent READY with bucket {frame.index} and slot {frame.slot}; bucket should be "
                f"0 and slot at most {int(self.direct_reads)}",
            )
        return frame

    async def read_frame(self, peer: Peer, timeout: float, waiting_for: str) -> Frame:
        """Read and validate one frame from `peer`, or break the connection trying."""
        try:
            with anyio.fail_after(timeout):
                frame = Frame.unpack(await async_recv_exact(peer.sock, FRAME_SIZE))
            return self.check_from_worker(peer, frame)
        except TimeoutError:
            peer.close(f"did not send {waiting_for}")
            raise TransferTimeoutError(
                f"round {self.round_id}: worker {peer.address} did not send {waiting_for} "
                f"within {timeout}s; its connection is closed: call trainer_init again to "
                f"reconnect"
            ) from None
        except TransferError as exc:
            peer.close(str(exc))
            raise

    async def _wait_ready_one(
        self, peer: Peer, round_id: int, on_release: Callable[[Peer, Frame], None] | None
    ) -> None:
        timeout = self.settings.ready_timeout
        try:
            with anyio.fail_after(timeout):
                while True:
                    frame = Frame.unpack(await async_recv_exact(peer.sock, FRAME_SIZE))
                    self.check_from_worker(peer, frame)
                    if frame.kind == FrameKind.RELEASE and on_release is not None:
                        on_release(peer, frame)
                        continue
                    if frame.kind != FrameKind.READY:
                        raise self.protocol_error(
                            peer, f"sent {frame.kind.name} while the trainer waited for READY"
                        )
                    if frame.round_id == round_id:
                        peer.reads_directly = frame.slot == 1
                        peer.held = frame.index
                        return
        except TimeoutError:
            peer.close("did not start receiving")
            raise TransferTimeoutError(
                f"round {round_id}: worker {peer.address} did not start receiving within "
                f"timeouts.ready={timeout}s (is its update_weights call running?); its "
                f"connection is closed: call trainer_init again to reconnect"
            ) from None
        except TransferError as exc:
            peer.close(str(exc))
            raise

    def protocol_error(self, peer: Peer, what: str) -> ProtocolError:
        return ProtocolError(f"round {self.round_id}: worker {peer.address} {what}")

    def frame(self, kind: FrameKind, index: int = 0, nbytes: int = 0, slot: int = 0) -> Frame:
        return Frame(kind, self.round_id, index, self.digest, nbytes, slot)

    async def end_round(self) -> None:
        end = self.frame(FrameKind.END, index=len(self.plan.buckets))
        await self.each(self.send_header, end, "the end of the round")

    async def abort_round(self, reason: str) -> None:
        """Tell every worker the round is off, concurrently; failures are logged, not raised.

        Each send is bounded by `send_timeout` (a worker that does not take it has its
        connection closed, which ends its round too).
        """
        text = reason.encode("utf-8", "replace")[:ABORT_REASON_MAX]
        header = self.frame(FrameKind.ABORT, nbytes=len(text))

        async def abort_one(peer: Peer) -> None:
            try:
                await self.send_frame(peer, [memoryview(header.pack()), memoryview(text)], "abort")
            except AsyncwtError as exc:
                logger.warning(
                    "could not abort round %d on %s: %s", self.round_id, peer.address, exc
                )

        async with anyio.create_task_group() as tg:
            for peer in self.peers:
                if peer.broken is None:
                    tg.start_soon(abort_one, peer)

    def close(self) -> None:
        for peer in self.peers:
            peer.close("engine shut down")


class LinkedSender(SenderTransport):
    """A sender whose round protocol (READY, END, ABORT) runs over the links.

    Every built-in backend is one: a subclass says only how a bucket's payload
    travels (`send_bucket`) and adds what its transport needs around the rest.
    """

    on_release: Callable[[Peer, Frame], None] | None = None
    """Takes RELEASE frames that come while the round waits for READY (a ring's
    senders); without it they are a protocol error."""
    segments_outlive_send: bool = True
    """Whether a bucket's segments stay as they are until `send_bucket_to` returns
    (a layer around this sender may read them beside the send); false where a
    worker's release lets them be rewritten sooner (a ring slot)."""

    def __init__(self, settings: LinkSettings, plan: TransferPlan) -> None:
        self.links = TrainerLinks(settings, plan)

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        await self.links.rendezvous(worker_fields, init_workers)

    @property
    def num_workers(self) -> int:
        return len(self.links.peers)

    def check_usable(self) -> None:
        self.links.check_usable()

    async def begin_round(self, round_id: int) -> None:
        await self.links.wait_ready(round_id, self.on_release)

    async def send_bucket_to(
        self, bucket: Bucket, slot: int, segments: list[Segment], peers: list[Peer]
    ) -> Settle | None:
        """`send_bucket`, to `peers` only: a layer around this sender (a codec) sent
        the bucket to the others its own way. Called once per bucket, `peers` maybe
        empty (the sender then only lets go of what it held for the bucket). A sender
        that a layer may wrap implements it (tcp's and shm's)."""
        raise NotImplementedError(
            f"{type(self).__name__} sends every bucket to every worker (no send_bucket_to)"
        )

    async def end_round(self) -> None:
        await self.links.end_round()

    async def abort_round(self, reason: str) -> None:
        await self.links.abort_round(reason)

    def close(self) -> None:
        self.links.close()


def connect_link(
    host: str,
    port: int,
    token: str,
    plan: TransferPlan,
    timeout: float,
    *,
    peer: str = "the trainer",
) -> socket.socket:
    """Worker side: connect to the trainer (or to `peer`, a relay's listener) and pass
    the handshake; a blocking socket.

    The connection and each handshake read or write are bounded by `timeout`.
    Raises `AuthenticationError` when the trainer does not know the token (or refuses
    ours), `PlanMismatchError` when its plan differs, `TransferTimeoutError` on a
    timeout and `TransferError` when the connection fails.
    """
    digest = bytes.fromhex(plan.digest)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except TimeoutError as exc:
        raise TransferTimeoutError(
            f"could not connect to {peer} at {host}:{port} within connect_timeout="
            f"{timeout}s; check that its listener is reachable from this host"
        ) from exc
    except OSError as exc:
        raise TransferError(
            f"could not connect to {peer} at {host}:{port}: {exc}; check that it is "
            f"running (the trainer's trainer_init, a relay's round) and its host is reachable"
        ) from exc
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.token_bytes(32)
        send_all(sock, pack_hello(nonce, digest))
        trainer_nonce = verify_challenge(token, nonce, digest, recv_exact(sock, CHALLENGE_SIZE))
        send_all(sock, pack_proof(token, nonce, trainer_nonce, digest))
        check_result(recv_exact(sock, RESULT_SIZE))
    except TimeoutError as exc:
        sock.close()
        raise TransferTimeoutError(
            f"handshake with {peer} at {host}:{port} timed out after {timeout}s"
        ) from exc
    except OSError as exc:
        sock.close()
        raise TransferError(f"handshake with {peer} at {host}:{port} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def _check_coded(round_id: int, bucket: Bucket, frame: Frame, overhead: int) -> None:
    """A codec frame's length is bounded by the bucket's payload and the codec's header."""
    if not overhead <= frame.nbytes <= bucket.payload_bytes + overhead:
        raise ProtocolError(
            f"round {round_id}: a {frame.kind.name} frame of bucket {bucket.index} should "
            f"carry {overhead} to {bucket.payload_bytes + overhead} bytes, the header says "
            f"{frame.nbytes}"
        )


def read_abort_reason(sock: socket.socket, frame: Frame) -> str:
    """The UTF-8 reason that follows an ABORT header (bounded before it is read)."""
    if frame.nbytes > ABORT_REASON_MAX:
        raise ProtocolError(
            f"ABORT reason should be at most {ABORT_REASON_MAX} bytes, header says {frame.nbytes}"
        )
    return recv_exact(sock, frame.nbytes).decode("utf-8", "replace")


class FrameCodec(Protocol):
    """A layer that sends some buckets coded, as frames of its own `kind`, on the
    link (a bucket coded against what a worker holds, say). The link checks such a frame's header
    like a bucket's, with a payload of `overhead` to `overhead` + the bucket's
    payload bytes, and hands it to `receive`; READY carries `held()`, which the
    link does not interpret."""

    @property
    def kind(self) -> FrameKind: ...

    @property
    def overhead(self) -> int: ...

    def held(self) -> int:
        """What READY tells the trainer this worker holds (32 bits)."""
        ...

    def receive(
        self,
        sock: socket.socket,
        frame: Frame,
        bucket: Bucket,
        buffers: ReceiveBuffers,
        target: LandingTarget,
    ) -> ReceivedBucket:
        """Read the coded bucket `frame` announces from `sock` (its header checked)."""
        ...


class LinkedReceiver(ReceiverTransport):
    """A receiver whose rounds come over a `WorkerLink` (tcp, shm): a codec layer may
    add its frames to it (`add_codec`, before `connect`)."""

    codec: FrameCodec | None = None
    """The codec layer whose frames may come on the link, if any."""

    def add_codec(self, codec: FrameCodec) -> None:
        """Take `codec`'s frames on the link from the next `connect` on."""
        self.codec = codec

    declaration: bytes | None = None
    """The layout this worker declares after each handshake (sliced receivers), if any."""

    def declare(self, layout: bytes) -> None:
        """Send `layout` (LAYOUT) right after the handshake, from the next `connect` on."""
        self.declaration = layout

    def send_declaration(self, link: WorkerLink) -> None:
        """Send the declared layout on a fresh `link`, if there is one."""
        if self.declaration is not None:
            link.send(
                Frame(FrameKind.LAYOUT, 0, 0, link.digest, len(self.declaration)),
                self.declaration,
            )


class WorkerLink:
    """The worker's end of the link: announces rounds, reads and validates frames.

    `slots` is how many values a BUCKET header's `slot` may take (the shared ring's
    size for `"shm"`, `num_buffers` for `"torch_dist"`, 1 for `"tcp"`): every field
    of every header is checked before anything it announces is read. A worker that
    `reads_directly` says so in its READY frames and takes BUCKET_AT frames instead
    of BUCKET ones.
    """

    def __init__(
        self,
        sock: socket.socket,
        plan: TransferPlan,
        recv_timeout: float,
        *,
        slots: int = 1,
        reads_directly: bool = False,
        codec: FrameCodec | None = None,
    ) -> None:
        self.sock = sock
        self.plan = plan
        self.recv_timeout = recv_timeout
        self.slots = slots
        self.reads_directly = reads_directly
        self.bucket_kind = FrameKind.BUCKET_AT if reads_directly else FrameKind.BUCKET
        self.digest = digest_prefix(plan.digest)
        self.codec = codec
        """The codec layer whose frames may come besides bucket frames, if any."""
        self.broken = False
        self.bucket: int | None = None
        """The bucket being received (for error messages), or None between buckets."""
        self.next_bucket = 0
        """The bucket whose header comes next (for error messages)."""
        self._send_lock = threading.Lock()

    def send(self, frame: Frame, payload: bytes = b"") -> None:
        """Send a frame (and its payload) to the trainer (from any thread)."""
        with self._send_lock:
            send_all(self.sock, frame.pack() + payload)

    def frames(
        self, round_id: int, after_ready: Callable[[], object] | None = None
    ) -> Iterator[Frame]:
        """Announce `round_id` (READY) and yield its BUCKET headers, in order, until END.

        `after_ready` runs once READY is sent (the trainer may now wait on a
        collective). The caller reads each bucket's payload before asking for the
        next frame. Every header is checked against the plan before anything else
        is read. With a `codec`, READY carries its `held()` value, and its frames
        may come instead of bucket frames (`coded` reads them).
        """
        plan = self.plan
        self.sock.settimeout(self.recv_timeout)
        self.bucket, self.next_bucket = None, 0
        codec = self.codec
        held = codec.held() & 0xFFFFFFFF if codec is not None else 0
        self.send(Frame(FrameKind.READY, round_id, held, self.digest, 0, int(self.reads_directly)))
        if after_ready is not None:
            after_ready()
        expected = 0
        while True:
            self.bucket, self.next_bucket = None, expected
            frame = Frame.unpack(recv_exact(self.sock, FRAME_SIZE))
            if frame.kind == FrameKind.ABORT:
                reason = read_abort_reason(self.sock, frame)
                if frame.round_id < round_id:
                    continue  # left over from a round this worker never joined
                raise TransferAbortedError(
                    f"round {round_id}: the trainer aborted the round after {expected} of "
                    f"{len(plan.buckets)} buckets: {reason}",
                    buckets_received=expected,
                )
            if frame.round_id != round_id or frame.digest != self.digest:
                raise ProtocolError(
                    f"round {round_id}: got a {frame.kind.name} frame for round {frame.round_id} "
                    f"(plan {frame.digest.hex()}, this worker's is {self.digest.hex()})"
                )
            if frame.kind == FrameKind.END:
                if frame.index != len(plan.buckets) or expected != len(plan.buckets):
                    raise ProtocolError(
                        f"round {round_id}: END after {expected} buckets, the plan has "
                        f"{len(plan.buckets)} (END says {frame.index})"
                    )
                if frame.nbytes != 0 or frame.slot != 0:
                    raise ProtocolError(
                        f"round {round_id}: END should carry nothing, its header announces "
                        f"{frame.nbytes} bytes in slot {frame.slot}"
                    )
                return
            coded = codec is not None and frame.kind == codec.kind
            if frame.kind != self.bucket_kind and not coded:
                raise ProtocolError(
                    f"round {round_id}: unexpected {frame.kind.name} frame (this worker takes "
                    f"{self.bucket_kind.name})"
                )
            if frame.index != expected or expected >= len(plan.buckets):
                raise ProtocolError(
                    f"round {round_id}: expected bucket {expected}, got bucket {frame.index}"
                )
            bucket = plan.buckets[expected]
            if coded:
                assert codec is not None
                _check_coded(round_id, bucket, frame, codec.overhead)
            elif frame.nbytes != bucket.payload_bytes:
                raise ProtocolError(
                    f"round {round_id}: bucket {expected} should carry {bucket.payload_bytes} "
                    f"bytes, the header says {frame.nbytes}"
                )
            if frame.slot >= self.slots:
                raise ProtocolError(
                    f"round {round_id}: bucket {expected} names slot {frame.slot}, there "
                    f"are {self.slots}"
                )
            self.bucket = expected
            yield frame
            expected += 1

    def coded(
        self, frame: Frame, buffers: ReceiveBuffers, target: LandingTarget
    ) -> ReceivedBucket | None:
        """The bucket a codec frame from `frames` carries, read by the codec; None for
        a bucket frame (the receiver reads its payload)."""
        codec = self.codec
        if codec is None or frame.kind != codec.kind:
            return None
        return codec.receive(self.sock, frame, self.plan.buckets[frame.index], buffers, target)

    def guard(self, round_id: int) -> contextlib.AbstractContextManager[None]:
        """Map socket failures of a round to typed errors; mark the link broken on them."""
        return _LinkGuard(self, round_id)

    def close(self) -> None:
        """Close the connection; a receive blocked on it in another thread fails."""
        self.broken = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv; close() alone may not
        self.sock.close()


_RECONNECT = "the connection is closed: a new trainer_init (init_weight_transfer_engine) reconnects"


class _LinkGuard:
    def __init__(self, link: WorkerLink, round_id: int) -> None:
        self.link = link
        self.round_id = round_id

    def __enter__(self) -> None:
        return None

    def _position(self) -> str:
        link = self.link
        if link.bucket is not None:
            return f"bucket {link.bucket}"
        if link.next_bucket >= len(link.plan.buckets):
            return "waiting for the end of the round"
        return f"waiting for the header of bucket {link.next_bucket}"

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or isinstance(exc, TransferAbortedError):
            return  # an abort arrives at a frame boundary: the stream stays in step
        self.link.close()
        where = f"round {self.round_id}, {self._position()}"
        if isinstance(exc, TimeoutError):
            raise TransferTimeoutError(
                f"{where}: nothing from the trainer for recv_timeout={self.link.recv_timeout}s; "
                f"{_RECONNECT}"
            ) from exc
        if isinstance(exc, OSError):
            raise TransferError(
                f"{where}: the data connection failed: {exc}; {_RECONNECT}"
            ) from exc
        if isinstance(exc, TransferError) and not str(exc).startswith("round "):
            raise type(exc)(f"{where}: {exc}; {_RECONNECT}") from exc
