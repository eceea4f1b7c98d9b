"""What the machine allows: raw loopback TCP and single-thread memcpy bandwidth.

These are the ceilings every approach is compared with, measured in the same run
on the same byte count:

- *raw loopback TCP*: a child process does blocking `sendall` of fixed-size chunks
  from an already-touched buffer as large as the model; this process
  `recv_into`s a preallocated, touched buffer of the same size. One stream, no
  framing, no packing: the best a plain socket does. Two chunk sizes are tried
  and the faster counts.
- *memcpy*: one thread (`torch.set_num_threads(1)`) copies every parameter's bytes
  into an already-touched buffer, as a pack stage would; *memcpy, 2 cores*: the
  same bytes cut in two halves, copied by two threads at once (what a one-host
  transport that keeps two cores copying could reach).
"""

from __future__ import annotations

import contextlib
import functools
import socket
import struct
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Self

from .._core.bytes import byte_view, empty_bytes
from ._cpu import CpuMeter, median_cores
from ._procs import READY, Child, connect_child
from ._util import IO_TIMEOUT_S, Rounds, recv_exact, recv_into_all

__all__ = [
    "RAW_CHUNKS",
    "MemcpyLimit",
    "RawLoopback",
    "measure_memcpy",
    "measure_raw_loopback",
    "raw_sender",
]

RAW_CHUNKS = (1 << 20, 4 << 20)
"""Chunk sizes (bytes per `sendall`/`recv_into`) tried for raw loopback."""

_GO = struct.Struct("!cI")


class MemcpyLimit:
    """Copies of every parameter's bytes into one touched buffer of the model's size,
    on one thread or on `cores` threads at once (each a contiguous share of the
    bytes, about equal). Every copy runs with one torch thread."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params = [p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()]
        self.total = sum(p.numel() for p in self._params)
        self._dst = empty_bytes(self.total)

    def _shares(self, cores: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        """(destination, source) runs of every parameter, cut into `cores` shares."""
        shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(cores)]
        offset = 0
        for p in self._params:
            done = 0
            while done < p.numel():
                share = min(cores - 1, offset * cores // max(1, self.total))
                end = (share + 1) * self.total // cores
                take = min(p.numel() - done, max(1, end - offset))
                dst = self._dst[offset : offset + take]
                shares[share].append((dst, p[done : done + take]))
                done += take
                offset += take
        return shares

    def round_s(self, cores: int = 1) -> float:
        """One copy of every byte on `cores` threads (this one among them); seconds."""
        shares = self._shares(cores)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            helpers = [
                threading.Thread(target=_copy_all, args=(share,), name=f"memcpy-{i}")
                for i, share in enumerate(shares[1:], start=1)
            ]
            start = time.perf_counter()
            for helper in helpers:
                helper.start()
            _copy_all(shares[0])
            for helper in helpers:
                helper.join()
            return time.perf_counter() - start
        finally:
            torch.set_num_threads(threads)


def _copy_all(runs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in runs:
        dst.copy_(src)


def measure_memcpy(model: torch.nn.Module, rounds: Rounds, cores: int = 1) -> dict[str, Any]:
    """Copy of every parameter into a touched buffer of the model's size, on `cores`
    threads at once."""
    limit = MemcpyLimit(model)
    return rounds.measure(functools.partial(limit.round_s, cores), limit.total, cores=cores)


def measure_raw_loopback(
    total: int, rounds: Rounds, log_dir: Path, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Raw one-stream loopback throughput for `total` bytes, per chunk size and best."""
    variants: dict[str, dict[str, Any]] = {}
    with RawLoopback(total, log_dir, env) as raw:
        for chunk in RAW_CHUNKS:
            raw.cores.clear()
            record = rounds.measure(functools.partial(raw.round_s, chunk), total, chunk_bytes=chunk)
            record["cores_busy"] = median_cores(raw.cores[rounds.warmup :])
            variants[f"{chunk >> 20}MiB"] = record
    best_key = max(variants, key=lambda k: variants[k]["gbps"])
    best = dict(variants[best_key])
    best["variant"] = best_key
    best["variants"] = variants
    return best


class RawLoopback:
    """A raw sender child connected to this process, for as many rounds as asked.

    Kept open, it lets a baseline round run right next to each round of another
    approach (see `asyncwt._bench._run`), so a machine whose speed drifts within
    seconds does not land the two in different phases. The receive buffer is
    allocated and touched once, on entry.
    """

    def __init__(self, total: int, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.total = total
        self._log_dir = log_dir
        self._env = env
        self._stack = contextlib.ExitStack()
        self._sock: socket.socket | None = None
        self._child: Child | None = None
        self._buffer: torch.Tensor | None = None
        self._view: memoryview | None = None
        self._meter: CpuMeter | None = None
        self.cores: list[dict[str, float]] = []
        """Cores each side kept busy, per round (`CpuMeter.cores_busy`), in order."""

    def __enter__(self) -> Self:
        with contextlib.ExitStack() as stack:
            child, sock = connect_child(
                stack, "raw-send", {"total": self.total}, self._log_dir, self._env, IO_TIMEOUT_S
            )
            self._buffer = empty_bytes(self.total)  # held: the view does not keep it alive
            self._view = byte_view(self._buffer)
            self._sock, self._child = sock, child
            self._meter = CpuMeter({"sender": child.pid, "receiver": None})
            self._stack = stack.pop_all()
        return self

    @property
    def sender_pid(self) -> int:
        """The raw sender child's process id (for CPU accounting)."""
        if self._child is None:
            raise RuntimeError("RawLoopback.sender_pid read outside its `with` block")
        return self._child.pid

    def round_s(self, chunk: int) -> float:
        """One round: the child sends `total` bytes in `chunk`-sized `sendall`s; seconds."""
        if self._sock is None or self._view is None or self._meter is None:
            raise RuntimeError("RawLoopback.round_s called outside its `with` block")
        mark = self._meter.mark()
        start = time.perf_counter()
        self._sock.sendall(_GO.pack(b"G", chunk))
        recv_into_all(self._sock, self._view, chunk)
        elapsed = time.perf_counter() - start
        self.cores.append(self._meter.cores_busy(mark, elapsed))
        return elapsed

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        """Let the child exit on its own after a clean run; stop it otherwise."""
        try:
            if exc_type is None and self._sock is not None and self._child is not None:
                self._sock.sendall(_GO.pack(b"Q", 0))
                self._child.wait(IO_TIMEOUT_S)
        finally:
            self._sock, self._child, self._view, self._buffer = None, None, None, None
            self._meter = None
            self._stack.close()


def raw_sender(port: int, total: int) -> None:
    """Child side: send `total` bytes per `G` command, in the chunk size it names."""
    src = empty_bytes(total)
    src.fill_(0x5A)
    view = byte_view(src)
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        sock.settimeout(None)  # plain blocking calls: the fastest path (the parent times out)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(READY)
        while True:
            command, chunk = _GO.unpack(recv_exact(sock, _GO.size))
            if command == b"Q":
                return
            for offset in range(0, total, chunk):
                sock.sendall(view[offset : offset + chunk])
