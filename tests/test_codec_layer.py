"""The link's hooks for a codec layer, and delta as one: the link carries a codec's
frames and READY's held value without reading either, and the transports import
nothing of `asyncwt._delta` (it wraps them, never the reverse)."""

from __future__ import annotations

import ast
import socket
from pathlib import Path
from typing import Any, cast

import _models
import anyio
import pytest
from _fuzzkit import trainer_links

import asyncwt
from asyncwt import ModuleSource, TcpTrainerInitInfo
from asyncwt._core.errors import ProtocolError
from asyncwt._core.plan import Bucket, TransferPlan
from asyncwt._delta.links import delta_sender
from asyncwt._transports.base import LandingTarget, ReceiveBuffers, ReceivedBucket
from asyncwt._transports.link import Peer, WorkerLink
from asyncwt._transports.sockio import recv_exact
from asyncwt._transports.wire import Frame, FrameKind, digest_prefix
from asyncwt._worker.delta import delta_receiver

HELD = 0xDEADBEEF


class Reversed:
    """A codec that is not delta's: a 4-byte tag, then the payload backwards."""

    kind = FrameKind.DELTA
    overhead = 4

    def held(self) -> int:
        return HELD

    def receive(
        self,
        sock: socket.socket,
        frame: Frame,
        bucket: Bucket,
        buffers: ReceiveBuffers,
        target: LandingTarget,
    ) -> ReceivedBucket:
        tag = recv_exact(sock, 4)
        body = recv_exact(sock, frame.nbytes - 4)
        return ReceivedBucket(bucket, None, lambda: None, header=(tag, body[::-1]))


def _plan() -> TransferPlan:
    return TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=1 << 16)


def test_a_codec_of_its_own_rides_the_worker_link_unread() -> None:
    """READY carries the codec's held value; its frame is checked like a bucket's
    (bounded by the codec's overhead) and read by the codec; a bucket frame is not."""
    plan = _plan()
    worker_end, trainer_end = socket.socketpair()
    link = WorkerLink(worker_end, plan, 5.0, codec=Reversed())
    buffers = cast(ReceiveBuffers, None)
    target = cast(LandingTarget, None)
    with worker_end, trainer_end:
        digest = digest_prefix(plan.digest)
        first, second = plan.buckets[0], plan.buckets[1]
        body = bytes(i % 251 for i in range(first.payload_bytes // 2))
        trainer_end.sendall(
            Frame(FrameKind.DELTA, 1, 0, digest, 4 + len(body)).pack() + b"TAG!" + body
        )
        trainer_end.sendall(
            Frame(FrameKind.BUCKET, 1, 1, digest, second.payload_bytes).pack()
            + bytes(second.payload_bytes)
        )
        trainer_end.sendall(Frame(FrameKind.DELTA, 1, 2, digest, 3).pack())
        frames = link.frames(1)
        coded = link.coded(next(frames), buffers, target)
        ready = Frame.unpack(trainer_end.recv(64))
        assert (ready.kind, ready.index) == (FrameKind.READY, HELD)
        assert coded is not None and coded.bucket is first
        assert coded.header == (b"TAG!", body[::-1])
        plain = next(frames)
        assert link.coded(plain, buffers, target) is None
        recv_exact(worker_end, second.payload_bytes)
        with pytest.raises(
            ProtocolError, match=r"a DELTA frame of bucket 2 should carry 4 to \d+ bytes, .* 3$"
        ):
            next(frames)


def test_a_link_without_a_codec_refuses_its_frames_and_announces_nothing() -> None:
    plan = _plan()
    worker_end, trainer_end = socket.socketpair()
    link = WorkerLink(worker_end, plan, 5.0)
    with worker_end, trainer_end:
        digest = digest_prefix(plan.digest)
        trainer_end.sendall(Frame(FrameKind.DELTA, 1, 0, digest, 4).pack())
        with pytest.raises(ProtocolError, match=r"unexpected DELTA frame"):
            next(link.frames(1))
        assert Frame.unpack(trainer_end.recv(64)).index == 0


def test_ready_carries_a_held_value_only_once_a_layer_accepts_it() -> None:
    """The trainer's links refuse a READY naming a held value until a layer above
    says it reads one (`accept_held`); then `Peer.held` is what READY said."""
    links = trainer_links()
    ours, theirs = socket.socketpair()
    with ours, theirs:
        peer = Peer(ours, "worker")
        ready = Frame(FrameKind.READY, 1, HELD, links.digest, 0)
        links.round_id = 1
        with pytest.raises(ProtocolError, match=rf"READY with bucket {HELD}"):
            links.check_from_worker(peer, ready)
        links.accept_held()
        ours.setblocking(False)
        links.peers = [peer]
        theirs.sendall(ready.pack())

        async def wait() -> None:
            with anyio.fail_after(5):
                await links.wait_ready(1)

        anyio.run(wait)
        assert peer.held == HELD


def test_delta_wraps_only_linked_transports_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"delta should be False for a object .*got True"):
        delta_sender(cast(Any, object()), TcpTrainerInitInfo(rank=0, delta=True))
    with pytest.raises(ValueError, match=r"delta should be False for a object .*got True"):
        delta_receiver(cast(Any, object()), _plan())


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, at any level (functions, TYPE_CHECKING), resolved."""
    package = ".".join(path.relative_to(Path(asyncwt.__file__).parent.parent).parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
            else:
                base = []
            found.append(".".join([*base, *([node.module] if node.module else [])]))
    return found


def test_the_transports_import_nothing_of_the_delta_layer() -> None:
    root = Path(asyncwt.__file__).parent / "_transports"
    upward = {
        str(path.relative_to(root)): name
        for path in sorted(root.rglob("*.py"))
        for name in _imports(path)
        if name.startswith("asyncwt._delta")
    }
    assert not upward, f"_transports imports the delta layer that wraps it: {upward}"
