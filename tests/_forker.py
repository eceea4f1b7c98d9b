"""`python -m _forker ARGS...`: starts `asyncwt worker ARGS...` processes by forking
one warm process, for tests that kill many workers (a cold start imports torch and
takes seconds on a busy machine; a fork takes milliseconds).

Each line on stdin asks for one worker; the answer on stdout is `PID URL`. At EOF
every worker still running gets SIGTERM and the forker exits. Workers are reaped
automatically (SIGCHLD ignored): a killed one disappears from /proc.
"""

from __future__ import annotations

import os
import signal
import sys

import torch  # noqa: F401  (warm: every child inherits the import)

import asyncwt  # noqa: F401
from asyncwt._cli.main import main


def serve(args: list[str]) -> None:
    children: list[int] = []
    pipes: list[int] = []
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for _ in sys.stdin:
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
