"""`python -m _forker ARGS...`: starts `asyncwt worker ARGS...` processes by forking
one warm process, for tests that kill many workers (a cold start imports torch and
takes seconds on a busy machine; a fork takes milliseconds).

Each line on stdin asks for one worker; the answer on stdout is `PID URL`. A line
`fds=N` asks for a worker that holds N more open descriptors before it serves (a
process with as many as a vLLM server may have: numbers past 1023). At EOF
every worker still running gets SIGTERM and the forker exits. Workers are reaped
automatically (SIGCHLD ignored): a killed one disappears from /proc.
"""

from __future__ import annotations

import os
import resource
import signal
import sys

import torch  # noqa: F401  (warm: every child inherits the import)

import asyncwt  # noqa: F401
from asyncwt._cli.main import main


def hold_descriptors(count: int) -> list[int]:
    """Open `count` more descriptors (kept for the process's life)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = count + 256
    if count and soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    return [os.open(os.devnull, os.O_RDONLY) for _ in range(count)]


def serve(args: list[str]) -> None:
    children: list[int] = []
    pipes: list[int] = []
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for request in sys.stdin:
        extra = int(request.strip().removeprefix("fds=") or 0)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            os.close(read)
            os.dup2(write, 1)
            os.close(write)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)  # fd 1 is the pipe now: sys.stdout writes there
            os.close(null)
            hold_descriptors(extra)
            os._exit(main(["worker", *args]))
        os.close(write)
        children.append(pid)
        line = b""
        while not line.endswith(b"\n"):
            chunk = os.read(read, 1)
            if not chunk:
                break
            line += chunk
        pipes.append(read)  # kept open: the worker may go on writing
        print(pid, line.decode().split()[-1] if line.strip() else "-", flush=True)
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1:])
