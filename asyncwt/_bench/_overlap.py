"""The overlap experiment's slow stages: a gathering source and a slow worker transform.

- `SlowSource` wraps the model and sleeps `delay_s` before yielding each tensor, as
  an FSDP `full_tensor()` gather would block (the sleep releases the GIL, like a
  collective does). It records when each tensor was produced.
- `bench_transform` is the worker's `WeightTransferConfig.transform`: identity on
  the values, sleeping `s_per_bucket × tensor bytes / bucket_bytes` (so a full
  bucket costs `s_per_bucket`), configured by `$ASYNCWT_BENCH_TRANSFORM` (JSON),
  and appending `name start end` to an events file when one is named.
- `transform_alone_s` runs the same transform calls, bucket by bucket as the
  worker's applier does, on the same number of threads, with nothing else going
  on: the transform stage's time alone.

Times are `time.monotonic()`: CLOCK_MONOTONIC is system-wide on Linux, so the
trainer's and the worker's events share one timeline.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

import torch

from .._meta import ParamMeta
from .._plan import TransferPlan
from .._source import ModuleSource, WeightSource

__all__ = [
    "TRANSFORM_ENV",
    "SlowSource",
    "TransformConfig",
    "bench_transform",
    "read_events",
    "transform_alone_s",
]

TRANSFORM_ENV = "ASYNCWT_BENCH_TRANSFORM"

Event = tuple[str, float, float]


class SlowSource(WeightSource):
    """`ModuleSource(module)` that sleeps `delay_s` before each tensor (a simulated gather)."""

    def __init__(self, module: torch.nn.Module, delay_s: float) -> None:
        self._inner = ModuleSource(module)
        self.delay_s = delay_s
        self.events: list[Event] = []
        """`(name, start, end)` of each simulated gather of the current pass."""

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self._inner.metadata

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.events = []
        for name, tensor in self._inner.iter_full():
            start = time.monotonic()
            if self.delay_s > 0:
                time.sleep(self.delay_s)
            self.events.append((name, start, time.monotonic()))
            yield name, tensor


@dataclass(frozen=True, kw_only=True, slots=True)
class TransformConfig:
    """The slow transform's settings (`$ASYNCWT_BENCH_TRANSFORM` holds them as JSON)."""

    s_per_bucket: float
    """Seconds a full bucket's worth of bytes costs."""
    bucket_bytes: int
    """The bucket size those seconds are for."""
    events_path: str | None = None
    """File to append `name start end` lines to, or None."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "s_per_bucket": self.s_per_bucket,
                "bucket_bytes": self.bucket_bytes,
                "events_path": self.events_path,
            }
        )

    def delay_for(self, nbytes: int) -> float:
        return self.s_per_bucket * nbytes / self.bucket_bytes


_config: TransformConfig | None = None
_events_lock = threading.Lock()


def _env_config() -> TransformConfig:
    global _config
    if _config is None:
        text = os.environ.get(TRANSFORM_ENV)
        if not text:
            raise RuntimeError(
                f"{TRANSFORM_ENV} should hold the transform's JSON settings; it is unset"
            )
        _config = TransformConfig(**json.loads(text))
    return _config


def slow_identity(config: TransformConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Sleep as `config` says for `tensor`'s bytes; return `tensor` unchanged."""
    start = time.monotonic()
    delay = config.delay_for(tensor.numel() * tensor.element_size())
    if delay > 0:
        time.sleep(delay)
    if config.events_path is not None:
        line = f"{name} {start!r} {time.monotonic()!r}\n"
        with _events_lock, open(config.events_path, "a") as events:
            events.write(line)
    return tensor


def bench_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The worker transform (`asyncwt worker --transform asyncwt._bench._overlap:bench_transform`)."""
    return slow_identity(_env_config(), name, tensor)


def read_events(path: str, offset: int) -> tuple[list[Event], int]:
    """Events appended to `path` since byte `offset`, and the new offset."""
    try:
        with open(path) as events:
            events.seek(offset)
            text = events.read()
            end = events.tell()
    except FileNotFoundError:
        return [], offset
    parsed: list[Event] = []
    for line in text.splitlines():
        name, start, stop = line.rsplit(" ", 2)
        parsed.append((name, float(start), float(stop)))
    return parsed, end


def transform_alone_s(
    model: torch.nn.Module, plan: TransferPlan, config: TransformConfig, threads: int
) -> float:
    """The transform stage alone: every call the applier makes, on `threads` threads.

    Mirrors the worker's applier: one task per bucket, calling the transform for each
    parameter whose last byte the bucket holds (a chunked parameter is transformed
    once, whole, in its last bucket).
    """
    params = list(model.parameters())
    quiet = TransformConfig(s_per_bucket=config.s_per_bucket, bucket_bytes=config.bucket_bytes)

    def bucket_work(index: int) -> None:
        for s in plan.buckets[index].slices:
            meta = plan.params[s.param]
            if s.end == meta.nbytes:
                slow_identity(quiet, meta.name, params[s.param])

    with ThreadPoolExecutor(threads, thread_name_prefix="bench-transform") as pool:
        list(pool.map(lambda _: None, range(threads)))  # start the threads first
        start = time.perf_counter()
        list(pool.map(bucket_work, range(len(plan.buckets))))
        return time.perf_counter() - start
