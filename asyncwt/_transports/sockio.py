"""Socket I/O primitives: scatter-gather sends and receives straight into place.

The trainer side is asynchronous (non-blocking sockets driven by the event loop,
uvloop or not); the worker side is synchronous, since vLLM calls `update_weights`
from a worker thread. Both move a list of buffers per system call (`sendmsg` /
`recvmsg_into`), so a bucket made of many tensors costs no packing copy.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
from collections.abc import Sequence

from .._core.errors import TransferError

__all__ = [
    "async_recv_exact",
    "async_send_segments",
    "readable",
    "recv_exact",
    "recv_segments",
    "send_all",
]

_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_MAX_CALL_BYTES = 4 << 20
"""Bytes offered to one send call: big enough to amortise the call, small enough
that the kernel (autotuned socket buffers) takes most of it at once."""


def _batch(segments: list[memoryview], first: int) -> list[memoryview]:
    batch, total = [], 0
    for seg in segments[first : first + _IOV_MAX]:
        if total >= _MAX_CALL_BYTES:
            break
        if total + len(seg) > _MAX_CALL_BYTES:
            seg = seg[: _MAX_CALL_BYTES - total]
        batch.append(seg)
        total += len(seg)
    return batch


def _advance(segments: list[memoryview], first: int, sent: int) -> int:
    """Drop `sent` bytes from the front of `segments[first:]`; return the new first index."""
    while sent:
        length = len(segments[first])
        if sent >= length:
            sent -= length
            first += 1
        else:
            segments[first] = segments[first][sent:]
            sent = 0
    return first


async def _wait_writable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    waiter = loop.create_future()

    def ready() -> None:
        if not waiter.done():
            waiter.set_result(None)

    loop.add_writer(sock.fileno(), ready)
    try:
        await waiter
    finally:
        loop.remove_writer(sock.fileno())


async def async_send_segments(sock: socket.socket, segments: Sequence[memoryview]) -> None:
    """Send every byte of `segments`, in order, from a non-blocking socket.

    Cancellation: not atomic; a cancelled send leaves the connection mid-frame, so
    the caller must either shield it or close the connection.
    """
    loop = asyncio.get_running_loop()
    pending = [s for s in segments if len(s)]
    first = 0
    while first < len(pending):
        try:
            sent = sock.sendmsg(_batch(pending, first))
        except (BlockingIOError, InterruptedError):
            await _wait_writable(loop, sock)
            continue
        except OSError as exc:
            raise TransferError(f"sending to the worker failed: {exc}") from exc
        first = _advance(pending, first, sent)


async def async_recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Receive exactly `nbytes` from a non-blocking socket; EOF is a `TransferError`."""
    loop = asyncio.get_running_loop()
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    got = 0
    while got < nbytes:
        try:
            n = await loop.sock_recv_into(sock, view[got:])
        except OSError as exc:
            raise TransferError(f"receiving from the peer failed: {exc}") from exc
        if n == 0:
            raise TransferError(f"the peer closed the connection ({got} of {nbytes} bytes read)")
        got += n
    return bytes(buffer)


def send_all(sock: socket.socket, data: bytes) -> None:
    """Blocking send of `data` (small control frames on the worker side)."""
    sock.sendall(data)


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """Blocking receive of exactly `nbytes`; EOF is a `TransferError`."""
    buffer = bytearray(nbytes)
    recv_segments(sock, [memoryview(buffer)])
    return bytes(buffer)


def recv_segments(sock: socket.socket, segments: Sequence[memoryview]) -> None:
    """Blocking receive filling `segments` in order, several buffers per call.

    Timeouts come from the socket (`settimeout`) and surface as `socket.timeout`.
    """
    pending = [s for s in segments if len(s)]
    first = 0
    while first < len(pending):
        n = sock.recvmsg_into(pending[first : first + _IOV_MAX])[0]
        if n == 0:
            left = sum(len(s) for s in pending[first:])
            raise TransferError(f"the peer closed the connection with {left} bytes still expected")
        first = _advance(pending, first, n)


def readable(sock: socket.socket, timeout: float) -> bool:
    """Whether `sock` has bytes to read (or a connection to accept) within `timeout`
    seconds (poll: `select()` cannot take descriptors past 1023, which a serving
    process may well hold)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(timeout * 1000))
