"""Scheduler slice requests for asyncwt's own threads (a Linux hint).

A round mixes two kinds of thread work on the same cores:

- the thread that iterates the source spends the round blocked in gathers (an FSDP
  all-gather, a gloo collective) and must issue the next one as soon as the last
  returns;
- the pack stage's copies into staging are bulk work that only throughput matters
  for, and that keeps a core busy for milliseconds at a time.

When the copies (and, on one host, the workers' own copies) keep every core busy,
a woken thread waits in the run queue, and every gather it issues late delays the
round.

Since Linux 6.12 the EEVDF scheduler takes a per-thread slice request
(`sched_setattr`'s `sched_runtime` under `SCHED_OTHER`), and a woken thread whose
slice is shorter than the running thread's may preempt it (`PREEMPT_SHORT`). A
slice changes how soon a runnable thread runs, not its share of the CPU. So
`prompt_wakeups()` asks for the shortest slice (0.1 ms) around the source's
iteration, and `bulk_work()` for a long one (10 ms) around a pack copy, which
threads with the default slice (a worker's apply threads) then preempt on waking.

Both restore the thread's previous request on exit: the threads are borrowed from
anyio's pool. Elsewhere (other systems, older kernels, a real-time policy, a
seccomp filter) they do nothing, and `ASYNCWT_SCHED_HINTS=0` turns them off.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import sys
from collections.abc import Callable, Iterator

__all__ = [
    "BULK_SLICE_NS",
    "SHORT_SLICE_NS",
    "bulk_work",
    "hints_enabled",
    "prompt_wakeups",
    "thread_slice_ns",
]

SHORT_SLICE_NS = 100_000
"""The slice a waiting thread requests: the shortest the kernel accepts (0.1 ms)."""
BULK_SLICE_NS = 10_000_000
"""The slice a bulk copy requests (10 ms): threads with the default slice preempt it."""

HINTS_ENV = "ASYNCWT_SCHED_HINTS"

_SCHED_OTHER = 0
_SCHED_BATCH = 3
_RESET_ON_FORK = 0x01
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
"""Machine → (sched_setattr, sched_getattr) syscall numbers."""


class _SchedAttr(ctypes.Structure):
    """`struct sched_attr` (`SCHED_ATTR_SIZE_VER1`, 56 bytes)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


def _syscalls() -> tuple[Callable[..., int], int, int] | None:
    if not sys.platform.startswith("linux"):
        return None
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return libc.syscall, numbers[0], numbers[1]


_CALLS = _syscalls()


def hints_enabled() -> bool:
    """Whether this process may set scheduling hints (`$ASYNCWT_SCHED_HINTS` is not 0)."""
    return _CALLS is not None and os.environ.get(HINTS_ENV, "1") != "0"


def _get() -> _SchedAttr | None:
    if _CALLS is None:
        return None
    syscall, _, getattr_nr = _CALLS
    attr = _SchedAttr()
    if syscall(getattr_nr, 0, ctypes.byref(attr), ctypes.sizeof(attr), 0) != 0:
        return None
    return attr


def _set_slice(attr: _SchedAttr, slice_ns: int) -> bool:
    assert _CALLS is not None  # _get returned attr
    syscall, setattr_nr, _ = _CALLS
    attr.size = ctypes.sizeof(attr)
    attr.sched_flags &= _RESET_ON_FORK  # keep it; the other flags are not ours to set
    attr.sched_runtime = slice_ns
    return bool(syscall(setattr_nr, 0, ctypes.byref(attr), 0) == 0)


def thread_slice_ns() -> int | None:
    """The calling thread's slice (`sched_getattr`'s `sched_runtime`), or None if unknown."""
    attr = _get()
    return None if attr is None else int(attr.sched_runtime)


def prompt_wakeups() -> contextlib.AbstractContextManager[None]:
    """Request a short scheduler slice for this thread inside the block (see the module)."""
    return _slice_request(SHORT_SLICE_NS)


def bulk_work() -> contextlib.AbstractContextManager[None]:
    """Request a long scheduler slice for this thread inside the block (see the module)."""
    return _slice_request(BULK_SLICE_NS)


@contextlib.contextmanager
def _slice_request(slice_ns: int) -> Iterator[None]:
    attr = _get() if hints_enabled() else None
    if attr is None or attr.sched_policy not in (_SCHED_OTHER, _SCHED_BATCH):
        yield
        return
    previous = int(attr.sched_runtime)
    changed = previous != slice_ns and _set_slice(attr, slice_ns)
    try:
        yield
    finally:
        if changed:  # a thread on the default slice gets it back as a request of that length
            _set_slice(attr, previous)
