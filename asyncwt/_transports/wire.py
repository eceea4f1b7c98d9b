"""Binary frames of the data connection and its authentication handshake (sans-I/O).

Every frame starts with a fixed 48-byte header; nothing on this connection is
pickled or parsed as text. A receiver validates each header against its plan
before it touches a byte of payload, so a peer cannot make it allocate or read
anything the plan does not already allow.

Handshake (the worker connects; the token itself never crosses the connection)::

    worker  → HELLO     magic, protocol, worker nonce, plan digest
    trainer → CHALLENGE magic, trainer nonce, HMAC(token, "trainer" | nonces | digest)
    worker  → PROOF     magic, HMAC(token, "worker" | nonces | digest)
    trainer → RESULT    magic, status (0 ok, 1 bad proof, 2 plan mismatch, 3 full)
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass
from typing import Any

from .._core.errors import AuthenticationError, PlanMismatchError, ProtocolError

__all__ = [
    "ABORT_REASON_MAX",
    "DELTA_HEADER_BYTES",
    "FRAME_SIZE",
    "Frame",
    "FrameKind",
    "HandshakeStatus",
]

PROTOCOL_VERSION = 2
"""2: ROUTE carries the round's keys of the worker's two chain edges."""
FRAME_MAGIC = b"AWTF"
_FRAME = struct.Struct("<4sB3sQII16sQ")
_RESERVED = bytes(3)
FRAME_SIZE = _FRAME.size
ABORT_REASON_MAX = 4096
DELTA_HEADER_BYTES = 40
"""Length of the header that opens a DELTA frame's payload (`asyncwt._delta.codec`)."""
DIGEST_PREFIX = 16


class FrameKind(enum.IntEnum):
    """What a data-connection frame announces."""

    READY = 1
    """Worker → trainer: the worker is receiving round `round_id`."""
    BUCKET = 2
    """Trainer → worker: bucket `index`, then `nbytes` of payload."""
    END = 3
    """Trainer → worker: round complete; `index` is the bucket count."""
    ABORT = 4
    """Trainer → worker: round abandoned; `nbytes` of UTF-8 reason follow."""
    RELEASE = 5
    """Worker → trainer: the worker is done with shared buffer `slot` (or, after a
    BUCKET_AT, with bucket `index`'s memory)."""
    BUCKET_AT = 6
    """Trainer → worker: bucket `index` (`nbytes` long) lies in the trainer's memory;
    one little-endian u64 address per slice of the bucket follows, for the worker
    to read from (same host, see `asyncwt._backends.shm.cma`)."""
    DELTA = 7
    """Trainer → worker: bucket `index` coded against the previous round's bytes;
    `nbytes` of a delta header and its body follow (`asyncwt._delta.codec`). In a
    round with deltas, READY's `index` names the round whose bytes the worker holds
    (its low 32 bits; 0: none)."""
    LISTEN = 8
    """Worker → trainer, once after the handshake (`"tcp"` chain or fleet): the worker's
    member number in `index`, its relay listener's port in `slot` (0: none) and its
    host in `nbytes` of UTF-8 that follow (see `asyncwt._backends.tcp.relay`)."""
    ROUTE = 9
    """Trainer → worker, each round of a `"tcp"` chain: the worker's place in the chain
    in `index`; its successor's relay port in `slot` (0: it is the tail); `nbytes`
    follow: the round's key of the edge into this worker and of the edge out of it
    (`EDGE_KEY_BYTES` each, see `edge_secret`), then the successor's host in UTF-8
    (none for the tail)."""
    LAYOUT = 10
    """Worker → trainer, once after the handshake (a star with `slices=True`): the
    box of each parameter the worker holds, `nbytes` of them (a length the plan
    fixes, see `asyncwt._core.slices.pack_layout`)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """One frame header."""

    kind: FrameKind
    round_id: int
    index: int
    digest: bytes
    nbytes: int
    slot: int = 0
    """Which shared buffer holds the payload (shared-memory backend), else 0."""

    def pack(self) -> bytes:
        return _FRAME.pack(
            FRAME_MAGIC,
            self.kind,
            _RESERVED,
            self.round_id,
            self.index,
            self.slot,
            self.digest,
            self.nbytes,
        )

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Frame:
        """Parse a header; a wrong size, magic, reserved bytes or kind is a `ProtocolError`.

        Only the header's own consistency is checked here; whether it fits the round
        and the plan is the reader's business (`WorkerLink.frames`).
        """
        magic, kind, reserved, round_id, index, slot, digest, nbytes = _unpack(
            _FRAME, data, "frame header"
        )
        if magic != FRAME_MAGIC:
            raise ProtocolError(f"frame magic should be {FRAME_MAGIC!r}, got {magic!r}")
        if reserved != _RESERVED:
            raise ProtocolError(f"frame reserved bytes should be zero, got {reserved.hex()}")
        try:
            frame_kind = FrameKind(kind)
        except ValueError:
            raise ProtocolError(f"frame kind {kind} is not one of {list(map(int, FrameKind))}")
        return cls(frame_kind, round_id, index, digest, nbytes, slot)


def _unpack(
    layout: struct.Struct, data: bytes | bytearray | memoryview, what: str
) -> tuple[Any, ...]:
    if len(data) != layout.size:
        raise ProtocolError(f"{what} should be {layout.size} bytes, got {len(data)}")
    return layout.unpack(data)


def digest_prefix(digest_hex: str) -> bytes:
    """The first bytes of a plan digest, carried in every frame header."""
    return bytes.fromhex(digest_hex)[:DIGEST_PREFIX]


class HandshakeStatus(enum.IntEnum):
    OK = 0
    BAD_PROOF = 1
    PLAN_MISMATCH = 2
    FULL = 3


_HELLO = struct.Struct("<4sI32s32s")
_CHALLENGE = struct.Struct("<4s32s32s")
_PROOF = struct.Struct("<4s32s")
_RESULT = struct.Struct("<4sI")
HELLO_SIZE, CHALLENGE_SIZE, PROOF_SIZE, RESULT_SIZE = (
    _HELLO.size,
    _CHALLENGE.size,
    _PROOF.size,
    _RESULT.size,
)


EDGE_KEY_BYTES = 32
"""Length of a round's key for one edge of a `"tcp"` chain."""


def edge_secret(token: str, key: bytes) -> str:
    """What a chain's relay handshake proves instead of the token alone: the token
    and the round's key for that edge, which only the trainer and the edge's two
    ends hold. Every worker holds the token, so the token alone must admit nobody
    at a relay listener."""
    return f"{token}:{key.hex()}"


def _mac(token: str, role: bytes, first: bytes, second: bytes, digest: bytes) -> bytes:
    return hmac.new(token.encode(), role + b"|" + first + second + digest, hashlib.sha256).digest()


def pack_hello(nonce: bytes, digest: bytes) -> bytes:
    return _HELLO.pack(b"AWTH", PROTOCOL_VERSION, nonce, digest)


def unpack_hello(data: bytes) -> tuple[bytes, bytes]:
    """`(worker nonce, plan digest)` of a HELLO; anything else is a `ProtocolError`."""
    magic, version, nonce, digest = _unpack(_HELLO, data, "handshake HELLO")
    if magic != b"AWTH":
        raise ProtocolError(f"handshake HELLO magic should be b'AWTH', got {magic!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks protocol version {version}, this side speaks {PROTOCOL_VERSION}"
        )
    return nonce, digest


def pack_challenge(token: str, worker_nonce: bytes, trainer_nonce: bytes, digest: bytes) -> bytes:
    mac = _mac(token, b"trainer", worker_nonce, trainer_nonce, digest)
    return _CHALLENGE.pack(b"AWTC", trainer_nonce, mac)


def verify_challenge(token: str, worker_nonce: bytes, digest: bytes, data: bytes) -> bytes:
    """Check the trainer's proof; return its nonce. A wrong token is `AuthenticationError`."""
    magic, trainer_nonce, mac = _unpack(_CHALLENGE, data, "handshake CHALLENGE")
    if magic != b"AWTC":
        raise ProtocolError(f"handshake CHALLENGE magic should be b'AWTC', got {magic!r}")
    if not hmac.compare_digest(mac, _mac(token, b"trainer", worker_nonce, trainer_nonce, digest)):
        raise AuthenticationError(
            "the trainer failed the token challenge: the worker's token differs from the "
            "trainer's (check the init_info the worker received)"
        )
    return bytes(trainer_nonce)


def pack_proof(token: str, worker_nonce: bytes, trainer_nonce: bytes, digest: bytes) -> bytes:
    return _PROOF.pack(b"AWTP", _mac(token, b"worker", trainer_nonce, worker_nonce, digest))


def proof_is_valid(
    token: str, worker_nonce: bytes, trainer_nonce: bytes, digest: bytes, data: bytes
) -> bool:
    magic, mac = _unpack(_PROOF, data, "handshake PROOF")
    expected = _mac(token, b"worker", trainer_nonce, worker_nonce, digest)
    return magic == b"AWTP" and hmac.compare_digest(mac, expected)


def pack_result(status: HandshakeStatus) -> bytes:
    return _RESULT.pack(b"AWTR", status)


def check_result(data: bytes) -> None:
    """Raise the error a non-OK RESULT stands for."""
    magic, status = _unpack(_RESULT, data, "handshake RESULT")
    if magic != b"AWTR":
        raise ProtocolError(f"handshake RESULT magic should be b'AWTR', got {magic!r}")
    if status == HandshakeStatus.OK:
        return
    if status == HandshakeStatus.BAD_PROOF:
        raise AuthenticationError("the trainer refused this worker's token proof")
    if status == HandshakeStatus.PLAN_MISMATCH:
        raise PlanMismatchError("the trainer's transfer plan differs from this worker's")
    if status == HandshakeStatus.FULL:
        raise ProtocolError("the trainer already serves its maximum number of workers")
    raise ProtocolError(f"handshake RESULT status {status} is unknown")
