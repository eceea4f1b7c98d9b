"""Spy on process creation, so that the fast test tier (`-m "not slow"`) starts none.

`install()` wraps the ways a test starts a process (subprocess.Popen, os.fork and its
kin, os.system, multiprocessing's Process.start, asyncio.create_subprocess_*, which
uvloop serves without Popen) with a check: while a test not marked `slow` runs (its
setup, call and teardown), a spawn is refused with a failure that names the call and
says how to mark the test. Refusing before the process exists keeps the fast tier
free of children, and conftest.py fails the phase too, in case the spawn came from a
thread that swallowed the failure. Two helpers that start once per interpreter are
not a test's processes and are not counted: the multiprocessing resource tracker
(shared memory starts it, through _posixsubprocess) and ctypes.util.find_library's
`ldconfig -p` (the worker server looks up libc's malloc_trim once).
"""

from __future__ import annotations

import asyncio
import asyncio.subprocess
import contextlib
import ctypes.util
import functools
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_current: list[str] = []
"""The running test's node id while it is in the fast tier; empty otherwise."""
spawned: list[str] = []
"""The spawns refused during the current phase, as `what (test id)`."""


def _describe(name: str, args: tuple[Any, ...]) -> str:
    first = repr(args[0])[:120] if args else ""
    return f"{name}({first})"


_fixtures: list[str] = []
"""The fixtures being set up, innermost last (`file::name`)."""
_exempt: list[str] = []
"""Non-empty while a once-per-interpreter helper (see the module docstring) runs."""


def _refuse(name: str, args: tuple[Any, ...]) -> None:
    if not _current or _exempt:
        return
    what = _describe(name, args)
    spawned.append(what)
    if _fixtures:
        how = f"its fixture {_fixtures[-1]} started a process ({what}): add that fixture"
        how += " to SPAWNING_FIXTURES in tests/conftest.py"
    else:
        how = f"it started a process ({what}): mark it @pytest.mark.slow"
        how += " (a whole file: `pytestmark = pytest.mark.slow`)"
    pytest.fail(f"{_current[0]} is in the fast tier (not marked slow) but {how}")


def _wrap(owner: Any, attr: str, name: str) -> None:
    original: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(original)
    def spy(*args: Any, **kwargs: Any) -> Any:
        # Popen.__init__ and Process.start get self first: describe the command instead.
        shown = args[1:] if name in ("subprocess.Popen", "multiprocessing.Process.start") else args
        if name == "multiprocessing.Process.start" and args:
            shown = (getattr(args[0], "_target", None),)
        _refuse(name, shown)
        return original(*args, **kwargs)

    setattr(owner, attr, spy)


def _exempting(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def helper(*args: Any, **kwargs: Any) -> Any:
        _exempt.append(original.__name__)
        try:
            return original(*args, **kwargs)
        finally:
            _exempt.pop()

    return helper


def install() -> None:
    """Wrap every process-creating call once, for the whole session."""
    ctypes.util.find_library = _exempting(ctypes.util.find_library)
    _wrap(subprocess.Popen, "__init__", "subprocess.Popen")
    _wrap(multiprocessing.process.BaseProcess, "start", "multiprocessing.Process.start")
    for attr in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, attr):
            _wrap(os, attr, f"os.{attr}")
    for module in (asyncio, asyncio.subprocess):
        for attr in ("create_subprocess_exec", "create_subprocess_shell"):
            _wrap(module, attr, f"asyncio.{attr}")


@contextlib.contextmanager
def in_fixture(name: str) -> Iterator[None]:
    """While `name` sets up, a refused spawn names it."""
    _fixtures.append(name)
    try:
        yield
    finally:
        _fixtures.pop()


def watch(nodeid: str | None) -> None:
    """Refuse spawns for `nodeid` (a fast test) from now on; None stops refusing."""
    _current.clear()
    spawned.clear()
    if nodeid is not None:
        _current.append(nodeid)
