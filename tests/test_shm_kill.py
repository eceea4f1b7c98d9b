"""No shared-memory name survives the trainer's whole process group being SIGKILLed
during `trainer_init` (issue 23, finding 8)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from _faults import read_line, worker_env

from asyncwt._backends.shm import memfd as _memfd

pytestmark = pytest.mark.slow


def _memfds(pid: int) -> list[str]:
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return [t for t in targets if t.startswith("/memfd:asyncwt_ring_")]


def test_sigkill_of_the_trainers_group_during_init_leaves_no_shm_name() -> None:
    """The trainer (and whatever it started, such as Python's resource tracker) is
    killed with SIGKILL while it listens for workers, ring made: nothing of it is
    left in /dev/shm, because the ring never had a name there."""
    cmd = [sys.executable, "-m", "_stalled_trainer", "shm"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env=worker_env(), start_new_session=True
    )
    try:
        init_info = json.loads(read_line(proc, 60))
        ring = sorted(set(_memfds(proc.pid)))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    names = list(init_info["segments"])
    leaked = [name for name in names if os.path.exists(f"/dev/shm/{name}")]
    for name in leaked:  # do not leave them to the next test
        os.unlink(f"/dev/shm/{name}")
    assert leaked == []
    if not _memfd.supported():  # pragma: no cover - Linux has memfd
        pytest.skip("named segments: only Linux can make the ring nameless")
    assert names == []
    assert _memfd.SOCKET_NAME.match(init_info["ring_socket"])
    slots = range(init_info["num_buffers"])
    assert ring == [f"/memfd:asyncwt_ring_{i} (deleted)" for i in slots]  # the ring, nameless
