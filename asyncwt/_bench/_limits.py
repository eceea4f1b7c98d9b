"""What the machine allows: raw loopback TCP and single-thread memcpy bandwidth.

These are the ceilings every approach is compared with, measured in the same run
on the same byte count:

- *raw loopback TCP*: a child process does blocking `sendall` of fixed-size chunks
  from an already-touched buffer as large as the model; this process
  `recv_into`s a preallocated, touched buffer of the same size. One stream, no
  framing, no packing: the best a plain socket does. Two chunk sizes are tried
  and the faster counts.
- *memcpy*: one thread (`torch.set_num_threads(1)`) copies every parameter's bytes
  into an already-touched buffer, as a pack stage would.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from .._bytes import byte_view, empty_bytes
from ._procs import accept_from, start_child
from ._util import IO_TIMEOUT_S, Rounds, recv_exact, recv_into_all

__all__ = ["RAW_CHUNKS", "measure_memcpy", "measure_raw_loopback", "raw_sender"]

RAW_CHUNKS = (1 << 20, 4 << 20)
"""Chunk sizes (bytes per `sendall`/`recv_into`) tried for raw loopback."""

_GO = struct.Struct("!cI")
_READY = b"R"


def measure_memcpy(model: torch.nn.Module, rounds: Rounds) -> dict[str, Any]:
    """Single-thread copy of every parameter into a touched buffer of the model's size."""
    params = [p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()]
    total = sum(p.numel() for p in params)
    dst = empty_bytes(total)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:

        def one() -> float:
            start = time.perf_counter()
            offset = 0
            for p in params:
                dst[offset : offset + p.numel()].copy_(p)
                offset += p.numel()
            return time.perf_counter() - start

        return rounds.measure(one, total)
    finally:
        torch.set_num_threads(threads)


def measure_raw_loopback(
    total: int, rounds: Rounds, log_dir: Path, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """Raw one-stream loopback throughput for `total` bytes, per chunk size and best."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        args = {"port": port, "total": total}
        with start_child("raw-send", args, log_dir, env) as child:
            sock = accept_from(listener, child)
            with sock:
                sock.settimeout(IO_TIMEOUT_S)
                if recv_exact(sock, 1) != _READY:
                    raise child.failure("sent something other than READY")
                dst = empty_bytes(total)
                view = byte_view(dst)
                variants: dict[str, Any] = {}
                for chunk in RAW_CHUNKS:
                    variants[f"{chunk >> 20}MiB"] = rounds.measure(
                        _receive_round(sock, view, chunk), total, chunk_bytes=chunk
                    )
                sock.sendall(_GO.pack(b"Q", 0))
                child.wait(IO_TIMEOUT_S)
                del view, dst
    best_key = max(variants, key=lambda k: variants[k]["gbps"])
    best = dict(variants[best_key])
    best["variant"] = best_key
    best["variants"] = variants
    return best


def _receive_round(sock: socket.socket, view: memoryview, chunk: int) -> Callable[[], float]:
    def one() -> float:
        start = time.perf_counter()
        sock.sendall(_GO.pack(b"G", chunk))
        recv_into_all(sock, view, chunk)
        return time.perf_counter() - start

    return one


def raw_sender(port: int, total: int) -> None:
    """Child side: send `total` bytes per `G` command, in the chunk size it names."""
    src = empty_bytes(total)
    src.fill_(0x5A)
    view = byte_view(src)
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        sock.settimeout(None)  # plain blocking calls: the fastest path (the parent times out)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(_READY)
        while True:
            command, chunk = _GO.unpack(recv_exact(sock, _GO.size))
            if command == b"Q":
                return
            for offset in range(0, total, chunk):
                sock.sendall(view[offset : offset + chunk])
