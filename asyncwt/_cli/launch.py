"""Start `asyncwt worker` in a child process: for the demo, examples, tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping

__all__ = ["start_worker", "stop_worker", "worker_process"]


def start_worker(
    model: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    start_timeout: float = 60.0,
) -> tuple[subprocess.Popen[str], str]:
    """Start `python -m asyncwt worker --model MODEL ARGS...`; return it and its base URL.

    The child picks a free port and announces it on its first line of output.
    """
    cmd = [sys.executable, "-m", "asyncwt", "worker", "--model", model, "--port", "0", *args]
    child_env = dict(os.environ if env is None else env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=child_env)
    line = _first_line(proc, start_timeout)
    match = re.search(r"listening on (http://\S+)", line)
    if match is None:
        stop_worker(proc)
        raise RuntimeError(
            f"asyncwt worker did not start (exit code {proc.poll()}); it printed {line!r}"
        )
    return proc, match.group(1)


def stop_worker(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL if the worker lingers; reap it and close its pipe."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
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


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first line of output, or '' if it does not come within `timeout`."""
    import threading

    lines: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: lines.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    return lines[0] if lines else ""
