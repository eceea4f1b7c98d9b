"""Reading another process's memory in one copy (Linux cross-memory attach).

On one host, a worker can copy a bucket straight out of the trainer's own tensors
with `process_vm_readv(2)`: one copy per byte, made by the worker, where a ring of
shared buffers costs two (the trainer packs into the ring, the worker copies out
of it), both on the same cores.

The kernel allows it where the worker may ptrace the trainer: same user, and no
Yama restriction (`kernel.yama.ptrace_scope` 0, or 1 with the worker a descendant
of the trainer or named by its `PR_SET_PTRACER`), or `CAP_SYS_PTRACE`. Whether it
is allowed is settled by trying: the trainer exports a `ReadProbe` (its pid, and
the address of random bytes it holds) and the worker reads them back
(`probe_reads`). A match also proves that the pid is the trainer's own, not a
process of another PID namespace.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PROBE_BYTES",
    "ReadProbe",
    "buffer_address",
    "holds_peer_of",
    "probe_reads",
    "read_from",
    "supported",
]

PROBE_BYTES = 32
_IOV_MAX = 1024
"""The most iovecs one call takes (`UIO_MAXIOV`)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_readv() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        readv = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.POINTER(_Iovec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return readv


_readv = _load_readv()


def supported() -> bool:
    """Whether this platform has `process_vm_readv` at all (Linux 3.2+, glibc or musl)."""
    return _readv is not None


def buffer_address(view: memoryview) -> int:
    """The address of a writable, contiguous `memoryview`'s first byte (0 if empty)."""
    if len(view) == 0:
        return 0
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def read_from(pid: int, local: Sequence[memoryview], remote: Sequence[int]) -> None:
    """Copy `len(local[i])` bytes at address `remote[i]` of process `pid` into `local[i]`.

    Loops over partial reads and the kernel's per-call iovec limit. Raises
    `OSError` (EFAULT: an address `pid` does not map; ESRCH: no such process;
    EPERM: not allowed) when a read makes no progress.
    """
    if _readv is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available on this platform")
    if len(local) != len(remote):
        raise ValueError(
            f"remote should give one address per local buffer ({len(local)}), got {len(remote)}"
        )
    pending = [
        (buffer_address(view), address, len(view))
        for view, address in zip(local, remote)
        if len(view)
    ]
    while pending:
        batch = pending[:_IOV_MAX]
        local_iov = (_Iovec * len(batch))(*[_Iovec(dst, n) for dst, _, n in batch])
        remote_iov = (_Iovec * len(batch))(*[_Iovec(src, n) for _, src, n in batch])
        done = _readv(pid, local_iov, len(batch), remote_iov, len(batch), 0)
        if done <= 0:
            code = ctypes.get_errno() if done < 0 else errno.EFAULT
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        pending = _advance(pending, done)


def _advance(pending: list[tuple[int, int, int]], done: int) -> list[tuple[int, int, int]]:
    """`pending` after its first `done` bytes were read."""
    for i, (dst, src, n) in enumerate(pending):
        if done < n:
            return [(dst + done, src + done, n - done), *pending[i + 1 :]]
        done -= n
    return []


def holds_peer_of(pid: int, sock: socket.socket) -> bool:
    """Whether process `pid` holds the other end of TCP connection `sock` (one host).

    Binds the pid a control plane names to the trainer this worker authenticated on
    the link: without it, whoever may call a worker's init could have it read any
    process of its user. Looks the connection up in `pid`'s view of the TCP tables
    (`/proc/PID/net/tcp*`), then among `pid`'s descriptors.
    """
    try:
        local, remote = sock.getsockname()[:2], sock.getpeername()[:2]
    except OSError:
        return False
    wanted = {
        (ours, theirs) for ours in _proc_net_forms(*remote) for theirs in _proc_net_forms(*local)
    }
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as listing:
                rows = listing.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and (fields[1], fields[2]) in wanted:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return False
    try:
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in descriptors:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


def _proc_net_forms(host: str, port: int) -> list[str]:
    """`host:port` as `/proc/net/tcp` or `tcp6` print it (an IPv4 address both ways:
    a dual-stack socket shows it mapped into IPv6)."""
    try:
        raw = socket.inet_pton(socket.AF_INET, host)
        forms = [raw, bytes(10) + b"\xff\xff" + raw]
    except OSError:
        forms = [socket.inet_pton(socket.AF_INET6, host.split("%")[0])]
    return [
        "".join(f"{int.from_bytes(raw[i : i + 4], 'little'):08X}" for i in range(0, len(raw), 4))
        + f":{port:04X}"
        for raw in forms
    ]


@dataclass(frozen=True)
class ReadProbe:
    """Random bytes the trainer holds, for a worker to read back (see the module docstring)."""

    pid: int
    address: int
    nonce: str
    """The bytes, in hex (they travel on the control plane with the token)."""

    @classmethod
    def create(cls) -> tuple[ReadProbe, ctypes.Array[ctypes.c_char]]:
        """A probe of this process, and the buffer that must stay alive while it is used."""
        data = secrets.token_bytes(PROBE_BYTES)
        buffer = ctypes.create_string_buffer(data, PROBE_BYTES)
        return cls(os.getpid(), ctypes.addressof(buffer), data.hex()), buffer


def probe_reads(probe: ReadProbe) -> str | None:
    """None if this process can read `probe`'s process memory, else why not."""
    if _readv is None:
        return "process_vm_readv is not available on this platform"
    got = bytearray(PROBE_BYTES)
    try:
        read_from(probe.pid, [memoryview(got)], [probe.address])
    except OSError as exc:
        return f"reading the trainer's memory (pid {probe.pid}) failed: {exc.strerror}"
    if got.hex() != probe.nonce:
        return f"pid {probe.pid} does not hold the trainer's probe (another PID namespace?)"
    return None
