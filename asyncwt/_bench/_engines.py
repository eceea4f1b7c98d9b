"""asyncwt itself, trainer → `asyncwt worker` process, on each backend in `BACKENDS`.

The trainer is this process (an `HttpClient` control plane, the backend's data
plane); the worker is a real `python -m asyncwt worker` serving the benchmark
model. A measured run is: open memory windows on both processes, `trainer_init`,
warm-up and timed `send_weights` rounds, shut the engine down on both ends (so the
next configuration starts from a clean worker), then compare the worker's
`/weights_status` checksum with the trainer's model.

Adding a backend is one `BackendEntry` in `BACKENDS`: how to build its trainer init
info from the benchmark's knobs. Backends not registered on both sides are skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from typing_extensions import Self

from .._control.http import HttpClient
from .._core.checksum import model_checksum
from .._core.config import Listen, Tuning
from .._core.registry import registered_backends, trainer_init
from .._core.source import ModuleSource, WeightSource
from .._core.stats import RoundStats
from .._core.trainer_api import TrainerInitInfo
from .._transports.sockio import readable
from ._cpu import CpuMeter, median_cores
from ._memory import MemoryProbe
from ._model import LlamaShape, SyntheticLlama, fill_random
from ._overlap import SlowSource, read_events, set_transform_delay
from ._procs import Child, start_child
from ._util import Rounds, recv_exact, run_async, summarize

__all__ = [
    "BACKENDS",
    "BackendEntry",
    "EngineConfig",
    "TrainerJob",
    "available_backends",
    "measure_engine",
    "run_trainer",
    "trainer_process",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """The trainer-side knobs a benchmark run varies."""

    bucket_bytes: int
    """Bucket size (unit of transfer and of staging memory)."""
    num_buffers: int
    """Buckets in flight per side."""
    zero_copy: bool = True
    """Send contiguous CPU tensors in place (False: pack every bucket, as from a GPU)."""
    read_streams: int = 0
    """shm only: concurrent reads per bucket on a direct-reading worker (0: one per
    core it may run on); backends without the setting ignore it."""

    @property
    def budget_bytes(self) -> int:
        """Staging memory the configuration allows per side: num_buffers × bucket_bytes."""
        return self.num_buffers * self.bucket_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "bucket_bytes": self.bucket_bytes,
            "num_buffers": self.num_buffers,
            "zero_copy": self.zero_copy,
            "read_streams": self.read_streams,
            "budget_bytes": self.budget_bytes,
        }


@dataclass(frozen=True, kw_only=True, slots=True)
class BackendEntry:
    """One asyncwt backend the benchmark knows how to drive."""

    name: str
    """Registry key, on the trainer and on the worker (`asyncwt worker --backend`)."""
    info_class: str
    """`module:Class` of its trainer init info, imported only when the backend runs."""

    def make_info(self, config: EngineConfig) -> TrainerInitInfo:
        """The rank-0 trainer init info for `config` (loopback endpoints, one worker).

        Every pipelined backend's info takes `bucket_bytes`, `num_buffers` and
        `tuning`; `listen` is pinned to 127.0.0.1 where the info has one.
        """
        module_name, _, class_name = self.info_class.partition(":")
        cls = getattr(importlib.import_module(module_name), class_name)
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {
            "rank": 0,
            "bucket_bytes": config.bucket_bytes,
            "num_buffers": config.num_buffers,
            "tuning": Tuning(zero_copy=config.zero_copy),
        }
        if "listen" in names:
            kwargs["listen"] = Listen(host="127.0.0.1")
        if "read_streams" in names:
            kwargs["read_streams"] = config.read_streams
        info: TrainerInitInfo = cls(**kwargs)
        return info


BACKENDS: tuple[BackendEntry, ...] = (
    BackendEntry(name="tcp", info_class="asyncwt._backends.tcp.settings:TcpTrainerInitInfo"),
    BackendEntry(name="shm", info_class="asyncwt._backends.shm.backend:ShmTrainerInitInfo"),
    BackendEntry(
        name="torch_dist", info_class="asyncwt._backends.torch_dist:TorchDistTrainerInitInfo"
    ),
)
"""Every backend the benchmark can run, in report order; a new one is one entry."""


def available_backends(names: Sequence[str] | None = None) -> list[BackendEntry]:
    """The entries of `BACKENDS` registered on both sides (only `names`, if given).

    A name that is not an entry of `BACKENDS`, or not registered, is a `ValueError`.
    """
    registered = registered_backends()
    usable = {
        b.name: b
        for b in BACKENDS
        if b.name in registered["trainer"] and b.name in registered["worker"]
    }
    if names is None:
        return list(usable.values())
    unknown = [n for n in names if n not in usable]
    if unknown:
        raise ValueError(
            f"backends {unknown} cannot be benchmarked; available: {sorted(usable)} "
            f"(a backend needs an entry in asyncwt._bench._engines.BACKENDS and a registration "
            f"on both sides)"
        )
    return [usable[n] for n in names]


def _hook_send_timeline(engine: Any, timeline: list[tuple[int, float, float]]) -> bool:
    """Record `(bucket, start, end)` of each bucket send, if the engine exposes its sink.

    asyncwt has no per-bucket event hook yet: this wraps the sending transport's
    `send_bucket(bucket, ...)` on the engine instance (`engine.transport`, or the
    older `engine._fanout`) and returns False when there is none to wrap.
    """
    sink = getattr(engine, "transport", None) or getattr(engine, "_fanout", None)
    send = getattr(sink, "send_bucket", None)
    if sink is None or send is None:
        return False

    async def timed(bucket: Any, *args: Any) -> Any:
        start = time.monotonic()
        settle = await send(bucket, *args)
        if settle is None:
            timeline.append((bucket.index, start, time.monotonic()))
            return None

        async def settled() -> None:  # a bucket left in flight ends when it settles
            await settle()
            timeline.append((bucket.index, start, time.monotonic()))

        return settled

    sink.send_bucket = timed
    return True


async def measure_engine(
    backend: BackendEntry,
    *,
    url: str,
    worker_pid: int,
    source: WeightSource,
    config: EngineConfig,
    rounds: Rounds,
    expected_checksum: str | None,
    worker_baseline_bytes: int | None = None,
    on_round: Callable[[int, RoundStats, list[tuple[int, float, float]]], None] | None = None,
    before_round: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run warm-up + timed rounds of `backend` with `config`; the JSON record.

    `before_round(i)` and `on_round(i, stats, send_timeline)` are called before and
    after each round (i from 0, warm-up included). With `expected_checksum`, the
    worker's checksum is checked after the last round. The worker's engine is shut
    down at the end either way.
    """
    gc.collect()
    trainer_probe = MemoryProbe()
    worker_probe = MemoryProbe(worker_pid)
    trainer_probe.start()
    worker_probe.start(worker_baseline_bytes)
    stats: list[RoundStats] = []
    cores: list[dict[str, float]] = []
    meter = CpuMeter({"trainer": None, "worker": worker_pid})
    timeline: list[tuple[int, float, float]] = []
    async with HttpClient(url, timeout=600.0) as client:
        try:
            engine = await trainer_init(backend.make_info(config), client=client, source=source)
            try:
                hooked = _hook_send_timeline(engine, timeline)
                for i in range(rounds.total):
                    if before_round is not None:
                        before_round(i)
                    timeline.clear()
                    mark = meter.mark()
                    round_stats = await engine.send_weights(weight_version=f"bench-{i}")
                    cores.append(meter.cores_busy(mark, round_stats.wall_s))
                    stats.append(round_stats)
                    if on_round is not None:
                        on_round(i, round_stats, list(timeline))
            finally:
                await engine.shutdown()
                del engine
            trainer_window = trainer_probe.stop()
            worker_window = worker_probe.stop()
            status = (await client.weights_status(checksum=True))[0]
        finally:
            await client.shutdown()
    timed = stats[rounds.warmup :]
    busy_keys = sorted({k for s in timed for k in s.stage_busy_s})
    busy = {k: _median([s.stage_busy_s.get(k, 0.0) for s in timed]) for k in busy_keys}
    record = summarize(
        [s.wall_s for s in timed],
        timed[0].bytes,
        [s.wall_s for s in stats[: rounds.warmup]],
        backend=backend.name,
        config=config.as_dict(),
        buckets=timed[0].buckets,
        stage_busy_s=busy,
        stage_busy_share=({k: v / _median([s.wall_s for s in timed]) for k, v in busy.items()}),
        send_timeline_hooked=hooked,
        cores_busy=median_cores(cores[rounds.warmup :]),
        memory={"trainer": trainer_window.as_dict(), "worker": worker_window.as_dict()},
        worker_version=status.get("weight_version"),
        worker_checksum=status.get("checksum"),
    )
    if expected_checksum is not None:
        record["bit_exact"] = status.get("checksum") == expected_checksum
    return record


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


# -- the trainer process ----------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainerJob:
    """One measured run inside a trainer process."""

    label: str
    config: EngineConfig
    gather_s_per_tensor: float = 0.0
    """Simulated gather before each tensor (0: the plain `ModuleSource`)."""
    verify: bool = False
    """Compare the worker's checksum with the trainer's after the last round."""
    worker_baseline_bytes: int | None = None
    """The worker's RSS to count from (default: its RSS when the job starts)."""
    events_path: str | None = None
    """The worker transform's events file: record a per-round timeline."""
    transform_control: str | None = None
    """The worker transform's control file (`TransformConfig.control_path`)."""
    transform_s_per_bucket: float = 0.0
    """What this job's slow rounds write to `transform_control`."""
    rounds: int | None = None
    """Timed rounds (of each kind, when interleaved) instead of the run's count."""
    gated: bool = False
    """Before each round (warm-up included), hand control to the benchmark process
    (`run_trainer`'s `between_rounds`) and wait until it is done: a baseline can run
    right next to every asyncwt round, in the same seconds of the machine's speed."""
    interleaved: bool = False
    """Alternate rounds without the slow stages (no gather delay, an instant worker
    transform) and with them, so the stages alone and together are measured in the
    same minute on the same connection: the record is the slow rounds', and
    `record["alone"]` the others'. `rounds` counts each kind."""

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "config": {k: v for k, v in self.config.as_dict().items() if k != "budget_bytes"},
            "gather_s_per_tensor": self.gather_s_per_tensor,
            "verify": self.verify,
            "worker_baseline_bytes": self.worker_baseline_bytes,
            "events_path": self.events_path,
            "transform_control": self.transform_control,
            "transform_s_per_bucket": self.transform_s_per_bucket,
            "rounds": self.rounds,
            "interleaved": self.interleaved,
            "gated": self.gated,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainerJob:
        return cls(**{**data, "config": EngineConfig(**data["config"])})


def trainer_process(
    *,
    backend: str,
    url: str,
    worker_pid: int,
    shape: str,
    seed: int,
    rounds: dict[str, int],
    jobs: list[dict[str, Any]],
    result_path: str,
    gate_port: int | None = None,
) -> None:
    """Child side: build the trainer's model, run every job, write the results (JSON).

    A fresh process per worker keeps the trainer's memory figures honest: a heap
    that earlier sections warmed up would hide the engine's own allocations.
    """
    entry = next(b for b in BACKENDS if b.name == backend)
    model = SyntheticLlama(LlamaShape.from_json(shape))
    fill_random(model, seed)
    checksum = model_checksum(model)
    plan_rounds = Rounds(**rounds)
    results = []
    with contextlib.ExitStack() as stack:
        gate = None if gate_port is None else stack.enter_context(_Gate(gate_port))
        for number, raw in enumerate(jobs):
            job = TrainerJob.from_json(raw)
            print(f"trainer: {job.label}", file=sys.stderr, flush=True)
            wait = None
            if job.gated:
                if gate is None:
                    raise RuntimeError(f"job {job.label!r} is gated, but no gate port was given")
                wait = functools.partial(gate.wait, number)
            results.append(
                run_async(
                    functools.partial(
                        _run_job, entry, job, model, url, worker_pid, plan_rounds, checksum, wait
                    )
                )
            )
    tmp = result_path + ".tmp"
    with open(tmp, "w") as out:
        json.dump({"trainer_checksum": checksum, "results": results}, out)
    os.replace(tmp, result_path)


async def _run_job(
    backend: BackendEntry,
    job: TrainerJob,
    model: torch.nn.Module,
    url: str,
    worker_pid: int,
    rounds: Rounds,
    checksum: str,
    gate: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    timeline = job.interleaved or job.events_path is not None or job.gather_s_per_tensor > 0
    slow = SlowSource(model, job.gather_s_per_tensor)
    source: WeightSource = slow if timeline else ModuleSource(model)

    def is_slow(index: int) -> bool:
        return not job.interleaved or index % 2 == 1

    def before_round(index: int) -> None:
        if gate is not None:
            gate(index)
        if not job.interleaved:
            return
        on = is_slow(index)
        slow.delay_s = job.gather_s_per_tensor if on else 0.0
        if job.transform_control is not None:
            set_transform_delay(job.transform_control, job.transform_s_per_bucket if on else 0.0)

    timed = job.rounds or rounds.rounds
    measured = Rounds(rounds=timed * (2 if job.interleaved else 1), warmup=rounds.warmup)
    timelines: list[dict[str, Any]] = []
    offset = (
        os.path.getsize(job.events_path)
        if job.events_path and os.path.exists(job.events_path)
        else 0
    )

    def on_round(index: int, stats: RoundStats, sends: list[tuple[int, float, float]]) -> None:
        nonlocal offset
        end = time.monotonic()
        start = end - stats.wall_s
        worker_events: list[tuple[str, float, float]] = []
        if job.events_path is not None:
            worker_events, offset = read_events(job.events_path, offset)
        gathers = source.events if isinstance(source, SlowSource) else []
        timelines.append(
            {
                "round": index,
                "wall_s": stats.wall_s,
                "gather": [(n, a - start, b - start) for n, a, b in gathers],
                "send": [(i, a - start, b - start) for i, a, b in sends],
                "transform": [(n, a - start, b - start) for n, a, b in worker_events],
            }
        )

    record = await measure_engine(
        backend,
        url=url,
        worker_pid=worker_pid,
        source=source,
        config=job.config,
        rounds=measured,
        expected_checksum=checksum if job.verify else None,
        worker_baseline_bytes=job.worker_baseline_bytes,
        on_round=on_round if timeline else None,
        before_round=before_round if job.interleaved or gate is not None else None,
    )
    record["label"] = job.label
    record["gather_s_per_tensor"] = job.gather_s_per_tensor
    if timeline:
        record["timelines"] = timelines
    if job.interleaved:
        _split_interleaved(record, measured.warmup, is_slow)
    return record


def _split_interleaved(record: dict[str, Any], warmup: int, is_slow: Callable[[int], bool]) -> None:
    """Make `record` the slow rounds' and `record["alone"]` the others'; keep the
    timelines of the timed slow rounds only."""
    timed = list(enumerate(record["rounds_s"], start=warmup))
    slow = [t for i, t in timed if is_slow(i)]
    alone = [t for i, t in timed if not is_slow(i)]
    nbytes = record["bytes"]
    record.update(summarize(slow, nbytes, record["warmup_s"]))
    record["alone"] = summarize(alone, nbytes, [])
    record["interleaved"] = True
    if "timelines" in record:
        record["timelines"] = [
            t for t in record["timelines"] if t["round"] >= warmup and is_slow(t["round"])
        ]


_GATE = struct.Struct("!II")
"""Trainer child → benchmark: (job number, round index) about to start."""
_GO = b"G"


class _Gate:
    """The trainer child's end of the gate: announce a round, wait for the go."""

    def __init__(self, port: int) -> None:
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=TRAINER_TIMEOUT_S)

    def wait(self, job: int, index: int) -> None:
        self._sock.sendall(_GATE.pack(job, index))
        if recv_exact(self._sock, 1) != _GO:
            raise ConnectionError("the benchmark process answered the gate with something else")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._sock.close()


class _GateServer:
    """The benchmark's end: run `between_rounds(job label, round)` when the trainer
    child asks, then let it go on. Polled, so that a dead child is noticed."""

    def __init__(self, jobs: list[TrainerJob], between_rounds: Callable[[str, int], None]) -> None:
        self._labels = [job.label for job in jobs]
        self._between = between_rounds
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._conn: socket.socket | None = None
        self.port: int = self._listener.getsockname()[1]

    def poll(self, timeout: float) -> None:
        """Serve at most one request, waiting up to `timeout` seconds for it."""
        waiting = self._conn if self._conn is not None else self._listener
        if not readable(waiting, timeout):
            return
        if self._conn is None:
            self._conn, _ = self._listener.accept()
            self._conn.settimeout(TRAINER_TIMEOUT_S)
            return
        try:
            job, index = _GATE.unpack(recv_exact(self._conn, _GATE.size))
        except ConnectionError:  # the child is done with the gate (or gone)
            self._conn.close()
            self._conn = None
            return
        self._between(self._labels[job], index)
        self._conn.sendall(_GO)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._listener.close()


TRAINER_TIMEOUT_S = 3600.0


def run_trainer(
    backend: BackendEntry,
    *,
    url: str,
    worker: Child,
    shape: LlamaShape,
    seed: int,
    rounds: Rounds,
    jobs: list[TrainerJob],
    log_dir: Path,
    env: Mapping[str, str],
    between_rounds: Callable[[str, int], None] | None = None,
) -> tuple[str, list[dict[str, Any]]]:
    """Run `jobs` in a fresh trainer process against `worker`; (trainer checksum, records).

    `between_rounds(label, i)` runs here before round i (warm-up included) of every
    `gated` job, while the trainer process waits.
    """
    result = log_dir / f"trainer-{backend.name}-{worker.pid}.json"
    result.unlink(missing_ok=True)
    args = {
        "backend": backend.name,
        "url": url,
        "worker_pid": worker.pid,
        "shape": shape.to_json(),
        "seed": seed,
        "rounds": {"rounds": rounds.rounds, "warmup": rounds.warmup},
        "jobs": [job.to_json() for job in jobs],
        "result_path": str(result),
    }
    if any(job.gated for job in jobs) and between_rounds is None:
        raise ValueError("gated jobs need `between_rounds`")
    deadline = time.monotonic() + TRAINER_TIMEOUT_S
    with contextlib.ExitStack() as stack:
        gate = None
        if between_rounds is not None:
            gate = stack.enter_context(contextlib.closing(_GateServer(jobs, between_rounds)))
            args["gate_port"] = gate.port
        trainer = stack.enter_context(start_child(f"trainer-{backend.name}", args, log_dir, env))
        while trainer.proc.poll() is None:
            if gate is not None:
                gate.poll(0.05)
            else:
                time.sleep(0.05)
            if worker.proc.poll() is not None:
                raise worker.failure("the worker exited while the trainer ran")
            if time.monotonic() > deadline:
                raise trainer.failure(f"did not finish within {TRAINER_TIMEOUT_S}s")
        if trainer.proc.returncode != 0 or not result.exists():
            raise trainer.failure("the trainer process failed")
    data = json.loads(result.read_text())
    return data["trainer_checksum"], data["results"]
