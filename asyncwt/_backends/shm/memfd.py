"""Shared ring buffers with no name: anonymous memory handed over a Unix socket.

A named segment in `/dev/shm` outlives every process that knew it if they are all
killed before one unlinks it (SIGKILL of the trainer's whole process group during
init runs no cleanup: not ours, not the resource tracker's). So on Linux the ring
is `memfd_create` memory, which has no name and is freed by the kernel when the
last descriptor and mapping of it are gone, however its holders die. Workers
receive the descriptors (`SCM_RIGHTS`) from `RingFdServer`, a listener in the
abstract Unix namespace (no file either: the name dies with the socket) that the
trainer runs during init only.

Who may take the descriptors: a peer of this user (the kernel's `SO_PEERCRED`),
which is whom a named owner-only segment admitted. The server never reads from a
peer: it checks the credentials, sends, and closes, so an idle connection costs
it nothing, and a flood of them cannot hold anything back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import re
import secrets
import socket
import struct
import sys

from ..._core.errors import TransferError

__all__ = ["SOCKET_NAME", "AnonymousRing", "RingFdServer", "receive_ring", "supported"]

logger = logging.getLogger("asyncwt")

SOCKET_NAME = re.compile(r"^asyncwt_ring_[0-9a-f]{32}$")
"""What a ring socket's (abstract) name looks like."""
_HELLO = b"R"
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def supported() -> bool:
    """Whether this platform has memfd and abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
    return int(_CRED.unpack(creds)[1])


class AnonymousRing:
    """`count` shared buffers of `nbytes` each, as memfds mapped into this process."""

    def __init__(self, count: int, nbytes: int) -> None:
        self.fds: list[int] = []
        self.maps: list[mmap.mmap] = []
        try:
            for slot in range(count):
                fd = os.memfd_create(f"asyncwt_ring_{slot}", os.MFD_CLOEXEC)
                self.fds.append(fd)
                os.ftruncate(fd, nbytes)
                self.maps.append(mmap.mmap(fd, nbytes))
        except BaseException:
            self.close()
            raise

    def close_fds(self) -> None:
        """Drop the descriptors (the mappings stay): every worker has its own now."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []

    def close(self) -> None:
        self.close_fds()
        for mapping in self.maps:
            with contextlib.suppress(BufferError):  # a tensor still views it: freed with it
                mapping.close()
        self.maps = []


class RingFdServer:
    """Hands the ring's descriptors to every same-user peer that connects, during init."""

    def __init__(self, ring: AnonymousRing) -> None:
        self.ring = ring
        self.name = f"asyncwt_ring_{secrets.token_hex(16)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind("\0" + self.name)
            self.listener.listen(128)
            self.listener.setblocking(False)
        except BaseException:
            self.listener.close()
            raise

    async def serve(self) -> None:
        """Answer connections until cancelled; never waits on a peer."""
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self.listener)
            with sock:
                self._answer(sock)

    def _answer(self, sock: socket.socket) -> None:
        try:
            uid = _peer_uid(sock)
            if uid != os.getuid():
                logger.warning("asyncwt: shm: refused the ring to a process of uid %d", uid)
                return
            sock.setblocking(False)
            socket.send_fds(sock, [_HELLO], self.ring.fds)
        except OSError as exc:
            logger.warning("asyncwt: shm: could not hand the ring to a worker: %r", exc)

    def close(self) -> None:
        self.listener.close()


def receive_ring(name: str, count: int, nbytes: int, timeout: float) -> list[mmap.mmap]:
    """Worker side: take the ring's `count` descriptors from the trainer's server
    `name` and map each (`nbytes`); the descriptors are closed once mapped.

    Raises `TransferError` naming what went wrong.
    """
    fds: list[int] = []
    maps: list[mmap.mmap] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect("\0" + name)
            except OSError as exc:
                raise TransferError(
                    f"could not reach the trainer's shared ring at the abstract Unix socket "
                    f"{name!r}: {exc}; the shm backend needs the trainer and the worker on "
                    f"one host, in one network namespace"
                ) from exc
            if _peer_uid(sock) != os.getuid():
                raise TransferError(
                    f"the shared ring socket {name!r} belongs to another user; refusing it"
                )
            try:
                message, fds, _, _ = socket.recv_fds(sock, len(_HELLO), count)
            except OSError as exc:
                raise TransferError(
                    f"receiving the shared ring from the trainer failed: {exc}"
                ) from exc
        if message != _HELLO or len(fds) != count:
            raise TransferError(
                f"the trainer's ring socket sent {len(fds)} descriptors and {message!r}; "
                f"expected {count} and {_HELLO!r}"
            )
        for fd in fds:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise TransferError(f"a shared ring slot has {size} bytes, the plan needs {nbytes}")
            maps.append(mmap.mmap(fd, nbytes))
    except BaseException:
        for mapping in maps:
            mapping.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
    return maps
