"""The scheduling hint for threads that mostly wait (`asyncwt._core.sched`)."""

from __future__ import annotations

import contextlib
import platform
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest

from asyncwt._core import sched as _sched
from asyncwt._core.sched import (
    BULK_SLICE_NS,
    SHORT_SLICE_NS,
    bulk_work,
    prompt_wakeups,
    thread_slice_ns,
)

T = TypeVar("T")


def _kernel_takes_slices() -> bool:
    """Linux 6.12+ on a machine whose syscall numbers `_sched` knows."""
    if not sys.platform.startswith("linux") or platform.machine() not in _sched._SYSCALLS:
        return False
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (6, 12)


TAKES_SLICES = _kernel_takes_slices()


def in_fresh_thread(fn: Callable[[], T]) -> T:
    """`fn()` run on a new thread, so that no test changes the runner's own thread."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


@pytest.mark.parametrize(
    ("hint", "requested"), [(prompt_wakeups, SHORT_SLICE_NS), (bulk_work, BULK_SLICE_NS)]
)
def test_a_hint_requests_its_slice_and_gives_the_old_one_back(
    hint: Callable[[], contextlib.AbstractContextManager[None]], requested: int
) -> None:
    def probe() -> tuple[int | None, int | None, int | None]:
        before = thread_slice_ns()
        with hint():
            inside = thread_slice_ns()
        with pytest.raises(KeyError), hint():
            raise KeyError("the block failed")
        return before, inside, thread_slice_ns()

    before, inside, after = in_fresh_thread(probe)
    if TAKES_SLICES:
        assert before is not None and before not in (SHORT_SLICE_NS, BULK_SLICE_NS)
        assert inside == requested
    assert after == before


def test_a_slice_the_thread_asked_for_itself_survives() -> None:
    if not TAKES_SLICES:
        pytest.skip("the kernel takes no slice requests (Linux 6.12+)")
    own = 3_000_000

    def probe() -> tuple[int | None, int | None]:
        attr = _sched._get()
        assert attr is not None
        assert _sched._set_slice(attr, own)
        with prompt_wakeups():
            inside = thread_slice_ns()
        return inside, thread_slice_ns()

    assert in_fresh_thread(probe) == (SHORT_SLICE_NS, own)


def test_hints_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_sched.HINTS_ENV, "0")

    def probe() -> tuple[int | None, int | None]:
        before = thread_slice_ns()
        with prompt_wakeups():
            return before, thread_slice_ns()

    before, inside = in_fresh_thread(probe)
    assert not _sched.hints_enabled()
    assert inside == before
