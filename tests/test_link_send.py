"""The trainer's frame sends: bounded by `send_timeout`, never cut by a cancellation,
and one error per failure whether one worker is sent to or several."""

from __future__ import annotations

import socket
import threading
import time

import anyio
import pytest
from _fuzzkit import trainer_links

from asyncwt import TransferError, TransferTimeoutError
from asyncwt._transports.link import Peer, TrainerLinks

pytestmark = pytest.mark.asyncio

FRAME_BYTES = 32 << 20
"""Far more than a socket pair's buffers hold: the send must wait for the reader."""


def _peer(links: TrainerLinks, name: str) -> tuple[Peer, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    peer = Peer(ours, name)
    links.peers.append(peer)
    return peer, theirs


def _frame() -> list[memoryview]:
    return [memoryview(bytes(range(256)) * (FRAME_BYTES // 256))]


def _read_all(sock: socket.socket, nbytes: int, delay: float, out: bytearray) -> None:
    time.sleep(delay)
    sock.settimeout(10)
    while len(out) < nbytes:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return
        out += chunk


async def test_a_frame_the_worker_does_not_take_fails_within_send_timeout() -> None:
    links = trainer_links(send_timeout=0.3)
    peer, theirs = _peer(links, "stalled")
    try:
        started = time.monotonic()
        with pytest.raises(
            TransferTimeoutError, match=r"did not take bucket 0 within timeouts\.send=0\.3s"
        ):
            await links.send_frame(peer, _frame(), "bucket 0")
        assert 0.3 <= time.monotonic() - started < 3
        assert peer.broken == "timed out sending bucket 0"  # never left mid-frame
    finally:
        theirs.close()


async def test_a_cancelled_send_finishes_its_frame_before_the_cancellation_lands() -> None:
    links = trainer_links(send_timeout=10.0)
    peer, theirs = _peer(links, "slow")
    got = bytearray()
    reader = threading.Thread(target=_read_all, args=(theirs, FRAME_BYTES, 0.3, got))
    reader.start()
    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(links.send_frame, peer, _frame(), "bucket 0")
                await anyio.sleep(0.05)
                scope.cancel()
        assert scope.cancelled_caught
        reader.join(10)
        assert bytes(got) == bytes(_frame()[0])  # the whole frame, in order
        assert peer.broken is None
    finally:
        theirs.close()
        peer.sock.close()
        reader.join(10)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_failed_send_raises_the_transfer_error_itself(workers: int) -> None:
    """`each` runs a single worker's send in place and several in a task group;
    either way the caller sees the TransferError, not an exception group."""
    links = trainer_links()
    peers = [_peer(links, f"w{i}") for i in range(workers)]
    broken, _ = peers[-1]
    broken.sock.close()
    try:
        with pytest.raises(TransferError, match=r"sending the end of the round to worker w"):
            await links.each(links.send_frame, [memoryview(b"x" * 64)], "the end of the round")
    finally:
        for peer, theirs in peers:
            theirs.close()
            peer.sock.close()
