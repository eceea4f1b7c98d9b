"""Lossless bucket deltas: encode new wire bytes against the previous ones (sans-I/O).

A bucket's payload is its slices' bytes back to back. Against the payload the
workers hold for the previous version (the *base*), the trainer picks the smallest
of three encodings:

- `RAW`: the new payload itself;
- `SPARSE`: the changed units (none, for a bucket that did not change) (2 bytes when every slice is an even number of
  bytes long, else 1), as `count` little-endian u32 gaps between their positions
  (the first gap is the first position) followed by their `count` new values;
- `ZSPARSE`: `SPARSE` compressed with zstandard, tried where the sparse body is
  large enough for a compressor to pay.

A coded bucket always travels with `DeltaHeader`: the encoding, the body's length,
the count of changed units and the XXH3-128 digest of the resulting payload, which the
worker checks before it may publish the round. Every field is validated against
the plan before a byte of the body is read or allocated.
"""

from __future__ import annotations

import enum
import functools
import importlib
import struct
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import ModuleType

import torch
import xxhash

from .._core.bytes import byte_view, empty_bytes
from .._core.errors import ProtocolError
from .._core.plan import Bucket
from .._transports.wire import DELTA_HEADER_BYTES

__all__ = [
    "DELTA_HEADER_SIZE",
    "DeltaHeader",
    "Encoded",
    "Encoding",
    "apply_sparse",
    "encode",
    "payload_digest",
    "sparse_chunks",
    "unit_of",
]

DIGEST_BYTES = 16
_HEADER = struct.Struct(f"<4sB3xQQ{DIGEST_BYTES}s")
DELTA_HEADER_SIZE = _HEADER.size
assert DELTA_HEADER_SIZE == DELTA_HEADER_BYTES
_MAGIC = b"AWTD"
ZSTD_MIN_BYTES = 4096
"""Sparse bodies shorter than this go uncompressed: the compressor's frame and
the call cost more than they save."""
RAW_FRACTION = 0.75
"""A coded body must be at most this fraction of the payload, else the bucket
goes raw: decoding a body that saves little costs more than it saves."""
ZSTD_LEVEL = 1


@functools.cache
def _zstandard() -> ModuleType:
    """The `zstandard` module, imported when a delta round first compresses or
    decompresses a body, not with asyncwt: `import asyncwt` and full rounds need
    nothing beyond torch, anyio, aiohttp and xxhash (a GPU image without zstandard
    still runs them)."""
    return importlib.import_module("zstandard")


CODING_THREADS = 2
"""Threads that compare a bucket's pieces with the previous bytes (the caller hashes it)."""
PIECE_BYTES = 2 << 20
"""The most bytes one comparison covers: a bucket is compared in pieces on the threads."""
WORD = 8
"""Bytes compared at once before looking into units (see `_changes`)."""
CHUNK_CHANGES = 1 << 18
"""Changes a worker decodes and applies at once: bounds its temporaries (8 bytes of
position a change) whatever share of a bucket changed."""


class Encoding(enum.IntEnum):
    """How a bucket's body encodes its new payload."""

    RAW = 0
    SPARSE = 1
    ZSPARSE = 2


@dataclass(frozen=True, slots=True)
class DeltaHeader:
    """What precedes a coded bucket's body on the wire."""

    encoding: Encoding
    body_bytes: int
    """Bytes of body that follow the header."""
    count: int
    """Changed units (`SPARSE`, `ZSPARSE`); 0 for `RAW`."""
    digest: bytes
    """XXH3-128 of the bucket's resulting payload (`DIGEST_BYTES` bytes)."""

    def __post_init__(self) -> None:
        if len(self.digest) != DIGEST_BYTES:
            raise ValueError(
                f"digest should be {DIGEST_BYTES} bytes (XXH3-128), got {len(self.digest)}"
            )

    def pack(self) -> bytes:
        return _HEADER.pack(_MAGIC, self.encoding, self.body_bytes, self.count, self.digest)

    @classmethod
    def unpack(cls, data: bytes, bucket: Bucket, unit: int, body_bytes: int) -> DeltaHeader:
        """Parse and check a header for `bucket` whose frame carries `body_bytes` of body.

        Raises `ProtocolError` on anything the plan does not allow: a body longer
        than the payload, a count of units the payload cannot hold, a `SPARSE` body
        whose length does not match its count.
        """
        if len(data) != DELTA_HEADER_SIZE:
            raise ProtocolError(
                f"delta header should be {DELTA_HEADER_SIZE} bytes, got {len(data)}"
            )
        magic, raw_encoding, body, count, digest = _HEADER.unpack(data)
        where = f"bucket {bucket.index}"
        if magic != _MAGIC:
            raise ProtocolError(f"{where}: delta header magic should be {_MAGIC!r}, got {magic!r}")
        try:
            encoding = Encoding(raw_encoding)
        except ValueError:
            raise ProtocolError(
                f"{where}: delta encoding {raw_encoding} is not one of {list(map(int, Encoding))}"
            ) from None
        payload = bucket.payload_bytes
        if body != body_bytes:
            raise ProtocolError(
                f"{where}: delta header says {body} body bytes, the frame carries {body_bytes}"
            )
        units = payload // unit
        if encoding == Encoding.RAW:
            if body != payload or count != 0:
                raise ProtocolError(
                    f"{where}: a RAW body should be the payload ({payload} bytes, count 0), "
                    f"got {body} bytes and count {count}"
                )
        elif not 0 <= count <= units or (body >= payload and payload):
            raise ProtocolError(
                f"{where}: a {encoding.name} body should hold 0 to {units} changes in fewer "
                f"than {payload} bytes, got {count} changes in {body} bytes"
            )
        elif encoding == Encoding.SPARSE and body != count * (4 + unit):
            raise ProtocolError(
                f"{where}: a SPARSE body of {count} changes should be {count * (4 + unit)} "
                f"bytes, got {body}"
            )
        return cls(encoding, body, count, digest)


def unit_of(bucket: Bucket) -> int:
    """Bytes per unit a delta compares in: 2 when every slice is an even number of
    bytes long (so each slice starts on a unit), else 1."""
    return 2 if all(s.nbytes % 2 == 0 and s.start % 2 == 0 for s in bucket.slices) else 1


def _units(data: torch.Tensor, unit: int) -> torch.Tensor:
    return data.view(torch.int16) if unit == 2 else data


def payload_digest(parts: Sequence[torch.Tensor]) -> bytes:
    """XXH3-128 of the payload made of `parts` (contiguous CPU uint8 tensors) in order.

    A check against bytes that drifted apart (a worker's base that is not the
    trainer's), not against forgery: the link itself is authenticated. XXH3 hashes
    at memory speed, where SHA-256 took as long as comparing the bucket."""
    h = xxhash.xxh3_128()
    for part in parts:
        if part.numel():
            h.update(byte_view(part))
    return h.digest()


@dataclass(frozen=True, slots=True)
class Encoded:
    """A bucket's coded form: its header and the body to send after it."""

    header: DeltaHeader
    body: list[torch.Tensor] | bytes
    """The new payload's segments (`RAW`) or the coded bytes."""


def encode(segments: Sequence[torch.Tensor], base: torch.Tensor, unit: int) -> Encoded:
    """Encode the payload `segments` (uint8 CPU tensors, back to back) against `base`
    (the previous payload, as long as they are together), then copy them into `base`.
    """
    pieces = _pieces(segments, unit)
    with ThreadPoolExecutor(CODING_THREADS, thread_name_prefix="asyncwt-code") as pool:
        compared = pool.map(lambda piece: _changes(piece, base, unit), pieces)
        digest = payload_digest(segments)  # here, beside the comparison
        found = list(compared)
    positions = [p for p, _ in found if p.numel()]
    values = [v for p, v in found if p.numel()]
    return _encoded(segments, base, unit, positions, values, digest)


def _pieces(segments: Sequence[torch.Tensor], unit: int) -> list[tuple[torch.Tensor, int]]:
    """The payload cut into runs of at most `PIECE_BYTES` (whole units), with where each starts."""
    pieces = []
    at = 0
    step = PIECE_BYTES // unit * unit
    for segment in segments:
        for start in range(0, segment.numel(), step):
            pieces.append((segment[start : start + step], at + start))
        at += segment.numel()
    return pieces


def _changes(
    piece: tuple[torch.Tensor, int], base: torch.Tensor, unit: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The changed units' positions (in the payload) and new values of one piece.

    Where both sides allow 8-byte words, the words are compared first and only the
    changed ones are looked into, unit by unit: most of a piece costs one compare
    of words and a scan of a quarter as many flags as units (at 2 bytes a unit).
    """
    data, at = piece
    old = base[at : at + data.numel()]
    whole = data.numel() // WORD * WORD if _word_aligned(data, old) else 0
    positions, values = [], []
    if whole:
        per = WORD // unit
        new_units = _units(data[:whole], unit).view(-1, per)
        old_units = _units(old[:whole], unit).view(-1, per)
        words = torch.ne(data[:whole].view(torch.int64), old[:whole].view(torch.int64))
        changed = words.nonzero().flatten()
        if changed.numel():
            fresh = new_units.index_select(0, changed).flatten()
            stale = old_units.index_select(0, changed).flatten()
            inside = torch.ne(fresh, stale).nonzero().flatten()
            shift = per.bit_length() - 1  # per is 4 or 8 units a word
            positions.append(changed.index_select(0, inside >> shift) * per + (inside & (per - 1)))
            values.append(fresh.index_select(0, inside))
    if whole < data.numel():
        new_units = _units(data[whole:], unit)
        rest = torch.ne(new_units, _units(old[whole:], unit)).nonzero().flatten()
        positions.append(rest + whole // unit)
        values.append(new_units[rest])
    if not positions:
        return torch.zeros(0, dtype=torch.int64), _units(empty_bytes(0), unit)
    found = torch.cat(positions) if len(positions) > 1 else positions[0]
    return found + at // unit, torch.cat(values) if len(values) > 1 else values[0]


def _word_aligned(*tensors: torch.Tensor) -> bool:
    """Whether every one of these byte tensors can be viewed as 8-byte words."""
    return all(t.storage_offset() % WORD == 0 and t.data_ptr() % WORD == 0 for t in tensors)


def _encoded(
    segments: Sequence[torch.Tensor],
    base: torch.Tensor,
    unit: int,
    positions: list[torch.Tensor],
    values: list[torch.Tensor],
    digest: bytes,
) -> Encoded:
    """The smallest body for these changes; then the segments go into `base`."""
    payload = base.numel()
    count = sum(p.numel() for p in positions)
    header = DeltaHeader(Encoding.RAW, payload, 0, digest)
    body: list[torch.Tensor] | bytes = list(segments)
    if count * (4 + unit) < payload * RAW_FRACTION:
        where = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
        gaps = torch.diff(where, prepend=where.new_zeros(1)).to(torch.int32)
        changed = torch.cat(values) if values else _units(empty_bytes(0), unit)
        # `base` differs from the new payload only at the changed units: write those
        # (a scatter of the few), not the whole payload (a copy of all of it).
        _units(base, unit)[where] = changed
        sparse = torch.cat([gaps.view(torch.uint8), changed.view(torch.uint8)])
        coded: bytes = bytes(byte_view(sparse))
        encoding = Encoding.SPARSE
        if len(coded) >= ZSTD_MIN_BYTES:
            packed = _zstandard().ZstdCompressor(level=ZSTD_LEVEL).compress(coded)
            if len(packed) < len(coded):
                coded, encoding = packed, Encoding.ZSPARSE
        return Encoded(DeltaHeader(encoding, len(coded), count, digest), coded)
    at = 0
    for segment in segments:
        base[at : at + segment.numel()].copy_(segment)
        at += segment.numel()
    return Encoded(header, body)


def sparse_chunks(
    header: DeltaHeader, body: memoryview, units: int, unit: int, *, chunk: int = CHUNK_CHANGES
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The changed units' positions (int64, increasing, below `units`) and values of a
    `SPARSE` or `ZSPARSE` body, `chunk` changes at a time, each chunk checked before
    it is yielded; a body that decodes to anything else is a `ProtocolError` (raised
    when reached: chunks before it were yielded).

    Memory: the decompressed body (`ZSPARSE`; a `SPARSE` body is read where it lies,
    when writable), which must be shorter than the payload and is checked to be
    before anything is allocated, and one chunk's positions, whatever the count.
    """
    count = header.count
    size = count * (4 + unit)
    if size == 0:
        return
    payload = units * unit
    if size >= payload:
        raise ProtocolError(
            f"a {header.encoding.name} body of {count} changes would decode to {size} bytes; "
            f"a sparse body should be shorter than the payload ({payload} bytes)"
        )
    data = _sparse_bytes(header, body, size)
    gaps = data[: count * 4].view(torch.int32)
    values = _units(data[count * 4 :], unit)
    carry = -1  # the position before the first: its gap may be 0
    for start in range(0, count, chunk):
        steps = gaps[start : start + chunk].to(torch.int64) & 0xFFFFFFFF
        if start == 0:
            steps[0] += 1  # the first gap is the first position itself
        if not bool((steps > 0).all()):
            raise ProtocolError("a sparse body's positions should increase strictly")
        positions = torch.cumsum(steps, 0) + carry
        carry = int(positions[-1])
        if carry >= units:
            raise ProtocolError(f"a sparse body names unit {carry}; the payload has {units}")
        yield positions, values[start : start + chunk]


def _sparse_bytes(header: DeltaHeader, body: memoryview, size: int) -> torch.Tensor:
    """The `size` bytes of gaps and values a body holds, as a uint8 tensor.

    A `ZSPARSE` frame must declare `size` as its content size, and is decompressed
    with a window of at most `size` rounded up to a power of two: the memory a
    frame makes this side allocate is bounded by `size`, checked before it is.
    """
    if header.encoding == Encoding.ZSPARSE:
        zstandard = _zstandard()
        try:
            declared = zstandard.get_frame_parameters(body).content_size
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"a ZSPARSE body does not decompress: {exc}") from exc
        if declared != size:
            shown = "no size" if declared == zstandard.CONTENTSIZE_UNKNOWN else declared
            raise ProtocolError(
                f"a ZSPARSE body of {header.count} changes should declare {size} bytes of "
                f"content, its frame declares {shown}"
            )
        out = torch.empty(size, dtype=torch.uint8)
        view = byte_view(out)
        got = 0
        window = 1 << max(10, (size - 1).bit_length())  # zstd's smallest window is 1 KiB
        try:
            decompressor = zstandard.ZstdDecompressor(max_window_size=window)
            with decompressor.stream_reader(body) as reader:
                while got < size:
                    n = reader.readinto(view[got:])
                    if not n:
                        break
                    got += n
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise ProtocolError(f"a ZSPARSE body does not decompress: {exc}") from exc
        if got != size or extra:
            raise ProtocolError(
                f"a ZSPARSE body of {header.count} changes should decompress to {size} bytes, "
                f"got {got if got != size else 'more'}"
            )
        return out
    if body.readonly:
        body = memoryview(bytearray(body))
    return torch.frombuffer(body, dtype=torch.uint8)[:size]


def apply_sparse(
    destinations: Sequence[torch.Tensor],
    positions: torch.Tensor,
    values: torch.Tensor,
    unit: int,
) -> None:
    """Write `values` at `positions` (in units of the whole payload) into the payload
    made of `destinations` (uint8 views, back to back, each a whole number of units;
    on a GPU, only the changed units and their positions are copied there)."""
    at = 0
    for destination in destinations:
        n = destination.numel() // unit
        lo, hi = torch.searchsorted(positions, torch.tensor([at, at + n])).tolist()
        if hi > lo:
            index, changed = positions[lo:hi] - at, values[lo:hi]
            if destination.device != index.device:  # a GPU base: upload only the changes
                index, changed = index.to(destination.device), changed.to(destination.device)
            _units(destination, unit)[index] = changed
        at += n
