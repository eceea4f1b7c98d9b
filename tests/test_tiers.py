"""The fast tier (`-m "not slow"`) starts no process: the spy in tests/_spawns.py refuses.

These tests are themselves in the fast tier, so each spawn below is refused before
the process exists; a command that would leave a file behind shows that it never ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes.util
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import _spawns
import pytest


@contextlib.contextmanager
def refused() -> Iterator[pytest.ExceptionInfo[pytest.fail.Exception]]:
    """Expect the spy's refusal, then forget it, so the test's phase does not fail."""
    with pytest.raises(
        pytest.fail.Exception, match=r"is in the fast tier \(not marked slow\)"
    ) as info:
        yield info
    assert _spawns.spawned, "the spy refused nothing"
    _spawns.spawned.clear()


def _touch(path: Path) -> list[str]:
    return [sys.executable, "-c", f"open({str(path)!r}, 'w').close()"]


def _run(path: Path) -> None:
    subprocess.run(_touch(path), check=True)


def _system(path: Path) -> None:
    os.system(" ".join(_touch(path)))


def _process(path: Path) -> None:
    child = multiprocessing.get_context("spawn").Process(target=Path.touch, args=(path,))
    child.start()
    child.join()


def _asyncio(path: Path) -> None:
    async def main() -> None:
        proc = await asyncio.create_subprocess_exec(*_touch(path))
        await proc.wait()

    asyncio.run(main())


@pytest.mark.parametrize(
    "spawn", [_run, _system, _process, _asyncio], ids=["popen", "system", "process", "asyncio"]
)
def test_a_fast_test_cannot_start_a_process(tmp_path: Path, spawn: Callable[[Path], None]) -> None:
    ran = tmp_path / "ran"
    with refused():
        spawn(ran)
    assert not ran.exists()


def test_a_spawn_in_a_fixture_names_the_fixture(tmp_path: Path) -> None:
    with _spawns.in_fixture("tests/test_x.py::worker"), refused() as failure:
        _run(tmp_path / "ran")
    assert "its fixture tests/test_x.py::worker started a process" in str(failure.value)
    assert "SPAWNING_FIXTURES" in str(failure.value)


def test_libcs_name_is_looked_up_in_a_fast_test() -> None:
    """find_library runs `ldconfig -p` once per interpreter: not a test's process."""
    assert ctypes.util.find_library("c") is not None


@pytest.mark.slow
def test_a_slow_test_starts_processes(tmp_path: Path) -> None:
    _run(tmp_path / "ran")
    assert (tmp_path / "ran").exists()
