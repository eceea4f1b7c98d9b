"""Peer approaches: how weights were pushed before packed, pipelined transfers.

Each runs trainer → worker across two processes on the same model, and every round
ends only when the worker's model holds the new weights (the same finish line as
asyncwt's `send_weights`). The worker checks its checksum once at the end.

- `naive`: one message per tensor — a small header (name, size), then the tensor
  serialised to `bytes` (a copy, as `tensor.numpy().tobytes()` or pickling does),
  one `sendall`; the worker receives into a fresh buffer, copies it into its
  parameter and acknowledges before the next tensor (request/response per tensor,
  as an RPC per tensor does). No packing, no pipelining.
- `gloo`: a two-process gloo group; one `broadcast` per tensor straight into the
  worker's parameter, a barrier at the end of the round.
- `packed`: the same buckets as asyncwt's plan; pack one (copy into a reused,
  touched staging buffer), send it in 1 MiB calls, the worker receives into a
  reused buffer, unpacks into its parameters and acknowledges; then the next
  bucket. Packed, but strictly sequential: nothing overlaps.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Self

from .._core.bytes import byte_view, empty_bytes
from .._core.checksum import model_checksum
from .._core.plan import TransferPlan
from .._core.source import ModuleSource
from ._memory import MemoryProbe
from ._model import LlamaShape, worker_model_for
from ._procs import READY, Child, connect_child, start_child
from ._util import IO_TIMEOUT_S, Rounds, recv_exact, recv_into_all

__all__ = ["PEERS", "PEER_TITLES", "SOCKET_PEERS", "SocketPeer", "measure_peer", "peer_worker"]

PEERS = ("naive", "gloo", "packed")
"""Peer approaches, in the order they are run and reported."""

PEER_TITLES = {
    "naive": "naive per-tensor send",
    "gloo": "gloo broadcast per tensor",
    "packed": "packed, sequential",
}

_CHUNK = 1 << 20
_ACK = b"A"
_NAIVE_HEADER = struct.Struct("!HQ")
_BUCKET_HEADER = struct.Struct("!IQ")


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).view(torch.uint8)


# -- trainer side ---------------------------------------------------------------------


def measure_peer(
    approach: str,
    model: torch.nn.Module,
    shape: LlamaShape,
    rounds: Rounds,
    *,
    bucket_bytes: int,
    expected_checksum: str,
    log_dir: Path,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run `approach` for warmup + rounds; timings, memory both sides, bit-exactness."""
    if approach == "gloo":
        args = {"approach": approach, "shape": shape.to_json(), "rounds": rounds.total,
                "bucket_bytes": bucket_bytes}  # fmt: skip
        return _measure_gloo(model, rounds, args, expected_checksum, log_dir, env)
    if approach not in SOCKET_PEERS:
        raise ValueError(f"approach should be one of {PEERS}, got {approach!r}")
    with SocketPeer(
        approach, model, shape, rounds=rounds.total, bucket_bytes=bucket_bytes,
        log_dir=log_dir, env=env,
    ) as peer:  # fmt: skip
        result = _timed_with_memory(peer.child, rounds, peer.round_s, _model_bytes(model))
        checksum = peer.finish()
    return _finish(result, checksum, expected_checksum)


SOCKET_PEERS = ("naive", "packed")
"""The peers that run over one plain socket (`SocketPeer`)."""


class SocketPeer:
    """A socket peer's worker child, connected and ready for exactly `rounds` rounds.

    `round_s()` runs one round and returns its seconds; `finish()`, after the last
    round, returns the worker's model checksum. Kept open across other work, it lets
    the benchmark run a peer round right next to each asyncwt round.
    """

    def __init__(
        self,
        approach: str,
        model: torch.nn.Module,
        shape: LlamaShape,
        *,
        rounds: int,
        bucket_bytes: int,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        if approach not in SOCKET_PEERS:
            raise ValueError(f"approach should be one of {SOCKET_PEERS}, got {approach!r}")
        self.approach = approach
        self._model = model
        self._bucket_bytes = bucket_bytes
        self._log_dir = log_dir
        self._env = env
        self._args: dict[str, Any] = {
            "approach": approach,
            "shape": shape.to_json(),
            "rounds": rounds,
            "bucket_bytes": bucket_bytes,
        }
        self._stack = contextlib.ExitStack()
        self._child: Child | None = None
        self._sock: socket.socket | None = None
        self._one: Callable[[], float] | None = None

    @property
    def child(self) -> Child:
        if self._child is None:
            raise RuntimeError("SocketPeer used outside its `with` block")
        return self._child

    def __enter__(self) -> Self:
        with contextlib.ExitStack() as stack:
            child, sock = connect_child(
                stack, f"peer-{self.approach}", self._args, self._log_dir, self._env, IO_TIMEOUT_S
            )
            if self.approach == "naive":
                self._one = _naive_round(sock, self._model)
            else:
                self._one = _packed_round(sock, self._model, self._bucket_bytes)
            self._child, self._sock = child, sock
            self._stack = stack.pop_all()
        return self

    def round_s(self) -> float:
        """One round, start to the worker's last acknowledgement; seconds."""
        if self._one is None:
            raise RuntimeError("SocketPeer used outside its `with` block")
        return self._one()

    def finish(self) -> str:
        """After the last round: the worker's model checksum (and its clean exit)."""
        if self._sock is None:
            raise RuntimeError("SocketPeer used outside its `with` block")
        checksum = recv_exact(self._sock, 64).decode()
        self.child.wait(IO_TIMEOUT_S)
        return checksum

    def __exit__(self, *exc_info: object) -> None:
        self._child, self._sock, self._one = None, None, None
        self._stack.close()


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _timed_with_memory(
    child: Child, rounds: Rounds, one: Callable[[], float], nbytes: int
) -> dict[str, Any]:
    """Measure rounds; memory windows cover warm-up and timed rounds on both sides."""
    trainer = MemoryProbe()
    worker = MemoryProbe(child.pid)
    trainer.start()
    worker.start()
    try:
        result = rounds.measure(one, nbytes)
    finally:
        trainer_window = trainer.stop()
        worker_window = worker.stop()
    result["memory"] = {
        "trainer": trainer_window.as_dict(),
        "worker": worker_window.as_dict(),
    }
    return result


def _finish(result: dict[str, Any], checksum: str, expected: str) -> dict[str, Any]:
    result["worker_checksum"] = checksum
    result["bit_exact"] = checksum == expected
    return result


def _naive_round(sock: socket.socket, model: torch.nn.Module) -> Callable[[], float]:
    named = [(name.encode(), p.detach()) for name, p in model.named_parameters()]

    def one() -> float:
        start = time.perf_counter()
        for name, tensor in named:
            payload = bytes(byte_view(tensor))  # serialise: the copy naive stacks make
            sock.sendall(_NAIVE_HEADER.pack(len(name), len(payload)) + name)
            sock.sendall(payload)
            del payload
            if recv_exact(sock, 1) != _ACK:
                raise ConnectionError("the naive worker did not acknowledge a tensor")
        return time.perf_counter() - start

    return one


def _packed_layout(
    model: torch.nn.Module, bucket_bytes: int
) -> tuple[TransferPlan, list[torch.Tensor]]:
    """The packed peer's buckets, in registration order as a simple bucketed sync
    walks the model, and each plan parameter's bytes (both sides build the same)."""
    plan = TransferPlan.build(
        ModuleSource(model, layers_last=False).metadata, bucket_bytes=bucket_bytes
    )
    params = dict(model.named_parameters())
    return plan, [_flat_bytes(params[meta.name].data) for meta in plan.params]


def _packed_round(
    sock: socket.socket, model: torch.nn.Module, bucket_bytes: int
) -> Callable[[], float]:
    plan, flats = _packed_layout(model, bucket_bytes)
    staging: list[torch.Tensor] = []

    def one() -> float:
        start = time.perf_counter()
        if not staging:
            staging.append(empty_bytes(bucket_bytes))  # allocated once, reused
        buffer = staging[0]
        view = byte_view(buffer)
        for bucket in plan.buckets:
            offset = 0
            for s in bucket.slices:
                buffer[offset : offset + s.nbytes].copy_(flats[s.param][s.start : s.end])
                offset += s.nbytes
            sock.sendall(_BUCKET_HEADER.pack(bucket.index, offset))
            for pos in range(0, offset, _CHUNK):
                sock.sendall(view[pos : min(offset, pos + _CHUNK)])
            if recv_exact(sock, 1) != _ACK:
                raise ConnectionError("the packed worker did not acknowledge a bucket")
        return time.perf_counter() - start

    return one


def _measure_gloo(
    model: torch.nn.Module,
    rounds: Rounds,
    args: dict[str, Any],
    expected_checksum: str,
    log_dir: Path,
    env: Mapping[str, str] | None,
) -> dict[str, Any]:
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a default process group already exists in the benchmark process")
    timeout = datetime.timedelta(seconds=IO_TIMEOUT_S)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, 2, True, timeout=timeout, wait_for_workers=False
    )
    args["port"] = store.port
    params = [p.detach() for p in model.parameters()]
    with start_child("peer-gloo", args, log_dir, env) as child:
        _wait_key(store, "ready", child)
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timeout)
        try:

            def one() -> float:
                start = time.perf_counter()
                for p in params:
                    dist.broadcast(p, src=0)
                dist.barrier()  # the round ends when the worker holds every tensor
                return time.perf_counter() - start

            result = _timed_with_memory(child, rounds, one, _model_bytes(model))
            _wait_key(store, "checksum", child)
            checksum = store.get("checksum").decode()
        finally:
            dist.destroy_process_group()
        child.wait(IO_TIMEOUT_S)
    return _finish(result, checksum, expected_checksum)


def _wait_key(store: Any, key: str, child: Child) -> None:
    """Wait until the child sets `key` in the store, failing fast if it dies."""
    deadline = time.monotonic() + IO_TIMEOUT_S
    while not store.check([key]):
        child.check_alive(f"exited before setting {key!r}")
        if time.monotonic() > deadline:
            raise child.failure(f"did not set {key!r} within {IO_TIMEOUT_S}s")
        time.sleep(0.01)


# -- worker side (child process) -----------------------------------------------------


def peer_worker(approach: str, shape: str, rounds: int, bucket_bytes: int, port: int) -> None:
    """Child side of a peer approach: build the zero model, receive `rounds` rounds."""
    model = worker_model_for(LlamaShape.from_json(shape))
    if approach == "gloo":
        _gloo_worker(model, rounds, port)
        return
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(READY)
        for _ in range(rounds):
            if approach == "naive":
                _naive_receive(sock, model)
            else:
                _packed_receive(sock, model, bucket_bytes)
        sock.sendall(model_checksum(model).encode())


def _naive_receive(sock: socket.socket, model: torch.nn.Module) -> None:
    params = dict(model.named_parameters())
    for _ in range(len(params)):
        name_len, nbytes = _NAIVE_HEADER.unpack(recv_exact(sock, _NAIVE_HEADER.size))
        name = recv_exact(sock, name_len).decode()
        payload = bytearray(nbytes)  # a fresh buffer per tensor
        recv_into_all(sock, memoryview(payload), max(nbytes, 1))
        with torch.no_grad():
            _flat_bytes(params[name].data).copy_(torch.frombuffer(payload, dtype=torch.uint8))
        del payload
        sock.sendall(_ACK)


_RECEIVE: dict[int, tuple[TransferPlan, torch.Tensor, list[torch.Tensor]]] = {}


def _packed_receive(sock: socket.socket, model: torch.nn.Module, bucket_bytes: int) -> None:
    if bucket_bytes not in _RECEIVE:
        plan, flats = _packed_layout(model, bucket_bytes)
        _RECEIVE[bucket_bytes] = (plan, empty_bytes(bucket_bytes), flats)
    plan, buffer, flats = _RECEIVE[bucket_bytes]
    view = byte_view(buffer)
    for bucket in plan.buckets:
        index, nbytes = _BUCKET_HEADER.unpack(recv_exact(sock, _BUCKET_HEADER.size))
        if index != bucket.index or nbytes != bucket.payload_bytes:
            raise ConnectionError(f"expected bucket {bucket.index}, got {index} ({nbytes} bytes)")
        recv_into_all(sock, view[:nbytes], _CHUNK)
        offset = 0
        with torch.no_grad():
            for s in bucket.slices:
                flats[s.param][s.start : s.end].copy_(buffer[offset : offset + s.nbytes])
                offset += s.nbytes
        sock.sendall(_ACK)


def _gloo_worker(model: torch.nn.Module, rounds: int, port: int) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=IO_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timeout)  # type: ignore[attr-defined]
    store.set("ready", "1")
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timeout)
    try:
        params = [p.data for p in model.parameters()]
        for _ in range(rounds):
            for p in params:
                dist.broadcast(p, src=0)
            dist.barrier()
        store.set("checksum", model_checksum(model))
    finally:
        dist.destroy_process_group()
