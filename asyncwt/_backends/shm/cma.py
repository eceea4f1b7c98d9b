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

One thread's `process_vm_readv` copies at about 0.7x one core's memcpy: the kernel
pins every remote page before it copies. `SplitReader` cuts each bucket into
disjoint byte ranges and reads them in concurrent calls, one per core (measured on
2 cores: 1.5x one call), so a worker's reads are bound by memory bandwidth rather
than by one thread.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import errno
import itertools
import os
import secrets
import socket
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

__all__ = [
    "DEFAULT_STREAMS",
    "MAX_STREAMS",
    "MIN_STREAM_BYTES",
    "PROBE_BYTES",
    "ReadProbe",
    "SplitReader",
    "buffer_address",
    "default_streams",
    "holds_peer_of",
    "probe_reads",
    "read_from",
    "split_ranges",
    "supported",
]

PROBE_BYTES = 32
_IOV_MAX = 1024
"""The most iovecs one call takes (`UIO_MAXIOV`)."""
MAX_STREAMS = 8
"""The most concurrent reads one `SplitReader` runs."""
DEFAULT_STREAMS = 4
"""The most a worker takes by default (`default_streams`)."""
MIN_STREAM_BYTES = 1 << 20
"""A read is split only into ranges of at least this many bytes: below it a thread
hand-off costs more than the second core saves."""
_PAGE = 4096


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


Ranges = tuple[list[memoryview], list[int]]
"""Local buffers and the remote address each one is read from (`read_from`'s arguments)."""


def split_ranges(local: Sequence[memoryview], remote: Sequence[int], parts: int) -> list[Ranges]:
    """Cut `local`/`remote` pairs into at most `parts` runs of about equal bytes, in
    order, for concurrent `read_from` calls; empty runs are left out.

    A cut inside a buffer moves down to a page boundary of the remote memory where
    the buffer holds one before it, so that two calls rarely pin the same page.
    """
    if parts < 1:
        raise ValueError(f"parts should be >= 1, got {parts}")
    if len(local) != len(remote):
        raise ValueError(
            f"remote should give one address per local buffer ({len(local)}), got {len(remote)}"
        )
    starts, total = [], 0
    for view in local:
        starts.append(total)
        total += len(view)
    cuts = [0]
    for k in range(1, parts):
        target = k * total // parts
        i = bisect.bisect_right(starts, target) - 1
        while i > 0 and not len(local[i]):
            i -= 1
        offset = target - starts[i]
        aligned = (remote[i] + offset) // _PAGE * _PAGE
        if aligned > remote[i]:  # a page boundary of this buffer at or below the target
            offset = aligned - remote[i]
        cuts.append(max(cuts[-1], starts[i] + offset))
    cuts.append(total)
    out: list[Ranges] = []
    for begin, end in itertools.pairwise(cuts):
        if begin == end:
            continue
        run: Ranges = ([], [])
        first = bisect.bisect_right(starts, begin) - 1
        for i in range(first, len(local)):
            if starts[i] >= end:
                break
            lo = max(begin, starts[i]) - starts[i]
            hi = min(end, starts[i] + len(local[i])) - starts[i]
            if hi > lo:
                run[0].append(local[i][lo:hi])
                run[1].append(remote[i] + lo)
        out.append(run)
    return out


class SplitReader:
    """`read_from` one process in up to `streams` concurrent calls over disjoint ranges.

    The calling thread reads the first range itself; `streams - 1` threads of its
    own read the others. `read` returns, or raises, only once every range's call has
    returned: a buffer is never handed back while a call may still write into it.
    `close()` stops the threads (idempotent).
    """

    def __init__(self, pid: int, streams: int, *, min_stream_bytes: int = MIN_STREAM_BYTES) -> None:
        if not isinstance(streams, int) or not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams should be an int in [1, {MAX_STREAMS}], got {streams!r}")
        self.pid = pid
        self.streams = streams
        self.min_stream_bytes = max(1, min_stream_bytes)
        self._pool: ThreadPoolExecutor | None = None
        if streams > 1:
            self._pool = ThreadPoolExecutor(streams - 1, thread_name_prefix="asyncwt-shm-read")

    def read(self, local: Sequence[memoryview], remote: Sequence[int]) -> None:
        """`read_from(self.pid, local, remote)`, split; the first failure's `OSError`."""
        total = sum(len(view) for view in local)
        parts = max(1, min(self.streams, total // self.min_stream_bytes))
        pool = self._pool
        if parts == 1 or pool is None:
            read_from(self.pid, local, remote)
            return
        runs = split_ranges(local, remote, parts)
        futures = [pool.submit(read_from, self.pid, *run) for run in runs[1:]]
        error: BaseException | None = None
        try:
            read_from(self.pid, *runs[0])
        except BaseException as exc:  # noqa: BLE001 - raised below, once the others returned
            error = exc
        finally:
            concurrent.futures.wait(futures)
        for future in futures:
            failure = future.exception()
            if error is None and failure is not None:
                error = failure
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def default_streams() -> int:
    """Concurrent reads for a worker that was told none: one per core it may run on,
    at most `DEFAULT_STREAMS` (several workers of one host share its memory
    bandwidth, which a few streams each already fill)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(DEFAULT_STREAMS, cores))


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
