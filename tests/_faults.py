"""Fault-injection helpers shared by the end-to-end suites.

- `FaultySource`: a `ModuleSource` that can be bent (wrong order, slow) mid-test;
- `CutProxy` / `ProxyClient`: route each worker's data connection through a proxy
  that cuts it after a chosen number of trainer → worker bytes;
- leak probes for this process (`open_fds`, `threads_in_asyncwt`) and for a worker
  process (`proc_fds`, `proc_rss`);
- `python -m _faults trainer URL BACKEND`: a trainer in a process of its own, for
  tests that kill the trainer mid-round.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import _models
import torch

from asyncwt import (
    HttpClient,
    ModuleSource,
    ParamMeta,
    ShmTrainerInitInfo,
    TcpTrainerInitInfo,
    Timeouts,
    TorchDistTrainerInitInfo,
    TrainerInitInfo,
    WeightSource,
    model_checksum,
)
from asyncwt._transports.wire import FRAME_SIZE

TESTS = Path(__file__).resolve().parent

BACKENDS = ["tcp", "shm", "torch_dist"]
INFO_CLASSES: dict[str, type[TrainerInitInfo]] = {
    "tcp": TcpTrainerInitInfo,
    "shm": ShmTrainerInitInfo,
    "torch_dist": TorchDistTrainerInitInfo,
}

SMALL_TIMEOUTS = Timeouts(send=2.0, ready=2.0, recv=2.0, drain=2.0, rpc=3.0)
"""Timeouts for tests that stall a peer on purpose: every wait ends within seconds."""


def worker_env(**extra: str) -> dict[str, str]:
    """The environment of a worker process: the tests directory importable."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


def info_for(backend: str, workers: int = 1, **kwargs: Any) -> TrainerInitInfo:
    """Trainer init info of `backend` for `workers` workers, with test-sized buckets."""
    kwargs.setdefault("bucket_bytes", _models.BUCKET_BYTES)
    if backend == "torch_dist":
        kwargs["num_workers"] = workers
    return INFO_CLASSES[backend](rank=0, **kwargs)


async def assert_worker_has(client: HttpClient, model: torch.nn.Module, version: str) -> None:
    """Every worker published `version` and holds exactly `model`'s weights."""
    expected = model_checksum(model)
    for status in await client.weights_status(checksum=True):
        assert (status["weight_version"], status["checksum"]) == (version, expected)
        assert status["weights_incomplete"] is False


def shm_leftovers() -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith("asyncwt_")]


# -- sources ----------------------------------------------------------------------------


class FaultySource(WeightSource):
    """`ModuleSource` whose iteration can be bent to break the contract, or slowed."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = ModuleSource(model)
        self.fault: (
            Callable[[list[tuple[str, torch.Tensor]]], list[tuple[str, torch.Tensor]]] | None
        ) = None
        self.delay = 0.0
        """Seconds to sleep before each yield."""
        self.hang_at: str | None = None
        """Block (up to a minute) before yielding this parameter: a round stuck midway."""

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        pairs = list(self.inner.iter_full())
        if self.fault is not None:
            pairs = self.fault(pairs)
        for pair in pairs:
            if self.delay:
                time.sleep(self.delay)
            if pair[0] == self.hang_at:
                time.sleep(60)
            yield pair


# -- leak probes ------------------------------------------------------------------------


def open_fds(pid: int | str = "self") -> int:
    """Open file descriptors of a process (this one by default)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def proc_rss(pid: int | str = "self") -> int:
    """Resident set size of a process, in bytes."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def proc_threads(pid: int | str = "self") -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def threads_in_asyncwt() -> list[str]:
    """Threads other than this one currently executing asyncwt code.

    A worker launcher's stdout drain (`drain-worker-PID`) lives as long as its
    worker process, by design, and is no thread of a round: it is not counted.
    """
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    busy = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident() or names.get(ident, "").startswith("drain-worker-"):
            continue
        stack = []
        while frame is not None:
            stack.append(frame.f_code.co_filename)
            frame = frame.f_back
        if any(f"{os.sep}asyncwt{os.sep}" in f for f in stack):
            busy.append(str(ident))
    return busy


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `predicate` (blocking) until it holds; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


# -- the cutting proxy ------------------------------------------------------------------


def round_wire_bytes(plan: Any, backend: str) -> int:
    """Bytes the trainer writes to one worker's connection in one round."""
    headers = (len(plan.buckets) + 1) * FRAME_SIZE  # every BUCKET header, then END
    return headers + (plan.total_bytes if backend == "tcp" else 0)


class CutProxy:
    """Forwards one worker's data connection to the trainer, in a thread.

    Once `arm(n)` was called, it forwards exactly `n` more bytes from the trainer
    to the worker, then closes both sides (the worker reads EOF mid-stream, the
    trainer's next send fails). Bytes from the worker always pass.
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self._budget: int | None = None
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self.cut = threading.Event()
        self.thread = threading.Thread(target=self._run, name="cut-proxy", daemon=True)
        self.thread.start()

    def arm(self, nbytes: int) -> None:
        with self._lock:
            self._budget = nbytes

    def _run(self) -> None:
        try:
            self.listener.settimeout(30)
            worker, _ = self.listener.accept()
            trainer = socket.create_connection(self.target, timeout=30)
        except OSError:
            return
        finally:
            self.listener.close()
        self._socks = [worker, trainer]
        try:
            self._forward(worker, trainer)
        except OSError:
            pass
        finally:
            self._close_all()

    def _forward(self, worker: socket.socket, trainer: socket.socket) -> None:
        while True:
            readable, _, _ = select.select([worker, trainer], [], [], 30)
            if not readable:
                return
            for sock in readable:
                data = sock.recv(1 << 16)
                if not data:
                    return
                if sock is worker:
                    trainer.sendall(data)
                    continue
                with self._lock:
                    budget = self._budget
                    if budget is not None:
                        self._budget = max(budget - len(data), 0)
                if budget is not None and budget <= len(data):
                    worker.sendall(data[:budget])
                    self.cut.set()
                    return
                worker.sendall(data)

    def _close_all(self) -> None:
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.close()
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the proxy thread did not stop"


class ProxyClient(HttpClient):
    """Routes each worker's data connection through a fresh `CutProxy` per init.

    Needs one worker: the trainer's init info names its listener, which the proxy
    connects to; the worker is told the proxy's port instead.
    """

    proxy: CutProxy | None = None

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.close_proxy()
        self.proxy = CutProxy(init_info["host"], init_info["port"])
        await super().init_weight_transfer_engine({**init_info, "port": self.proxy.port})

    def close_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None


# -- a trainer in a process of its own --------------------------------------------------


def start_trainer(url: str, backend: str) -> subprocess.Popen[str]:
    """`python -m _faults trainer URL BACKEND` (see `_trainer_main`)."""
    cmd = [sys.executable, "-m", "_faults", "trainer", url, backend]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=worker_env())


def read_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's next line of output; fails after `timeout` seconds.

    Read on a thread, not with select(): a line already sitting in the pipe
    object's buffer (two lines read in one chunk) is invisible to select().
    """
    stdout = proc.stdout
    assert stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not lines:
        raise AssertionError(f"the child printed nothing within {timeout}s")
    return lines[0].strip()


def _trainer_main(url: str, backend: str) -> None:
    """Push one round (prints its checksum as JSON), then start a second round
    (prints `sending`) that sends all but its last bucket and waits to be killed."""
    import anyio

    from asyncwt import trainer_init

    async def main() -> None:
        async with HttpClient(url, timeout=60) as client:
            model = _models.mixed()
            source = FaultySource(model)
            info = info_for(backend, timeouts=Timeouts(recv=5.0, drain=5.0))
            engine = await trainer_init(info, client=client, source=source)
            _models.randomize(model, seed=101)
            await engine.send_weights(weight_version="from-child")
            print(json.dumps({"checksum": model_checksum(model)}), flush=True)
            source.hang_at = "tail"  # every bucket but the last goes out; then it waits
            _models.randomize(model, seed=102)
            print("sending", flush=True)
            await engine.send_weights(weight_version="never-published")
            print("finished", flush=True)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})


if __name__ == "__main__":
    if sys.argv[1:2] == ["trainer"]:
        _trainer_main(*sys.argv[2:4])
    else:
        raise SystemExit(f"usage: python -m _faults trainer URL BACKEND, got {sys.argv[1:]}")
