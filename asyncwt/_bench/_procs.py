"""Child processes of the benchmark: started here, always stopped here.

Every child writes its stderr to a log file in the output folder, so a failure is
reported with the child's own last words. Leaving the `with` block (normally, on an
error or on Ctrl-C) sends SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from typing_extensions import Self

__all__ = [
    "READY",
    "BenchChildError",
    "Child",
    "accept_from",
    "connect_child",
    "start_asyncwt_worker",
    "start_child",
]

READY = b"R"
"""What a child that connects back sends first (see `connect_child`)."""
START_TIMEOUT_S = 120.0
"""Seconds a child may take to start (import torch, build a GiB-sized model)."""
STOP_GRACE_S = 10.0


class BenchChildError(RuntimeError):
    """A child process failed or went quiet; the message quotes its log."""


class Child:
    """A running child process with its log; a context manager that stops it."""

    def __init__(self, proc: subprocess.Popen[bytes], role: str, log_path: Path) -> None:
        self.proc = proc
        self.role = role
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-chars:]

    def failure(self, what: str) -> BenchChildError:
        """An error for `what` going wrong, with the child's exit code and log tail."""
        code = self.proc.poll()
        state = "still running" if code is None else f"exit code {code}"
        tail = self.log_tail().strip() or "(its log is empty)"
        return BenchChildError(
            f"{self.role} child ({state}): {what}; its log {self.log_path}:\n{tail}"
        )

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise self.failure(what)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise self.failure(f"did not exit within {timeout}s") from None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stdin):
            if stream is not None:
                stream.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _log_path(log_dir: Path, role: str) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", role)
    path = log_dir / f"{stem}.log"
    n = 1
    while path.exists():
        n += 1
        path = log_dir / f"{stem}-{n}.log"
    return path


def _popen(
    cmd: list[str], role: str, log_dir: Path, env: Mapping[str, str] | None, stdout: int | None
) -> Child:
    path = _log_path(log_dir, role)
    child_env = dict(os.environ)
    child_env.update(env or {})
    with open(path, "wb") as log:
        proc = subprocess.Popen(
            cmd, stdout=stdout, stderr=log, stdin=subprocess.DEVNULL, env=child_env
        )
    return Child(proc, role, path)


def start_child(
    role: str, args: dict[str, Any], log_dir: Path, env: Mapping[str, str] | None = None
) -> Child:
    """Start `python -m asyncwt._bench._child ROLE JSON_ARGS` with `env` added."""
    cmd = [sys.executable, "-m", "asyncwt._bench._child", role, json.dumps(args)]
    return _popen(cmd, role, log_dir, env, subprocess.DEVNULL)


def start_asyncwt_worker(
    *,
    backend: str,
    log_dir: Path,
    env: Mapping[str, str],
    apply_threads: int | None = None,
    transform: str | None = None,
    transform_elementwise: bool = False,
    role: str = "asyncwt-worker",
) -> tuple[Child, str]:
    """Start a real `python -m asyncwt worker` serving the benchmark model; its URL.

    The model factory is `asyncwt._bench._model:worker_model` (shape from `env`).
    """
    cmd = [
        sys.executable, "-m", "asyncwt", "worker",
        "--model", "asyncwt._bench._model:worker_model",
        "--host", "127.0.0.1", "--port", "0", "--backend", backend,
    ]  # fmt: skip
    if apply_threads is not None:
        cmd += ["--apply-threads", str(apply_threads)]
    if transform is not None:
        cmd += ["--transform", transform]
        if transform_elementwise:
            cmd += ["--transform-elementwise"]
    child = _popen(cmd, role, log_dir, env, subprocess.PIPE)
    try:
        line = _first_line(child, START_TIMEOUT_S)
        match = re.search(r"listening on (http://\S+)", line)
        if match is None:
            raise child.failure(f"did not announce its URL; it printed {line!r}")
        _drain(child)
        return child, match.group(1)
    except BaseException:
        child.stop()
        raise


def _first_line(child: Child, timeout: float) -> str:
    stream = child.proc.stdout
    assert stream is not None
    deadline = time.monotonic() + timeout
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(stream, selectors.EVENT_READ)
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(timeout=left):
                raise child.failure(f"printed no line within {timeout}s")
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            data += chunk
    return data.decode(errors="replace").splitlines()[0] if data else ""


def _drain(child: Child) -> None:
    """Keep reading the child's stdout so that it never blocks on a full pipe."""
    stream = child.proc.stdout
    assert stream is not None

    def run() -> None:
        try:
            while os.read(stream.fileno(), 65536):
                pass
        except (OSError, ValueError):
            return

    threading.Thread(target=run, name=f"drain-{child.role}", daemon=True).start()


def accept_from(
    listener: socket.socket, child: Child, timeout: float = START_TIMEOUT_S
) -> socket.socket:
    """Accept the child's connection on `listener`, failing fast if the child dies."""
    deadline = time.monotonic() + timeout
    listener.settimeout(0.5)
    while True:
        try:
            sock, _ = listener.accept()
        except TimeoutError:
            child.check_alive("exited before connecting")
            if time.monotonic() > deadline:
                raise child.failure(f"did not connect within {timeout}s") from None
            continue
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


def connect_child(
    stack: contextlib.ExitStack,
    role: str,
    args: dict[str, Any],
    log_dir: Path,
    env: Mapping[str, str] | None,
    io_timeout: float,
) -> tuple[Child, socket.socket]:
    """Start a child that connects back to a loopback port (added to `args` as
    `port`) and sends `READY`; the child and its socket, both closed by `stack`."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        child = stack.enter_context(
            start_child(role, {**args, "port": listener.getsockname()[1]}, log_dir, env)
        )
        sock = stack.enter_context(accept_from(listener, child))
    sock.settimeout(io_timeout)
    first = sock.recv(1)
    if first != READY:
        raise child.failure(f"sent {first!r} instead of READY")
    return child, sock
