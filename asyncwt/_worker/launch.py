"""Start `asyncwt worker` in a child process and learn its URL: the one worker launcher.

The demo, the examples, the tests and the benchmark (`asyncwt bench`, also inside
`--cluster`'s emulated hosts) all start their workers here. A worker announces
itself on its first line of output (`asyncwt worker listening on URL`); the
launcher reads that line within a deadline, then keeps draining the child's
stdout so that the child never blocks on a full pipe.

Starting and waiting are apart (`spawn_worker`, `wait_for_url`) so that a caller
can start several workers before it waits for the first; `start_worker` and
`worker_process` do both, and stop the child if it does not come up.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import IO

__all__ = [
    "WorkerStartError",
    "spawn_worker",
    "start_worker",
    "stop_worker",
    "wait_for_url",
    "worker_process",
]

_ANNOUNCEMENT = re.compile(r"listening on (http://\S+)")
STOP_GRACE_S = 10.0
"""Seconds a worker has to exit after SIGTERM before it gets SIGKILL."""


class WorkerStartError(RuntimeError):
    """A worker child exited or went quiet before it announced its URL."""


def spawn_worker(
    model: str,
    *args: str,
    host: str | None = None,
    port: int = 0,
    env: Mapping[str, str] | None = None,
    prefix: Sequence[str] = (),
    stderr: IO[bytes] | int | None = None,
) -> subprocess.Popen[bytes]:
    """Start `PREFIX... python -m asyncwt worker --model MODEL --port PORT ARGS...`.

    `port=0` lets the worker pick a free port; `host` (None: the worker's default)
    is the address it binds. `env` is the child's whole environment (None: this
    process's); `prefix` runs the command through another one (`ip netns exec`);
    `stderr` goes where the caller says (None: inherited). The child's stdout is a
    pipe that `wait_for_url` reads; its stdin is empty.
    """
    cmd = [*prefix, sys.executable, "-m", "asyncwt", "worker", "--model", model]
    if host is not None:
        cmd += ["--host", host]
    cmd += ["--port", str(port), *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        stdin=subprocess.DEVNULL,
        env=None if env is None else dict(env),
    )


def wait_for_url(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The base URL the worker announces on its first line; then drain its stdout.

    Raises `WorkerStartError` when no line comes within `timeout` seconds, or the
    line announces no URL (the child exited, or printed something else). The child
    is left running either way: stopping it is the caller's (`stop_worker`).
    """
    line = _first_line(proc, timeout)
    if line is None:
        raise WorkerStartError(f"asyncwt worker printed no line within {timeout}s ({_state(proc)})")
    match = _ANNOUNCEMENT.search(line)
    if match is None:
        raise WorkerStartError(
            f"asyncwt worker did not announce its URL ({_state(proc)}); it printed {line!r}"
        )
    _drain(proc)
    return match.group(1)


def start_worker(
    model: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    start_timeout: float = 60.0,
    host: str | None = None,
    stderr: IO[bytes] | int | None = None,
) -> tuple[subprocess.Popen[bytes], str]:
    """Start `python -m asyncwt worker --model MODEL ARGS...`; return it and its base URL.

    `spawn_worker` then `wait_for_url`, on a free port. If the worker does not come
    up it is stopped and `WorkerStartError` raised.
    """
    proc = spawn_worker(model, *args, host=host, env=env, stderr=stderr)
    try:
        return proc, wait_for_url(proc, start_timeout)
    except BaseException:
        stop_worker(proc)
        raise


def stop_worker(proc: subprocess.Popen[bytes], grace: float = STOP_GRACE_S) -> None:
    """SIGTERM, then SIGKILL if the worker lingers; reap it and close its pipe.

    Idempotent: a worker that already exited is only reaped.
    """
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


@contextlib.contextmanager
def worker_process(
    model: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    start_timeout: float = 60.0,
) -> Iterator[str]:
    """Run an `asyncwt worker` child for the block's duration; yield its base URL."""
    proc, url = start_worker(model, *args, env=env, start_timeout=start_timeout)
    try:
        yield url
    finally:
        stop_worker(proc)


def _state(proc: subprocess.Popen[bytes]) -> str:
    code = proc.poll()
    return "still running" if code is None else f"exit code {code}"


def _first_line(proc: subprocess.Popen[bytes], timeout: float) -> str | None:
    """The child's first line ('' if it closed its stdout first), None on timeout."""
    stream = proc.stdout
    assert stream is not None, "spawn_worker gives every worker a stdout pipe"
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                return None
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").splitlines()[0] if data else ""


def _drain(proc: subprocess.Popen[bytes]) -> None:
    """Keep reading the child's stdout so that it never blocks on a full pipe."""
    stream = proc.stdout
    assert stream is not None

    def run() -> None:
        try:
            while os.read(stream.fileno(), 65536):
                pass
        except (OSError, ValueError):
            return

    threading.Thread(target=run, name=f"drain-worker-{proc.pid}", daemon=True).start()
