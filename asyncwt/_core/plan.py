"""The transfer plan: a deterministic layout of parameters into buckets (sans-I/O).

Both ends build the plan from the same metadata and wire parameters and compare its
`digest`, so a trainer and a worker that disagree fail at once, before a byte moves.
A bucket is a list of slices; on the wire a bucket's payload is its slices'
bytes back to back (no padding). In a receive buffer each slice sits at an
`alignment`-aligned offset so that it can be viewed as its dtype in place.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import PlanMismatchError
from .meta import ParamMeta
from .validate import check_positive

__all__ = [
    "DEFAULT_ALIGNMENT",
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "Slice",
    "TransferPlan",
    "dtype_from_str",
    "dtype_to_str",
]

PLAN_FORMAT = 1
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_ALIGNMENT = 64
MAX_BUCKETS = 1 << 20
"""Most buckets a plan may have (a bucket index travels as 32 bits): a plan that
declares more is refused before it is laid out, so a hostile or broken init
cannot make a worker build one without end."""


def dtype_to_str(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → `"bfloat16"`: the dtype's name on the wire and in JSON."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    """Inverse of `dtype_to_str`; an unknown name is a `ValueError`."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype should name a torch dtype (e.g. 'float32'), got {name!r}")
    return dtype


@dataclass(frozen=True, slots=True)
class Slice:
    """A byte range of one parameter, placed in one bucket."""

    param: int
    """Index of the parameter in `TransferPlan.params`."""
    start: int
    """First byte of the range within the parameter's contiguous bytes."""
    nbytes: int
    """Length of the range."""
    offset: int
    """Where the range sits in a bucket-sized receive buffer (aligned)."""

    @property
    def end(self) -> int:
        return self.start + self.nbytes


@dataclass(frozen=True, slots=True)
class Bucket:
    """One unit of transfer: at most `bucket_bytes` of slices."""

    index: int
    slices: tuple[Slice, ...]
    buffer_bytes: int
    """Bytes of receive buffer the slices occupy, padding included."""
    payload_bytes: int
    """Bytes on the wire: the slices' lengths summed."""


@dataclass(frozen=True)
class TransferPlan:
    """Where every byte of every parameter goes, identical on every rank and worker.

    Build it with `TransferPlan.build`. A parameter larger than `bucket_bytes` starts
    a fresh bucket and is chunked across as many as it needs.
    """

    params: tuple[ParamMeta, ...]
    bucket_bytes: int
    alignment: int
    buckets: tuple[Bucket, ...]
    digest: str
    param_buckets: tuple[tuple[int, ...], ...]
    """For each parameter, the indices of the buckets holding its slices."""

    @classmethod
    def build(
        cls,
        params: Sequence[ParamMeta],
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> TransferPlan:
        """Lay `params` out in metadata order into buckets of `bucket_bytes`."""
        check_positive("bucket_bytes", bucket_bytes)
        check_positive("alignment", alignment)
        if alignment & (alignment - 1) or alignment < 16:
            raise ValueError(f"alignment should be a power of two >= 16, got {alignment}")
        if bucket_bytes % alignment:
            raise ValueError(
                f"bucket_bytes should be a multiple of alignment ({alignment}), got {bucket_bytes}"
            )
        params = tuple(params)
        upper = sum(max(1, -(-p.nbytes // bucket_bytes)) for p in params)
        if upper > MAX_BUCKETS:
            raise ValueError(
                f"the plan would need up to {upper} buckets of {bucket_bytes} bytes, more "
                f"than MAX_BUCKETS ({MAX_BUCKETS}); raise bucket_bytes"
            )
        names = [p.name for p in params]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"params should have distinct names; {dup!r} appears twice")
        layout = _Layout(bucket_bytes, alignment)
        for index, meta in enumerate(params):
            layout.place(index, meta.nbytes)
        buckets = layout.finish()
        per_param: list[list[int]] = [[] for _ in params]
        for bucket in buckets:
            for s in bucket.slices:
                if not per_param[s.param] or per_param[s.param][-1] != bucket.index:
                    per_param[s.param].append(bucket.index)
        digest = _digest(params, bucket_bytes, alignment, buckets)
        return cls(
            params=params,
            bucket_bytes=bucket_bytes,
            alignment=alignment,
            buckets=tuple(buckets),
            digest=digest,
            param_buckets=tuple(tuple(b) for b in per_param),
        )

    @property
    def total_bytes(self) -> int:
        """Bytes of every parameter together (what one round moves to each worker)."""
        return sum(b.payload_bytes for b in self.buckets)

    def check_digest(self, other: str, *, where: str) -> None:
        """Raise `PlanMismatchError` unless `other` equals this plan's digest."""
        if other != self.digest:
            raise PlanMismatchError(
                f"{where}: transfer plan digest {other[:16]}… does not match this side's "
                f"{self.digest[:16]}…; both ends must use the same metadata, bucket_bytes "
                f"({self.bucket_bytes}) and alignment ({self.alignment})"
            )

    def to_wire(self) -> dict[str, Any]:
        """The JSON-safe inputs another process needs to rebuild this plan."""
        return {
            "params": [[p.name, dtype_to_str(p.dtype), list(p.shape)] for p in self.params],
            "bucket_bytes": self.bucket_bytes,
            "alignment": self.alignment,
            "digest": self.digest,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> TransferPlan:
        """Rebuild a plan from `to_wire` output and check it against the sent digest."""
        try:
            raw_params = data["params"]
            params = [
                ParamMeta(str(name), dtype_from_str(dtype), tuple(int(d) for d in shape))
                for name, dtype, shape in raw_params
            ]
            plan = cls.build(
                params, bucket_bytes=int(data["bucket_bytes"]), alignment=int(data["alignment"])
            )
            digest = str(data["digest"])
        except (KeyError, TypeError, OverflowError) as exc:
            raise ValueError(f"plan description is malformed: {exc!r}") from exc
        plan.check_digest(digest, where="the trainer's plan")
        return plan


class _Layout:
    """Greedy bucket filler used by `TransferPlan.build`."""

    def __init__(self, bucket_bytes: int, alignment: int) -> None:
        self.bucket_bytes = bucket_bytes
        self.alignment = alignment
        self.buckets: list[Bucket] = []
        self.slices: list[Slice] = []
        self.used = 0

    def _aligned(self) -> int:
        return -(-self.used // self.alignment) * self.alignment

    def _close(self) -> None:
        if self.slices:
            payload = sum(s.nbytes for s in self.slices)
            self.buckets.append(Bucket(len(self.buckets), tuple(self.slices), self.used, payload))
        self.slices, self.used = [], 0

    def place(self, param: int, nbytes: int) -> None:
        offset = self._aligned()
        if offset + nbytes <= self.bucket_bytes:
            self.slices.append(Slice(param, 0, nbytes, offset))
            self.used = offset + nbytes
            return
        self._close()
        if nbytes <= self.bucket_bytes:
            self.slices.append(Slice(param, 0, nbytes, 0))
            self.used = nbytes
            return
        for start in range(0, nbytes, self.bucket_bytes):
            self._close()
            length = min(self.bucket_bytes, nbytes - start)
            self.slices.append(Slice(param, start, length, 0))
            self.used = length

    def finish(self) -> list[Bucket]:
        self._close()
        return self.buckets


def _digest(
    params: tuple[ParamMeta, ...], bucket_bytes: int, alignment: int, buckets: list[Bucket]
) -> str:
    h = hashlib.sha256()
    h.update(f"asyncwt-plan/{PLAN_FORMAT}|{bucket_bytes}|{alignment}\n".encode())
    for p in params:
        shape = ",".join(map(str, p.shape))
        h.update(f"p|{p.name}|{dtype_to_str(p.dtype)}|{shape}|{math.prod(p.shape)}\n".encode())
    for b in buckets:
        h.update(f"b|{b.index}|{b.buffer_bytes}|{b.payload_bytes}\n".encode())
        for s in b.slices:
            h.update(f"s|{s.param}|{s.start}|{s.nbytes}|{s.offset}\n".encode())
    return h.hexdigest()
