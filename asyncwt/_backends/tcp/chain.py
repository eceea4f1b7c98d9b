"""The `"tcp"` backend's tracked workers, trainer side: the fleet (each connection
paired with its control-plane member, so a worker can be dropped or added between
rounds) and the chain (the trainer sends each byte once, to the head).

Each tracked worker sends LISTEN right after its handshake: its member number and,
in a chain, its relay listener. In a chain, every round opens with the workers'
READY on their links to the trainer (control links from then on), a ROUTE to each
naming its successor and carrying the round's keys of its two edges (a relay
admits only the predecessor the trainer named), and the trainer's own connection
to the head's listener; the round's frames (BUCKETs, END or ABORT) go down that connection only, and each
worker forwards them (see `asyncwt._backends.tcp.relay`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

from ..._core.errors import ProtocolError, TransferError, TransferTimeoutError
from ..._core.plan import Bucket, TransferPlan
from ..._core.validate import MAX_HOST_CHARS
from ..._transports.base import InitWorkers, Segment
from ..._transports.link import Peer, TrainerLinks
from ..._transports.sockio import async_recv_exact
from ..._transports.wire import (
    ABORT_REASON_MAX,
    CHALLENGE_SIZE,
    EDGE_KEY_BYTES,
    FRAME_SIZE,
    RESULT_SIZE,
    Frame,
    FrameKind,
    check_result,
    edge_secret,
    pack_hello,
    pack_proof,
    verify_challenge,
)
from .sender import TcpSender
from .settings import TcpTrainerInitInfo

__all__ = ["ChainSender", "FleetSender", "Listing"]


@dataclass(frozen=True)
class Listing:
    """What a tracked worker announced: its member number and relay listener."""

    member: int
    host: str
    port: int


class FleetSender(TcpSender):
    """A `TcpSender` whose workers are tracked one by one: each connection is paired
    with its member (LISTEN), so a dead one can be dropped and newcomers admitted."""

    def __init__(self, info: TcpTrainerInitInfo, plan: TransferPlan) -> None:
        super().__init__(info, plan)
        self.info = info
        self.listings: dict[Peer, Listing] = {}

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        await super().rendezvous(self._fields(worker_fields), init_workers)
        await self._read_listings(self.links.peers)

    def _fields(self, worker_fields: dict[str, Any]) -> dict[str, Any]:
        return {**worker_fields, "topology": self.info.fanout.name}

    async def admit(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> list[Peer]:
        """Admit workers that were not there at init (a rendezvous of their own on a new
        listener); they take part from the next round on."""
        newcomers = TrainerLinks(self.links.settings, self.plan_of_links)
        await newcomers.rendezvous(self._fields(worker_fields), init_workers)
        try:
            await self._read_listings(newcomers.peers)
        except BaseException:
            newcomers.close()
            raise
        self.links.peers.extend(newcomers.peers)
        return newcomers.peers

    @property
    def plan_of_links(self) -> TransferPlan:
        return self.links.plan

    async def _read_listings(self, peers: list[Peer]) -> None:
        timeout = self.links.settings.handshake_timeout

        async def read_one(peer: Peer) -> None:
            try:
                with anyio.fail_after(timeout):
                    frame = Frame.unpack(await async_recv_exact(peer.sock, FRAME_SIZE))
                    if (
                        frame.kind != FrameKind.LISTEN
                        or frame.digest != self.links.digest
                        or frame.nbytes > MAX_HOST_CHARS
                        or frame.slot > 65535
                    ):
                        raise ProtocolError(
                            f"worker {peer.address} should announce itself with LISTEN (a host "
                            f"of at most {MAX_HOST_CHARS} bytes, a port), got {frame}"
                        )
                    host = (await async_recv_exact(peer.sock, frame.nbytes)).decode()
            except TimeoutError:
                peer.close("sent no LISTEN")
                raise TransferError(
                    f"worker {peer.address} did not announce itself within "
                    f"timeouts.handshake={timeout}s (is it an older asyncwt?)"
                ) from None
            except (TransferError, UnicodeDecodeError) as exc:
                peer.close(str(exc))
                raise TransferError(f"worker {peer.address}: {exc}") from exc
            self.listings[peer] = Listing(frame.index, host, frame.slot)

        await self.links.each(read_one, among=list(peers))

    def lost(self) -> list[Peer]:
        """The workers known to be gone: their link is broken or their process closed it."""
        return [peer for peer in self.links.peers if peer.broken is not None or _closed(peer.sock)]

    async def find_lost(self, timeout: float) -> list[Peer]:
        """`lost()`, waiting up to `timeout` seconds for a first one to show: a worker
        killed mid-round may fail its neighbours' round a moment before its own link
        to the trainer reads closed."""
        with anyio.move_on_after(timeout):
            while not (lost := self.lost()):
                await anyio.sleep(0.02)
            return lost
        return []

    def drop(self, peer: Peer) -> Listing | None:
        """Cut `peer` out: close its link, forget it."""
        peer.close("dropped")
        if peer in self.links.peers:
            self.links.peers.remove(peer)
        return self.listings.pop(peer, None)


def _closed(sock: socket.socket) -> bool:
    """Whether the peer closed `sock` (EOF or reset waiting to be read)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class ChainSender(FleetSender):
    """Sends each round once, to the head of the chain of live workers."""

    def __init__(self, info: TcpTrainerInitInfo, plan: TransferPlan) -> None:
        super().__init__(info, plan)
        self.head: Peer | None = None
        self.wire_bytes = 0
        """Bytes written to the head over the engine's life (the trainer's link)."""

    async def begin_round(self, round_id: int) -> None:
        self._close_head("a new round")
        await self.links.wait_ready(round_id)
        chain = list(self.links.peers)
        routes = {
            peer: self.listings[successor] if successor is not None else None
            for peer, successor in zip(chain, [*chain[1:], None])
        }
        # The round's key of each edge: keys[i] admits the feeder of worker i (the
        # trainer for the head), and only the two ends of an edge learn its key.
        keys = [secrets.token_bytes(EDGE_KEY_BYTES) for _ in range(len(chain) + 1)]

        async def route(peer: Peer) -> None:
            place = chain.index(peer)
            nxt = routes[peer]
            payload = keys[place] + keys[place + 1] + (nxt.host.encode() if nxt else b"")
            frame = self.links.frame(
                FrameKind.ROUTE,
                index=place,
                nbytes=len(payload),
                slot=nxt.port if nxt is not None else 0,
            )
            segments = [memoryview(frame.pack()), memoryview(payload)]
            await self.links.send_frame(peer, segments, "ROUTE")

        await self.links.each(route)
        first = self.listings[chain[0]]
        address = f"{first.host}:{first.port} (head of the chain)"
        sock = await self._connect(first, keys[0])
        self.head = Peer(sock, address)

    async def _connect(self, head: Listing, key: bytes) -> socket.socket:
        """Connect to the head's relay listener and pass the handshake with the
        round's key for that edge (`edge_secret`), on the event loop: cancellable,
        bounded by `connect_timeout`."""
        s = self.links.settings
        secret = edge_secret(s.token, key)
        loop = asyncio.get_running_loop()
        digest = bytes.fromhex(self.links.plan.digest)
        infos = await loop.getaddrinfo(head.host, head.port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            with anyio.fail_after(s.connect_timeout):
                await loop.sock_connect(sock, address)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                nonce = secrets.token_bytes(32)
                await loop.sock_sendall(sock, pack_hello(nonce, digest))
                challenge = await async_recv_exact(sock, CHALLENGE_SIZE)
                head_nonce = verify_challenge(secret, nonce, digest, challenge)
                await loop.sock_sendall(sock, pack_proof(secret, nonce, head_nonce, digest))
                check_result(await async_recv_exact(sock, RESULT_SIZE))
        except TimeoutError:
            sock.close()
            raise TransferTimeoutError(
                f"round {self.links.round_id}: the head of the chain at {head.host}:"
                f"{head.port} did not pass the handshake within connect_timeout="
                f"{s.connect_timeout}s"
            ) from None
        except OSError as exc:
            sock.close()
            raise TransferError(
                f"round {self.links.round_id}: could not connect to the head of the chain at "
                f"{head.host}:{head.port}: {exc}"
            ) from exc
        except BaseException:
            sock.close()
            raise
        return sock

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[Segment]) -> None:
        header = self.links.frame(FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes)
        await self._to_head(self._frame(header, segments), f"bucket {bucket.index}")

    @staticmethod
    def _frame(header: Frame, segments: list[Segment]) -> list[memoryview]:
        from ..._core.bytes import byte_view

        return [memoryview(header.pack()), *map(byte_view, segments)]

    async def _to_head(self, frame: list[memoryview], what: str) -> None:
        head = self.head
        if head is None or head.broken is not None:
            raise TransferError(f"round {self.links.round_id}: the chain's head is not connected")
        await self.links.send_frame(head, frame, what)
        self.wire_bytes += sum(view.nbytes for view in frame)

    async def end_round(self) -> None:
        end = self.links.frame(FrameKind.END, index=len(self.links.plan.buckets))
        await self._to_head([memoryview(end.pack())], "the end of the round")
        self._close_head(None)

    async def abort_round(self, reason: str) -> None:
        """ABORT down the chain (from the head) and on every control link (for a worker
        still waiting for its ROUTE or its predecessor). Never raises."""
        head = self.head
        if head is not None and head.broken is None:
            text = reason.encode("utf-8", "replace")[:ABORT_REASON_MAX]
            header = self.links.frame(FrameKind.ABORT, nbytes=len(text))
            with contextlib.suppress(TransferError):
                await self.links.send_frame(
                    head, [memoryview(header.pack()), memoryview(text)], "abort"
                )
        self._close_head(None)
        await super().abort_round(reason)

    def _close_head(self, why: str | None) -> None:
        head, self.head = self.head, None
        if head is None:
            return
        if why is None:
            head.sock.close()  # graceful: what was sent still arrives
        else:
            head.close(why)

    def close(self) -> None:
        self._close_head("engine shut down")
        super().close()


SENDERS: dict[str, Callable[[TcpTrainerInitInfo, TransferPlan], TcpSender]] = {
    "star": FleetSender,
    "chain": ChainSender,
}
"""The sender of a tracked fleet, by topology."""
