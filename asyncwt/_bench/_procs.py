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
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from typing_extensions import Self

from .._worker.launch import WorkerStartError, spawn_worker, stop_worker, wait_for_url

__all__ = [
    "READY",
    "BenchChildError",
    "Child",
    "accept_from",
    "connect_child",
    "spawn_bench_worker",
    "start_asyncwt_worker",
    "start_child",
    "worker_url",
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
        stop_worker(self.proc, grace=STOP_GRACE_S)  # any child: SIGTERM, SIGKILL, reap
        if self.proc.stdin is not None:
            self.proc.stdin.close()

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


BENCH_MODEL = "asyncwt._bench._model:worker_model"
"""The model factory every benchmark worker serves (its shape comes from the env)."""


def spawn_bench_worker(
    role: str,
    log_dir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    prefix: Sequence[str] = (),
    model: str = BENCH_MODEL,
) -> Child:
    """Start a real `asyncwt worker` serving the benchmark model (or `model`'s
    factory), `env` added to ours.

    The worker launcher's `spawn_worker`, with the child's stderr in its log; learn
    its URL with `worker_url`.
    """
    path = _log_path(log_dir, role)
    child_env = {**os.environ, **(env or {})}
    with open(path, "wb") as log:
        proc = spawn_worker(
            model, *args, host=host, port=port, env=child_env, prefix=prefix, stderr=log
        )
    return Child(proc, role, path)


def worker_url(child: Child) -> str:
    """The URL a worker from `spawn_bench_worker` announces; its log quoted if none."""
    try:
        return wait_for_url(child.proc, START_TIMEOUT_S)
    except WorkerStartError as exc:
        raise child.failure(str(exc)) from None


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
    """Start a real `python -m asyncwt worker` serving the benchmark model; its URL."""
    args = ["--backend", backend]
    if apply_threads is not None:
        args += ["--apply-threads", str(apply_threads)]
    if transform is not None:
        args += ["--transform", transform]
        if transform_elementwise:
            args += ["--transform-elementwise"]
    child = spawn_bench_worker(role, log_dir, *args, env=env)
    try:
        return child, worker_url(child)
    except BaseException:
        child.stop()
        raise


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
