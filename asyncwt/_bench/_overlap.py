"""The overlap experiment's slow stages: a gathering source and a slow worker transform.

- `SlowSource` wraps the model and sleeps `delay_s` before yielding each tensor, as
  an FSDP `full_tensor()` gather would block (the sleep releases the GIL, like a
  collective does). It records when each tensor was produced.
- `bench_transform` is the worker's `WeightTransferConfig.transform`: identity on
  the values, sleeping `s_per_bucket × tensor bytes / bucket_bytes` (so a full
  bucket costs `s_per_bucket`), configured by `$ASYNCWT_BENCH_TRANSFORM` (JSON),
  and appending `name start end` to an events file when one is named.
- `ApplyStage` runs the worker's real applier with that transform on a
  worker-shaped model, with no wire: the apply stage's time alone, copies into
  the model included. The transform is elementwise (its cost is per byte), so by
  default the workers are told so (`--transform-elementwise`): it runs on runs of
  elements as they arrive, in place where the bytes land in the model.

Times are `time.monotonic()`: CLOCK_MONOTONIC is system-wide on Linux, so the
trainer's and the worker's events share one timeline.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch

from .._core.meta import ParamMeta
from .._core.plan import TransferPlan
from .._core.source import ModuleSource, WeightSource
from .._worker.applier import DeferredApplier, ModelTarget, bucket_parts

__all__ = [
    "TRANSFORM_ENV",
    "ApplyStage",
    "SlowSource",
    "TransformConfig",
    "bench_transform",
    "read_events",
    "set_transform_delay",
    "transform_jobs",
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
    control_path: str | None = None
    """File whose text, once written (`set_transform_delay`), replaces `s_per_bucket`:
    the trainer switches the worker's transform between slow and instant from one
    round to the next, so that both are measured interleaved on one connection."""

    def to_json(self) -> str:
        return json.dumps(
            {
                "s_per_bucket": self.s_per_bucket,
                "bucket_bytes": self.bucket_bytes,
                "events_path": self.events_path,
                "control_path": self.control_path,
            }
        )

    def delay_for(self, nbytes: int) -> float:
        s_per_bucket = self.s_per_bucket
        if self.control_path is not None:
            s_per_bucket = _controlled(self.control_path, s_per_bucket)
        return s_per_bucket * nbytes / self.bucket_bytes


_control_cache: dict[str, tuple[tuple[int, int], float]] = {}


def _controlled(path: str, default: float) -> float:
    """The seconds per bucket `path` holds (re-read when it changes), or `default`."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return default
    version = (stat.st_ino, stat.st_mtime_ns)  # every write is a new file (os.replace)
    cached = _control_cache.get(path)
    if cached is None or cached[0] != version:
        with open(path) as control:
            cached = _control_cache[path] = (version, float(control.read()))
    return cached[1]


def set_transform_delay(path: str, s_per_bucket: float) -> None:
    """Switch the workers whose transform reads `path` to `s_per_bucket` (atomically)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as control:
        control.write(repr(s_per_bucket))
    os.replace(tmp, path)


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
    _sleep_for(config, name, tensor.numel() * tensor.element_size())
    return tensor


def _sleep_for(config: TransformConfig, name: str, nbytes: int) -> None:
    start = time.monotonic()
    delay = config.delay_for(nbytes)
    if delay > 0:
        time.sleep(delay)
    if config.events_path is not None:
        line = f"{name} {start!r} {time.monotonic()!r}\n"
        with _events_lock, open(config.events_path, "a") as events:
            events.write(line)


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


def transform_jobs(
    model: torch.nn.Module,
    plan: TransferPlan,
    threads: int,
    *,
    elementwise: bool,
    in_place: bool,
) -> list[tuple[int, list[tuple[str, int]]]]:
    """The transform calls the worker's applier makes, as it divides them into jobs:
    `(bucket index, [(parameter name, bytes transformed)])` in submission order.

    Goes through the applier's own `bucket_parts`: per bucket, one job for the
    whole-tensor calls (a parameter transformed whole, in its last bucket) and one
    per part of the elementwise work. `in_place`: the worker's transport receives
    into the model (`receives_in_place`).
    """
    target = ModelTarget.resolve(
        model, plan, lambda name, tensor: tensor, elementwise=elementwise, in_place=in_place
    )
    jobs: list[tuple[int, list[tuple[str, int]]]] = []
    for bucket in plan.buckets:
        whole, parts = bucket_parts(target, bucket, threads)
        calls = [
            (plan.params[s.param].name, plan.params[s.param].nbytes)
            for s in whole
            if s.end == plan.params[s.param].nbytes
        ]
        pieces = [[(plan.params[p.slice.param].name, p.nbytes) for p in part] for part in parts]
        jobs.append((bucket.index, calls + (pieces[0] if pieces else [])))
        jobs += [(bucket.index, part) for part in pieces[1:]]
    return jobs


class ApplyStage:
    """The worker's apply stage alone: the real applier, no wire.

    Every bucket of a round is handed to a `DeferredApplier` on `threads` threads,
    as the worker engine hands them over, and timed until drained: unpacking,
    the slow transform and the copies into a worker-shaped model, with nothing
    else running. Receive buffers are `threads + 1` bucket-sized ones, as the
    worker keeps, filled once; what they hold does not change the cost.
    """

    def __init__(
        self,
        worker: torch.nn.Module,
        plan: TransferPlan,
        threads: int,
        *,
        elementwise: bool,
        in_place: bool,
    ) -> None:
        self.worker = worker
        self.plan = plan
        self.threads = threads
        self.elementwise = elementwise
        self.in_place = in_place
        self._buffers = [
            torch.zeros(plan.bucket_bytes, dtype=torch.uint8) for _ in range(threads + 1)
        ]

    def once_s(self, config: TransformConfig) -> float:
        """Seconds to apply one round with the slow transform `config` describes."""
        quiet = TransformConfig(s_per_bucket=config.s_per_bucket, bucket_bytes=config.bucket_bytes)
        target = ModelTarget.resolve(
            self.worker,
            self.plan,
            functools.partial(slow_identity, quiet),
            elementwise=self.elementwise,
            in_place=self.in_place,
        )
        applier = DeferredApplier(self.threads)
        try:
            start = time.perf_counter()
            for bucket in self.plan.buckets:
                buffer = self._buffers[bucket.index % len(self._buffers)]
                applier.submit(target, 1, bucket, buffer, lambda: None)
            applier.drain()
            return time.perf_counter() - start
        finally:
            applier.shutdown()
