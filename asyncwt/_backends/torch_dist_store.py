"""The torch_dist group's rendezvous store, open only to peers that know the token.

torch's `TCPStore` serves any process that reaches its port: it lists its keys to
anyone, and anyone may write the ones a group forms from (a rank's address, the
NCCL id). So rank 0 serves its own store instead: `StoreServer` holds the keys in
memory and admits a connection only after the link's challenge–response (the
token, bound to this store by its own digest, so that nothing said on one channel
passes on the other). The trainer's own rank uses `LocalStore` over the same keys;
each worker a `StoreClient`, which also checks that the server knows the token.

Every request is bounded: keys and values in size, the store in keys and bytes,
each blocking wait by the store's timeout, and a connection that has not proved
the token within `handshake_timeout`, or the oldest in its handshake while
`max_pending_handshakes` are, is closed. The server runs on the trainer's event
loop, with no thread of its own: a request that waits for a key awaits it.

Wire format after the handshake, both ways: one byte (an op, or a status), one
byte counting the arguments, then each argument as a little-endian u32 length and
its bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import hashlib
import logging
import secrets
import socket
import struct
import threading
from collections.abc import Sequence
from typing import Any

import anyio
from torch._C._distributed_c10d import Store

from .._core.errors import AsyncwtError, AuthenticationError, ProtocolError, TransferError
from .._transports.sockio import recv_exact, send_all
from .._transports.wire import (
    CHALLENGE_SIZE,
    HELLO_SIZE,
    PROOF_SIZE,
    RESULT_SIZE,
    HandshakeStatus,
    check_result,
    pack_challenge,
    pack_hello,
    pack_proof,
    pack_result,
    proof_is_valid,
    unpack_hello,
    verify_challenge,
)

__all__ = ["LocalStore", "StoreClient", "StoreServer", "store_digest"]

logger = logging.getLogger("asyncwt")

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 1 << 20
MAX_KEYS = 4096
MAX_STORE_BYTES = 64 << 20
_ARGS = 4
_LEN = struct.Struct("<I")


class _Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    WAIT = 4
    CHECK = 5
    COMPARE_SET = 6
    DELETE = 7
    NUM_KEYS = 8


_OK, _ERROR = 0, 1


def store_digest(plan_digest: str) -> bytes:
    """The digest the store's handshake proves: the plan's, bound to this channel."""
    return hashlib.sha256(b"asyncwt-store\0" + bytes.fromhex(plan_digest)).digest()


def _pack(code: int, args: Sequence[bytes]) -> bytes:
    parts = [bytes((code, len(args)))]
    for arg in args:
        parts += [_LEN.pack(len(arg)), arg]
    return b"".join(parts)


def _read(sock: socket.socket, max_bytes: int) -> tuple[int, list[bytes]]:
    code, count = recv_exact(sock, 2)
    if count > _ARGS:
        raise ProtocolError(f"a store message should carry at most {_ARGS} arguments, got {count}")
    args = []
    for _ in range(count):
        (size,) = _LEN.unpack(recv_exact(sock, _LEN.size))
        if size > max_bytes:
            raise ProtocolError(f"a store argument should be at most {max_bytes} bytes, got {size}")
        args.append(bytes(recv_exact(sock, size)))
    return code, args


class _Keys:
    """The store's keys, shared by the server's connections and the local store."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.data: dict[str, bytes] = {}
        self.bytes = 0
        self.closed = False
        self.changed = threading.Condition()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    def _put(self, key: str, value: bytes) -> None:
        if len(key.encode()) > MAX_KEY_BYTES or len(value) > MAX_VALUE_BYTES:
            raise ValueError(
                f"store keys should be at most {MAX_KEY_BYTES} bytes and values at most "
                f"{MAX_VALUE_BYTES}, got {len(key.encode())} and {len(value)}"
            )
        old = self.data.get(key)
        grown = self.bytes + len(value) - (len(old) if old is not None else 0)
        if (old is None and len(self.data) >= MAX_KEYS) or grown > MAX_STORE_BYTES:
            raise ValueError(
                f"the store is full ({MAX_KEYS} keys, {MAX_STORE_BYTES} bytes at most)"
            )
        self.data[key] = value
        self.bytes = grown
        self._notify()

    def _notify(self) -> None:
        """Wake every wait, in threads and on event loops (called holding the lock)."""
        self.changed.notify_all()
        waiters, self._async_waiters = self._async_waiters, []
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # a loop that is closed waits for nothing
                loop.call_soon_threadsafe(event.set)

    async def wait_async(self, keys: Sequence[str], limit: float) -> None:
        """`wait`, without blocking the event loop."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while True:
            event = asyncio.Event()
            with self.changed:
                if self.closed:
                    raise TimeoutError("the store was closed")
                if all(k in self.data for k in keys):
                    return
                self._async_waiters.append((loop, event))
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"store keys {list(keys)} did not appear within {limit}s")
            with contextlib.suppress(TimeoutError), anyio.fail_after(remaining):
                await event.wait()

    def close(self) -> None:
        with self.changed:
            self.closed = True  # every wait ends now
            self._notify()

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self._put(key, value)

    def get(self, key: str, timeout: float | None = None) -> bytes:
        self.wait([key], timeout)
        with self.changed:
            return self.data[key]

    def add(self, key: str, amount: int) -> int:
        with self.changed:
            value = int(self.data.get(key, b"0")) + amount
            self._put(key, str(value).encode())
            return value

    def wait(self, keys: Sequence[str], timeout: float | None = None) -> None:
        limit = self.timeout if timeout is None else timeout
        with self.changed:
            if not self.changed.wait_for(
                lambda: self.closed or all(k in self.data for k in keys), limit
            ):
                raise TimeoutError(f"store keys {list(keys)} did not appear within {limit}s")
            if self.closed:
                raise TimeoutError("the store was closed")

    def check(self, keys: Sequence[str]) -> bool:
        with self.changed:
            return all(k in self.data for k in keys)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.changed:
            current = self.data.get(key)
            if (current is None and not expected) or current == expected:
                self._put(key, desired)
                return desired
            return expected if current is None else current

    def delete(self, key: str) -> bool:
        with self.changed:
            value = self.data.pop(key, None)
            if value is None:
                return False
            self.bytes -= len(value)
            return True

    def count(self) -> int:
        with self.changed:
            return len(self.data)

    def serve(self, op: int, args: list[bytes]) -> list[bytes]:
        """One request: its answer's arguments."""
        key = args[0].decode() if args else ""
        if op == _Op.SET and len(args) == 2:
            self.set(key, args[1])
            return []
        if op == _Op.GET and len(args) == 1:
            return [self.get(key)]
        if op == _Op.ADD and len(args) == 2:
            return [str(self.add(key, int(args[1]))).encode()]
        if op == _Op.WAIT and len(args) >= 1:
            limit = float(args[0])
            keys = [k.decode() for k in args[1:]]
            self.wait(keys, min(limit, self.timeout) if limit > 0 else None)
            return []
        if op == _Op.CHECK:
            return [b"1" if self.check([k.decode() for k in args]) else b"0"]
        if op == _Op.COMPARE_SET and len(args) == 3:
            return [self.compare_set(key, args[1], args[2])]
        if op == _Op.DELETE and len(args) == 1:
            return [b"1" if self.delete(key) else b"0"]
        if op == _Op.NUM_KEYS and not args:
            return [str(self.count()).encode()]
        raise ValueError(f"unknown store request: op {op} with {len(args)} arguments")


class LocalStore(Store):
    """Rank 0's view of the keys its `StoreServer` serves (no network)."""

    def __init__(self, keys: _Keys) -> None:
        super().__init__()
        self._keys = keys

    def set(self, key: str, value: Any) -> None:
        self._keys.set(key, _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._keys.get(key)

    def add(self, key: str, value: int) -> int:
        return self._keys.add(key, value)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._keys.wait(keys, None if timeout is None else timeout.total_seconds())

    def check(self, keys: list[str]) -> bool:
        return self._keys.check(keys)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return self._keys.compare_set(key, _as_bytes(expected_value), _as_bytes(desired_value))

    def delete_key(self, key: str) -> bool:
        return self._keys.delete(key)

    def num_keys(self) -> int:
        return self._keys.count()


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class StoreServer:
    """Serves the keys to workers that prove the token, on the trainer's event loop
    (no thread of its own: a request that waits for a key awaits it).

    `await start()` listens; `close()` stops it: the listener and every connection
    are closed, and every wait ends.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str,
        digest: bytes,
        timeout: float,
        handshake_timeout: float,
        max_pending: int,
        max_peers: int,
    ) -> None:
        self.keys = _Keys(timeout)
        self.token = token
        self.digest = digest
        self.handshake_timeout = handshake_timeout
        self.max_pending = max_pending
        self.max_peers = max_peers
        self.listener = socket.create_server((host, port), backlog=128)
        self.port: int = self.listener.getsockname()[1]
        self._server: asyncio.AbstractServer | None = None
        self._pending: dict[asyncio.StreamWriter, None] = {}
        """Connections still in their handshake, the oldest first."""
        self._peers: set[asyncio.StreamWriter] = set()
        self._closed = False

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, sock=self.listener)

    def local_store(self) -> LocalStore:
        return LocalStore(self.keys)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self._closed:
            writer.transport.abort()
            return
        if len(self._pending) >= self.max_pending:
            oldest = next(iter(self._pending))
            del self._pending[oldest]
            oldest.transport.abort()  # its handler ends on the error
        self._pending[writer] = None
        try:
            with anyio.fail_after(self.handshake_timeout):
                admitted = await self._handshake(reader, writer, address)
            if not admitted:
                return
            while True:
                code, count = await reader.readexactly(2)
                if count > _ARGS:
                    raise ProtocolError(f"a store request should carry at most {_ARGS} arguments")
                args = []
                for _ in range(count):
                    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
                    if size > MAX_VALUE_BYTES:
                        raise ProtocolError(
                            f"a store argument should be at most {MAX_VALUE_BYTES} bytes"
                        )
                    args.append(await reader.readexactly(size))
                try:
                    if code in (_Op.GET, _Op.WAIT):
                        await self._until_present(code, args)
                    answer = _OK, self.keys.serve(code, args)
                except (ValueError, TimeoutError, UnicodeDecodeError) as exc:
                    answer = _ERROR, [str(exc).encode()]
                writer.write(_pack(*answer))
                await writer.drain()
        except (
            OSError,
            EOFError,
            TimeoutError,
            AsyncwtError,
        ) as exc:  # IncompleteReadError is an EOFError
            if not self._closed:
                logger.debug("asyncwt: store connection %s ended: %r", address, exc)
        finally:
            self._pending.pop(writer, None)
            self._peers.discard(writer)
            writer.transport.abort()

    async def _until_present(self, code: int, args: list[bytes]) -> None:
        """Await the keys a GET or WAIT names (bounded by the store's timeout)."""
        if code == _Op.GET:
            keys, limit = [args[0].decode()] if args else [], self.keys.timeout
        else:
            asked = float(args[0]) if args else 0.0
            keys = [k.decode() for k in args[1:]]
            limit = min(asked, self.keys.timeout) if asked > 0 else self.keys.timeout
        await self.keys.wait_async(keys, limit)

    async def _handshake(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, address: str
    ) -> bool:
        worker_nonce, worker_digest = unpack_hello(await reader.readexactly(HELLO_SIZE))
        trainer_nonce = secrets.token_bytes(32)
        writer.write(pack_challenge(self.token, worker_nonce, trainer_nonce, self.digest))
        await writer.drain()
        proof = await reader.readexactly(PROOF_SIZE)
        if not proof_is_valid(self.token, worker_nonce, trainer_nonce, self.digest, proof):
            status = HandshakeStatus.BAD_PROOF
        elif worker_digest != self.digest:
            status = HandshakeStatus.PLAN_MISMATCH
        elif len(self._peers) >= self.max_peers:
            status = HandshakeStatus.FULL
        elif writer not in self._pending:
            return False  # evicted meanwhile
        else:
            status = HandshakeStatus.OK
            del self._pending[writer]
            self._peers.add(writer)
        writer.write(pack_result(status))
        await writer.drain()
        if status != HandshakeStatus.OK:
            logger.warning("asyncwt: store refused %s: %s", address, status.name)
            return False
        return True

    def close(self) -> None:
        self._closed = True
        if self._server is not None:
            self._server.close()
        self.listener.close()
        for writer in [*self._pending, *self._peers]:
            writer.transport.abort()
        self.keys.close()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class StoreClient(Store):
    """A worker's connection to rank 0's `StoreServer`, after proving the token."""

    def __init__(self, host: str, port: int, *, token: str, digest: bytes, timeout: float) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise TransferError(
                f"could not connect to the torch_dist store at {host}:{port}: {exc}"
            ) from exc
        try:
            nonce = secrets.token_bytes(32)
            send_all(self._sock, pack_hello(nonce, digest))
            trainer_nonce = verify_challenge(
                token, nonce, digest, recv_exact(self._sock, CHALLENGE_SIZE)
            )
            send_all(self._sock, pack_proof(token, nonce, trainer_nonce, digest))
            check_result(recv_exact(self._sock, RESULT_SIZE))
            self._sock.settimeout(timeout + 30)  # the server bounds each wait by `timeout`
        except AuthenticationError:
            self._sock.close()
            raise
        except (OSError, AsyncwtError) as exc:
            self._sock.close()
            raise TransferError(
                f"handshake with the torch_dist store at {host}:{port} failed: {exc}"
            ) from exc

    def _call(self, op: _Op, *args: bytes) -> list[bytes]:
        if self._closed:
            if op == _Op.CHECK:
                return [b"0"]  # a probe of a flag (a watchdog's): not set
            raise RuntimeError("torch_dist store: closed once the group formed")
        with self._lock:
            send_all(self._sock, _pack(op, args))
            status, answer = _read(self._sock, MAX_VALUE_BYTES)
        if status != _OK:
            message = answer[0].decode("utf-8", "replace") if answer else "no reason"
            raise RuntimeError(f"torch_dist store: {message}")
        return answer

    def set(self, key: str, value: Any) -> None:
        self._call(_Op.SET, key.encode(), _as_bytes(value))

    def get(self, key: str) -> bytes:
        return self._call(_Op.GET, key.encode())[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(_Op.ADD, key.encode(), str(value).encode())[0])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = b"0" if timeout is None else str(timeout.total_seconds()).encode()
        self._call(_Op.WAIT, limit, *(k.encode() for k in keys))

    def check(self, keys: list[str]) -> bool:
        return self._call(_Op.CHECK, *(k.encode() for k in keys))[0] == b"1"

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        args = (_as_bytes(expected_value), _as_bytes(desired_value))
        return self._call(_Op.COMPARE_SET, key.encode(), *args)[0]

    def delete_key(self, key: str) -> bool:
        return self._call(_Op.DELETE, key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(_Op.NUM_KEYS)[0])

    def close(self) -> None:
        self._closed = True
        _shut(self._sock)
        self._sock.close()
