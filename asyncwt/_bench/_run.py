"""One benchmark run: every section, in order, into one JSON-ready report dict.

Order: build the trainer's model → limits (memcpy, raw loopback) → peer approaches
(naive, gloo, packed) → per asyncwt backend: the default configuration against a
plain worker (the headline figure, bit-exactness checked), the staged path
(every bucket packed and received into buffers, as from a GPU) and the wire-alone
reference for the overlap test, the sweep, then the overlap test against a worker
whose transform is slow. Every child process is stopped before its section ends.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch

from .._backends.shm.cma import ReadProbe
from .._core.checksum import model_checksum
from .._core.plan import TransferPlan
from .._core.source import ModuleSource
from .._core.worker_api import WeightTransferConfig
from ._engines import BackendEntry, EngineConfig, TrainerJob, available_backends, run_trainer
from ._floors import gather_wire_floors, transform_floor
from ._limits import measure_memcpy, measure_raw_loopback
from ._memory import rss_bytes
from ._model import MODEL_ENV, LlamaShape, SyntheticLlama, fill_random
from ._overlap import (
    TRANSFORM_ENV,
    ApplyStage,
    SlowSource,
    TransformConfig,
    set_transform_delay,
    transform_jobs,
)
from ._paired import PairedBaselines, headline_limits
from ._peers import PEERS, measure_peer
from ._procs import Child, start_asyncwt_worker
from ._util import Rounds

__all__ = ["PRESETS", "BenchSettings", "run_bench"]

MiB = 1 << 20
KiB = 1 << 10
PAIR_ROUNDS = 5
"""Timed rounds of each kind (together, alone) at least, for the overlap pairs."""
BALANCE_WITHIN = 1.10
"""An overlap pair counts as "two stages of about the same cost" when its slow stage
alone is within this factor of the wire alone (times `--gather-x`/`--transform-x`);
a pair further off is calibrated again against the wire it met and run again..."""
PAIR_ATTEMPTS = 3
"""...at most this many times in all; the attempt closest to balance is the one
reported (whatever its ratio), every attempt is kept in the JSON."""
PAIR_NAMES = ("gather+wire", "wire+transform")
"""The overlap pairs, in the order they run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Preset:
    model_mib: float
    bucket_bytes: int
    headline_rounds: int
    sweep_bucket_bytes: tuple[int, ...]
    sweep_num_buffers: tuple[int, ...]
    pair_attempts: int = PAIR_ATTEMPTS
    """Calibrations of each overlap pair at most: below 1 GiB the speed bars are
    informational, so one attempt is kept and the run stays short."""


PRESETS: dict[str, Preset] = {
    "default": Preset(
        model_mib=1024, bucket_bytes=64 * MiB, headline_rounds=15,
        sweep_bucket_bytes=(16 * MiB, 64 * MiB, 256 * MiB), sweep_num_buffers=(1, 2, 4),
    ),
    "quick": Preset(
        model_mib=64, bucket_bytes=4 * MiB, headline_rounds=PAIR_ROUNDS,
        sweep_bucket_bytes=(1 * MiB, 4 * MiB, 16 * MiB), sweep_num_buffers=(1, 2, 4),
        pair_attempts=1,
    ),
    "tiny": Preset(
        model_mib=8, bucket_bytes=512 * KiB, headline_rounds=PAIR_ROUNDS,
        sweep_bucket_bytes=(256 * KiB, 1 * MiB), sweep_num_buffers=(1, 2),
        pair_attempts=1,
    ),
}  # fmt: skip
"""`default` is the 1 GiB model with the library's default bucket (64 MiB);
`quick` (64 MiB) is for CI-sized runs; `tiny` (8 MiB) is the test suite's smoke run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchSettings:
    """Everything one run needs; `asyncwt._bench._cli` builds it from the command line."""

    preset: str = "default"
    """Name of the preset the other defaults came from."""
    model_mib: float = 1024
    """Target model size (bf16); the synthetic Llama comes within a layer of it."""
    bucket_bytes: int = 64 * MiB
    """asyncwt's bucket size for the headline, memory and overlap runs (and `packed`)."""
    num_buffers: int = 2
    """asyncwt's buffers per side for the same runs."""
    read_streams: int = 0
    """shm: concurrent reads per bucket on a direct-reading worker (0: the default)."""
    rounds: Rounds = field(default_factory=Rounds)
    headline_rounds: int = 15
    """Timed rounds of the headline at least, each paired with a round of its limit.
    One round's ratio spreads from about 0.5x to 1.5x on a small shared machine
    (loopback TCP most), so the bar's median needs many more rounds than a figure."""
    out: Path = Path("bench-out")
    apply_threads: int = WeightTransferConfig.apply_threads
    """The worker's apply threads (the transform stage's parallelism)."""
    gather_x: float = 1.0
    """Overlap test: the simulated gather alone takes this multiple of the wire alone."""
    transform_elementwise: bool = True
    """Tell the workers the bench transform is elementwise (it is: its cost is per
    byte), so it runs on runs of elements as they arrive, shared among the apply
    threads; False gives it whole tensors, a chunked one after its last chunk."""
    transform_x: float = 1.0
    """Overlap test: the worker transform alone takes this multiple of the wire alone."""
    gather_ms_per_tensor: float | None = None
    """Fixed gather time per tensor instead of `gather_x` (milliseconds)."""
    transform_ms_per_bucket: float | None = None
    """Fixed transform time per full bucket instead of `transform_x` (milliseconds)."""
    sweep_bucket_bytes: tuple[int, ...] = (16 * MiB, 64 * MiB, 256 * MiB)
    sweep_num_buffers: tuple[int, ...] = (1, 2, 4)
    pair_attempts: int = PAIR_ATTEMPTS
    """Calibrations of each overlap pair at most (see `PAIR_ATTEMPTS`)."""
    sweep: bool = True
    peers: tuple[str, ...] = PEERS
    backends: tuple[str, ...] | None = None
    """asyncwt backends to run (None: every available one)."""
    seed: int = 0
    torch_threads: int = 1
    """torch intra-op threads in every process (this one and each child); 0 keeps
    torch's default. On a small machine two processes each running an OpenMP pool
    oversubscribe the cores and OpenMP's spin-waiting stalls the other process's
    socket I/O, so by default every approach runs with one."""

    def child_env(self) -> dict[str, str]:
        """Environment added to every child process."""
        return {} if self.torch_threads == 0 else {"OMP_NUM_THREADS": str(self.torch_threads)}

    @classmethod
    def from_preset(cls, name: str, **overrides: Any) -> BenchSettings:
        preset = PRESETS[name]
        values: dict[str, Any] = {
            "preset": name,
            "model_mib": preset.model_mib,
            "bucket_bytes": preset.bucket_bytes,
            "headline_rounds": preset.headline_rounds,
            "sweep_bucket_bytes": preset.sweep_bucket_bytes,
            "sweep_num_buffers": preset.sweep_num_buffers,
            "pair_attempts": preset.pair_attempts,
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @property
    def config(self) -> EngineConfig:
        return EngineConfig(
            bucket_bytes=self.bucket_bytes,
            num_buffers=self.num_buffers,
            read_streams=self.read_streams,
        )

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["rounds"] = asdict(self.rounds)
        data["out"] = str(self.out)
        return data


Log = Callable[[str], None]


def run_bench(settings: BenchSettings, log: Log = print) -> dict[str, Any]:
    """Run every section; the report (see `_report.py` for the bars and the table)."""
    threads = torch.get_num_threads()
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    try:
        return _run_bench(settings, log)
    finally:
        torch.set_num_threads(threads)


def _run_bench(settings: BenchSettings, log: Log) -> dict[str, Any]:
    """Every section in order: limits, peers, each backend, the limit again."""
    started = time.perf_counter()
    log_dir = settings.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    shape = LlamaShape.for_mib(settings.model_mib)
    model = SyntheticLlama(shape)
    fill_random(model, settings.seed)
    nbytes = model.nbytes
    expected = model_checksum(model)
    rounds = settings.rounds
    log(
        f"model: synthetic Llama {shape.layers} layers, hidden {shape.hidden}, "
        f"{shape.num_tensors} tensors, {nbytes / MiB:.1f} MiB bf16; "
        f"{rounds.rounds} timed rounds after {rounds.warmup} warm-up per figure"
    )
    report: dict[str, Any] = {
        "meta": _meta(settings, shape, nbytes, expected),
        "limits": {},
        "peers": {},
        "asyncwt": {},
        "overlap": {},
        "memory": {},
        "sweep": {},
    }

    log("limits: memcpy, one thread and two")
    report["limits"]["memcpy"] = measure_memcpy(model, rounds)
    report["limits"]["memcpy_2cores"] = measure_memcpy(model, rounds, cores=2)
    log("limits: raw loopback TCP")
    raw_start = measure_raw_loopback(nbytes, rounds, log_dir, settings.child_env())
    report["limits"]["raw_loopback"] = raw_start

    for approach in settings.peers:
        log(f"peer: {approach}")
        report["peers"][approach] = measure_peer(
            approach, model, shape, rounds,
            bucket_bytes=settings.bucket_bytes, expected_checksum=expected, log_dir=log_dir,
            env=settings.child_env(),
        )  # fmt: skip

    _run_backends(settings, model, shape, expected, report, log, log_dir)

    # A shared machine drifts over minutes: measure the limit again and keep the
    # better of the two, so that no ratio flatters asyncwt because the wire slowed.
    log("limits: raw loopback TCP again (drift check)")
    raw_end = measure_raw_loopback(nbytes, rounds, log_dir, settings.child_env())
    report["limits"]["raw_loopback"] = _better_raw_loopback(raw_start, raw_end)
    report["meta"]["runtime_s"] = time.perf_counter() - started
    report["meta"]["loadavg_at_end"] = os.getloadavg()
    return report


def _meta(settings: BenchSettings, shape: LlamaShape, nbytes: int, expected: str) -> dict[str, Any]:
    """What the run was: its settings, the model, the software and the machine."""
    return {
        "settings": settings.as_dict(),
        "model": {
            **asdict(shape),
            "bytes": nbytes,
            "tensors": shape.num_tensors,
            "dtype": "bfloat16",
        },
        "trainer_checksum": expected,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "started_unix": time.time(),
        "loadavg_at_start": os.getloadavg(),
    }


def _run_backends(
    settings: BenchSettings,
    model: torch.nn.Module,
    shape: LlamaShape,
    expected: str,
    report: dict[str, Any],
    log: Log,
    log_dir: Path,
) -> None:
    """Every available backend's sections; one that fails is reported, not fatal
    (unless it is the only one)."""
    backends = available_backends(settings.backends)
    report["meta"]["backends"] = [b.name for b in backends]
    report["meta"]["backend_errors"] = {}
    for backend in backends:
        try:
            _run_backend(backend, settings, model, shape, expected, report, log, log_dir)
        except Exception as exc:  # one backend failing must not lose the others
            if len(backends) == 1:
                raise
            log(f"asyncwt {backend.name}: FAILED, going on without it: {type(exc).__name__}: {exc}")
            report["meta"]["backend_errors"][backend.name] = f"{type(exc).__name__}: {exc}"
            for section in ("asyncwt", "overlap", "memory", "sweep"):
                report[section].pop(backend.name, None)


def _better_raw_loopback(raw_start: dict[str, Any], raw_end: dict[str, Any]) -> dict[str, Any]:
    """The faster of the run's two raw loopback figures, with both and their drift."""
    best = raw_start if raw_start["gbps"] >= raw_end["gbps"] else raw_end
    return {
        **best,
        "taken": "start" if best is raw_start else "end",
        "start": {k: raw_start[k] for k in ("median_s", "gbps", "rounds_s", "variant")},
        "end": {k: raw_end[k] for k in ("median_s", "gbps", "rounds_s", "variant")},
        "drift": raw_end["gbps"] / raw_start["gbps"] - 1,
    }


TrainerRun = Callable[..., list[dict[str, Any]]]
"""`run(worker, url, jobs, between_rounds=None)`: a trainer process's job records."""


def _run_backend(
    backend: BackendEntry,
    settings: BenchSettings,
    model: torch.nn.Module,
    shape: LlamaShape,
    expected: str,
    report: dict[str, Any],
    log: Log,
    log_dir: Path,
) -> None:
    """One backend's sections: headline and sweep, staged path, memory, overlap."""
    name = backend.name
    env = {**settings.child_env(), MODEL_ENV: shape.to_json()}
    trainer = _trainer_runner(backend, settings, shape, expected, log_dir, env)
    direct, sweep_direct = _headline(
        backend, settings, model, shape, report, trainer, log, log_dir, env
    )
    staged, wire, sweep_staged = _staged(backend, settings, trainer, log, log_dir, env)
    direct["path"], staged["path"], wire["path"] = "direct", "staged", "transform-hook"

    report["asyncwt"][name] = {"direct": direct, "staged": staged}
    rows = [{"mode": "direct", **r} for r in sweep_direct] + [
        {"mode": "staged", **r} for r in sweep_staged
    ]
    report["sweep"][name] = _summarize_sweep(rows)
    report["memory"][name] = _memory_section(direct, staged, model)

    # 3. Overlap: slow gather + wire + slow transform, against the slowest alone.
    apply = _ApplyBench.build(backend, settings, shape)
    report["overlap"][name] = _overlap(
        backend, settings, model, shape, wire, apply, trainer, log, log_dir, env
    )
    report["overlap"][name]["pairs"] = _overlap_pairs(
        backend, settings, model, shape, apply, trainer, log, log_dir, env
    )


def _trainer_runner(
    backend: BackendEntry,
    settings: BenchSettings,
    shape: LlamaShape,
    expected: str,
    log_dir: Path,
    env: dict[str, str],
) -> TrainerRun:
    """Runs jobs in a fresh trainer process, checking that it built the same model."""

    def trainer(
        worker: Child,
        url: str,
        jobs: list[TrainerJob],
        between_rounds: Callable[[str, int], None] | None = None,
    ) -> list[dict[str, Any]]:
        checksum, records = run_trainer(
            backend, url=url, worker=worker, shape=shape, seed=settings.seed,
            rounds=settings.rounds, jobs=jobs, log_dir=log_dir, env=env,
            between_rounds=between_rounds,
        )  # fmt: skip
        if checksum != expected:
            raise RuntimeError(
                f"the trainer process built a different model (checksum {checksum[:16]}…, "
                f"expected {expected[:16]}…); the synthetic fill should be deterministic"
            )
        return records

    return trainer


def _headline(
    backend: BackendEntry,
    settings: BenchSettings,
    model: torch.nn.Module,
    shape: LlamaShape,
    report: dict[str, Any],
    trainer: TrainerRun,
    log: Log,
    log_dir: Path,
    env: dict[str, str],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """1. The default configuration against a plain worker (the headline), each round
    paired with the rounds of the backend's limits run right before it (raw loopback
    TCP; one and two cores' memcpy for shm, see `headline_limits`); then the sweep.
    The headline record and the sweep's."""
    name = backend.name
    worker, url = start_asyncwt_worker(
        backend=name, log_dir=log_dir, env=env, apply_threads=settings.apply_threads,
        role=f"worker-{name}",
    )  # fmt: skip
    headline_rounds = Rounds(
        rounds=max(settings.rounds.rounds, settings.headline_rounds),
        warmup=settings.rounds.warmup,
    )
    paired = PairedBaselines(
        model, shape, rounds=headline_rounds,
        raw_chunk=int(report["limits"]["raw_loopback"]["chunk_bytes"]),
        jobs={PairedBaselines.RAW_JOB: headline_limits(name)}, log_dir=log_dir,
        env=settings.child_env(),
    )  # fmt: skip
    with worker, paired:
        jobs = [
            TrainerJob(
                label=label,
                config=settings.config,
                verify=True,
                worker_baseline_bytes=rss_bytes(worker.pid),
                rounds=paired.job_rounds,
                gated=True,
            )
            for label in paired.jobs
        ]
        if settings.sweep:
            jobs += [
                TrainerJob(label="sweep direct", config=c) for c in _grid(settings, zero_copy=True)
            ]
        log(
            f"asyncwt {name}: default configuration (direct landing), paired round for round "
            f"with {' and '.join(n for names in paired.jobs.values() for n in names)}, then "
            f"{len(jobs) - len(paired.jobs)} "
            f"sweep runs, against {url}"
        )
        records = trainer(worker, url, jobs, between_rounds=paired.between)
        headline = dict(zip(paired.jobs, records, strict=False))
        sweep_direct = records[len(headline) :]
        direct = headline[PairedBaselines.RAW_JOB]
        direct["paired"] = paired.result(headline, report["meta"]["trainer_checksum"])
    return direct, sweep_direct


def _staged(
    backend: BackendEntry,
    settings: BenchSettings,
    trainer: TrainerRun,
    log: Log,
    log_dir: Path,
    env: dict[str, str],
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """2. The staged path: the trainer packs every bucket, the worker receives into
    buffers and applies through an (instant) identity transform; then the wire
    alone for the overlap test (zero-copy send, transform hook), then the sweep.
    The staged record, the wire-alone record and the sweep's."""
    name = backend.name
    default = settings.config
    staged_default = replace(default, zero_copy=False)
    staged_env = {
        **env,
        TRANSFORM_ENV: TransformConfig(
            s_per_bucket=0.0, bucket_bytes=default.bucket_bytes
        ).to_json(),
    }
    worker, url = start_asyncwt_worker(
        backend=name, log_dir=log_dir, env=staged_env, apply_threads=settings.apply_threads,
        transform="asyncwt._bench._overlap:bench_transform",
        transform_elementwise=settings.transform_elementwise, role=f"worker-{name}-staged",
    )  # fmt: skip
    with worker:
        jobs = [
            TrainerJob(
                label="staged",
                config=staged_default,
                verify=True,
                worker_baseline_bytes=rss_bytes(worker.pid),
            ),
            TrainerJob(label="wire alone", config=default, verify=True),
        ]
        if settings.sweep:
            jobs += [
                TrainerJob(label="sweep staged", config=c) for c in _grid(settings, zero_copy=False)
            ]
        log(
            f"asyncwt {name}: staged path, wire-alone reference, then {len(jobs) - 2} sweep runs, against {url}"
        )
        staged, wire, *sweep_staged = trainer(worker, url, jobs)
    return staged, wire, sweep_staged


def _grid(settings: BenchSettings, *, zero_copy: bool) -> list[EngineConfig]:
    return [
        replace(settings.config, bucket_bytes=b, num_buffers=n, zero_copy=zero_copy)
        for b in settings.sweep_bucket_bytes
        for n in settings.sweep_num_buffers
    ]


def _size(nbytes: int) -> str:
    return f"{nbytes / MiB:g} MiB" if nbytes >= MiB else f"{nbytes / KiB:g} KiB"


def _summarize_sweep(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Every configuration, plus per mode the fastest and the recommended one.

    Recommended: the least staging budget among configurations within 5% of the
    fastest median (memory is the second thing users complain about).
    """
    slim = [
        {
            "mode": r["mode"],
            "bucket_bytes": r["config"]["bucket_bytes"],
            "num_buffers": r["config"]["num_buffers"],
            "budget_bytes": r["config"]["budget_bytes"],
            "median_s": r["median_s"],
            "rounds_s": r["rounds_s"],
            "gbps": r["gbps"],
            "buckets": r["buckets"],
            "stage_busy_s": r["stage_busy_s"],
            "trainer_extra_bytes": r["memory"]["trainer"]["extra_bytes"],
            "worker_extra_bytes": r["memory"]["worker"]["extra_bytes"],
        }
        for r in rows
    ]
    best: dict[str, Any] = {}
    recommended: dict[str, Any] = {}
    for mode in sorted({r["mode"] for r in slim}):
        mine = [r for r in slim if r["mode"] == mode]
        fastest = min(mine, key=lambda r: r["median_s"])
        near = [r for r in mine if r["median_s"] <= fastest["median_s"] * 1.05]
        pick = min(near, key=lambda r: (r["budget_bytes"], r["median_s"]))
        best[mode] = {k: fastest[k] for k in ("bucket_bytes", "num_buffers", "median_s", "gbps")}
        recommended[mode] = {
            k: pick[k] for k in ("bucket_bytes", "num_buffers", "median_s", "gbps", "budget_bytes")
        }
    return {"rows": slim, "fastest": best, "recommended": recommended}


def _memory_section(
    direct: dict[str, Any], staged: dict[str, Any], model: torch.nn.Module
) -> dict[str, Any]:
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    out: dict[str, Any] = {"model_bytes": model_bytes}
    for path, record in (("direct", direct), ("staged", staged)):
        budget = record["config"]["budget_bytes"]
        sides = {}
        for side in ("trainer", "worker"):
            extra = record["memory"][side]["extra_bytes"]
            sides[side] = {
                **record["memory"][side],
                "vs_budget": extra / budget,
                "vs_model": extra / model_bytes,
            }
        out[path] = {"budget_bytes": budget, "config": record["config"], **sides}
    return out


def _more_buffers(settings: BenchSettings) -> EngineConfig:
    """The default configuration with one more buffer per apply thread: a receive
    buffer stays free for the next bucket while every apply thread holds one."""
    config = settings.config
    return replace(config, num_buffers=config.num_buffers + settings.apply_threads)


def _slow_transform_worker(
    backend: BackendEntry,
    settings: BenchSettings,
    transform: TransformConfig,
    log_dir: Path,
    env: dict[str, str],
    *,
    role: str,
) -> tuple[Child, str]:
    """An `asyncwt worker` whose transform is the bench's slow identity."""
    return start_asyncwt_worker(
        backend=backend.name, log_dir=log_dir, env={**env, TRANSFORM_ENV: transform.to_json()},
        apply_threads=settings.apply_threads, transform="asyncwt._bench._overlap:bench_transform",
        transform_elementwise=settings.transform_elementwise, role=role,
    )  # fmt: skip


def _gather_alone(
    model: torch.nn.Module, delay: float, rounds: Rounds, nbytes: int
) -> dict[str, Any]:
    """The simulated gather stage alone: full passes of a `SlowSource`, timed."""
    slow = SlowSource(model, delay)

    def gather_once() -> float:
        start = time.perf_counter()
        for _ in slow.iter_full():
            pass
        return time.perf_counter() - start

    return rounds.measure(gather_once, nbytes)


_PROBE_CHILD = (
    "import sys; from asyncwt._backends.shm.cma import ReadProbe, probe_reads; "
    "sys.exit(probe_reads(ReadProbe(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])) is not None)"
)


def workers_land_in_place(backend: str) -> bool:
    """Whether `backend`'s workers receive bytes straight into the model, so that
    their apply stage alone copies nothing: not from a ring (`cuda_ipc`); `shm`'s
    do where they may read the trainer's memory, which a child of this process
    tries here, as the benchmark's worker processes would."""
    if backend == "cuda_ipc":
        return False
    if backend != "shm":
        return True
    probe, buffer = ReadProbe.create()
    args = [sys.executable, "-c", _PROBE_CHILD, str(probe.pid), str(probe.address), probe.nonce]
    done = subprocess.run(args, timeout=120, check=False)
    del buffer  # held until the child has read it
    return done.returncode == 0


@dataclass(frozen=True)
class _ApplyBench:
    """The backend's apply stage alone, and its cost with an instant transform
    (unpacking and copies into the model only)."""

    stage: ApplyStage
    copies: dict[str, Any]
    """`Rounds.measure` record of the stage with a transform that takes no time."""

    @classmethod
    def build(
        cls, backend: BackendEntry, settings: BenchSettings, shape: LlamaShape
    ) -> _ApplyBench:
        worker = SyntheticLlama(shape)
        plan = TransferPlan.build(ModuleSource(worker).metadata, bucket_bytes=settings.bucket_bytes)
        stage = ApplyStage(
            worker, plan, settings.apply_threads,
            elementwise=settings.transform_elementwise,
            in_place=workers_land_in_place(backend.name),
        )  # fmt: skip
        instant = TransformConfig(s_per_bucket=0.0, bucket_bytes=settings.bucket_bytes)
        copies = settings.rounds.measure(lambda: stage.once_s(instant), plan.total_bytes)
        return cls(stage, copies)

    def alone(self, config: TransformConfig, rounds: Rounds) -> dict[str, Any]:
        return rounds.measure(lambda: self.stage.once_s(config), self.stage.plan.total_bytes)


def _calibrated_gather(
    model: torch.nn.Module, target_s: float, rounds: Rounds, nbytes: int
) -> tuple[float, dict[str, Any]]:
    """The per-tensor sleep that makes a gather pass take about `target_s`, and that
    pass measured alone. A sleep overshoots: the first measurement
    corrects the delay once."""
    count = sum(1 for _ in model.parameters())
    delay = target_s / count
    first = _gather_alone(model, delay, rounds, nbytes)
    delay = max(0.0, delay - (first["median_s"] - target_s) / count)
    return delay, _gather_alone(model, delay, rounds, nbytes)


def _calibrated_transform_s(
    settings: BenchSettings, wire_s: float, plan: TransferPlan, apply: _ApplyBench
) -> float:
    """Transform seconds per full bucket so that the apply stage alone (its copies
    included) takes about `transform_x` times `wire_s` on the worker's apply threads."""
    share = plan.bucket_bytes / plan.total_bytes
    sleeping = max(0.0, settings.transform_x * wire_s - float(apply.copies["median_s"]))
    return sleeping * settings.apply_threads * share


def _median_timeline(record: dict[str, Any], warmup: int) -> dict[str, Any] | None:
    """The timeline of `record`'s median timed round (and drop the others)."""
    timed: list[dict[str, Any]] = record.pop("timelines", [])[warmup:]
    if not timed:
        return None
    return sorted(timed, key=lambda t: float(t["wall_s"]))[len(timed) // 2]


def _overlap_record(
    stages: dict[str, float],
    total: dict[str, Any],
    more_buffers: dict[str, Any],
    warmup: int,
    more_stages: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Stages together (default buffers, and more) against the slowest of them alone
    (`more_stages` for the more-buffers run, if measured apart), with the default
    run's median timeline."""
    slowest = max(stages, key=lambda k: stages[k])
    more_stages = more_stages or stages
    timeline = _median_timeline(total, warmup)
    _median_timeline(more_buffers, warmup)
    return {
        "timeline": timeline,
        "stage_alone_s": stages,
        "slowest_stage": slowest,
        "slowest_alone_s": stages[slowest],
        "overlapped": total,
        "total_vs_slowest": total["median_s"] / stages[slowest],
        "balance": stages[slowest] / min(stages.values()),
        "paired_vs_slowest": _paired_ratio(total, stages),
        "more_buffers": {
            "num_buffers": more_buffers["config"]["num_buffers"],
            "median_s": more_buffers["median_s"],
            "rounds_s": more_buffers["rounds_s"],
            "stage_alone_s": more_stages,
            "total_vs_slowest": more_buffers["median_s"] / max(more_stages.values()),
            "paired_vs_slowest": _paired_ratio(more_buffers, more_stages),
            "bit_exact": more_buffers.get("bit_exact"),
        },
    }


def _paired_ratio(record: dict[str, Any], stages: dict[str, float]) -> float | None:
    """For an interleaved record: the median over its rounds of each round together
    against the slower of its neighbouring wire-alone round and the other stages
    alone, a paired estimate that a drift of the machine's speed cancels out of."""
    alone = record.get("alone")
    if alone is None:
        return None
    others = max(v for k, v in stages.items() if k != "wire")
    ratios = [t / max(a, others) for t, a in zip(record["rounds_s"], alone["rounds_s"])]
    return float(statistics.median(ratios))


def _overlap_pairs(
    backend: BackendEntry,
    settings: BenchSettings,
    model: torch.nn.Module,
    shape: LlamaShape,
    apply: _ApplyBench,
    trainer: TrainerRun,
    log: Log,
    log_dir: Path,
    env: dict[str, str],
    pairs: Collection[str] = PAIR_NAMES,
) -> dict[str, dict[str, Any]]:
    """The bar's case: two stages of about the same cost, each pair on its own.

    - `gather+wire`: a slow gathering source (calibrated to the default run's wire
      time) into a plain worker, which applies nothing slow;
    - `wire+transform`: a plain source into a worker whose apply stage alone takes
      about the transform-hook wire time.
    The wire alone is measured interleaved with the pair, round for round on the
    same connection (`TrainerJob.interleaved`), and the slow stage is calibrated
    against the wire measured on that worker just before: on a shared machine the
    wire's speed drifts by tens of percent within minutes, and a ratio must not
    measure that. A pair that still comes out off balance is calibrated again
    against the wire it met (`BALANCE_WITHIN`, `PAIR_ATTEMPTS`). Each pair takes at
    least `PAIR_ROUNDS` rounds of each kind, and runs with the default buffers and
    with one more per apply thread.
    """
    config = settings.config
    ctx = _PairRun(
        backend=backend, settings=settings, model=model, apply=apply, trainer=trainer,
        log=log, log_dir=log_dir, env=env, more=_more_buffers(settings),
        plan=TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=config.bucket_bytes),
        rounds=Rounds(
            rounds=max(settings.rounds.rounds, PAIR_ROUNDS), warmup=settings.rounds.warmup
        ),
    )  # fmt: skip
    builders = {"gather+wire": _gather_wire_pair, "wire+transform": _wire_transform_pair}
    return {name: builders[name](ctx) for name in PAIR_NAMES if name in pairs}


@dataclass(frozen=True, kw_only=True)
class _PairRun:
    """What every overlap pair of one backend runs with."""

    backend: BackendEntry
    settings: BenchSettings
    model: torch.nn.Module
    apply: _ApplyBench
    trainer: TrainerRun
    log: Log
    log_dir: Path
    env: dict[str, str]
    more: EngineConfig
    """The default configuration with one more buffer per apply thread."""
    plan: TransferPlan
    rounds: Rounds

    @property
    def config(self) -> EngineConfig:
        return self.settings.config

    def calibrate(self, worker: Child, url: str) -> float:
        """The wire alone against `worker`, measured right before the pair."""
        job = TrainerJob(label="calibration", config=self.config, rounds=self.rounds.rounds)
        (result,) = self.trainer(worker, url, [job])
        return float(result["median_s"])

    def together(self, worker: Child, url: str, label: str, **job: Any) -> list[dict[str, Any]]:
        """The pair interleaved with the wire alone, default buffers then more."""
        jobs = [
            TrainerJob(
                label=f"{label}{tag}", config=c, verify=True, rounds=self.rounds.rounds,
                interleaved=True, **job,
            )
            for tag, c in (("", self.config), (", more buffers", self.more))
        ]  # fmt: skip
        return self.trainer(worker, url, jobs)


def _gather_wire_pair(ctx: _PairRun) -> dict[str, Any]:
    """A slow gather into a plain worker (the headline's configuration)."""
    name, settings = ctx.backend.name, ctx.settings
    worker, url = start_asyncwt_worker(
        backend=name, log_dir=ctx.log_dir, env=ctx.env, apply_threads=settings.apply_threads,
        role=f"worker-{name}-pair",
    )  # fmt: skip
    with worker:
        target = settings.gather_x * ctx.calibrate(worker, url)
        tries: list[dict[str, Any]] = []
        for attempt in range(1, settings.pair_attempts + 1):
            delay, gather_alone = _calibrated_gather(
                ctx.model, target, ctx.rounds, ctx.plan.total_bytes
            )
            ctx.log(
                f"overlap pair (attempt {attempt}): slow gather ({delay * 1e3:.2f} ms/tensor) -> "
                f"{name}, interleaved with the wire alone, against {url}"
            )
            total, more_total = ctx.together(worker, url, "gather+wire", gather_s_per_tensor=delay)
            wire_s = total["alone"]["median_s"]
            tries.append({
                "delay": delay, "gather_alone": gather_alone, "total": total,
                "more_total": more_total,
                "off": _off_balance(gather_alone["median_s"], settings.gather_x * wire_s),
            })  # fmt: skip
            if tries[-1]["off"] <= BALANCE_WITHIN:
                break
            target = settings.gather_x * wire_s  # the wire the pair just met
    return _gather_wire_record(ctx, tries)


def _gather_wire_record(ctx: _PairRun, tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The gather+wire attempt closest to balance, with every attempt and its floors."""
    kept = min(tries, key=lambda t: float(t["off"]))
    gather_alone, total, more_total = kept["gather_alone"], kept["total"], kept["more_total"]
    gather_s, wire_s = gather_alone["median_s"], total["alone"]["median_s"]
    record = _overlap_record(
        {"gather": gather_s, "wire": wire_s}, total, more_total, 0,
        {"gather": gather_s, "wire": more_total["alone"]["median_s"]},
    )  # fmt: skip
    record["gather_s_per_tensor"] = kept["delay"]
    record["attempts"] = _attempts(tries, kept, "gather_s_per_tensor", "delay")
    floors = gather_wire_floors(ctx.plan, gather_s, wire_s)
    # What the same work would allow in registration order (LM head last).
    registration = TransferPlan.build(
        ModuleSource(ctx.model, layers_last=False).metadata, bucket_bytes=ctx.config.bucket_bytes
    )
    floors["bucket, registration order"] = gather_wire_floors(registration, gather_s, wire_s)[
        "bucket"
    ]
    record["floor"] = _floor_record(floors, record)
    return record


def _wire_transform_pair(ctx: _PairRun) -> dict[str, Any]:
    """A plain source into a worker whose transform the trainer switches."""
    name, settings = ctx.backend.name, ctx.settings
    events_path = ctx.log_dir / f"transform-events-{name}-pair.txt"
    control_path = ctx.log_dir / f"transform-control-{name}-pair.txt"
    events_path.unlink(missing_ok=True)
    set_transform_delay(str(control_path), 0.0)  # instant until a slow round
    switched = TransformConfig(
        s_per_bucket=0.0, bucket_bytes=ctx.config.bucket_bytes,
        events_path=str(events_path), control_path=str(control_path),
    )  # fmt: skip
    worker, url = _slow_transform_worker(
        ctx.backend, settings, switched, ctx.log_dir, ctx.env, role=f"worker-{name}-pair-transform"
    )
    with worker:
        aim = ctx.calibrate(worker, url)
        tries: list[dict[str, Any]] = []
        for attempt in range(1, settings.pair_attempts + 1):
            s_per_bucket = _calibrated_transform_s(settings, aim, ctx.plan, ctx.apply)
            transform = TransformConfig(
                s_per_bucket=s_per_bucket, bucket_bytes=ctx.config.bucket_bytes
            )
            transform_alone = ctx.apply.alone(transform, ctx.rounds)
            ctx.log(
                f"overlap pair (attempt {attempt}): {name} -> slow transform "
                f"({s_per_bucket * 1e3:.2f} ms/bucket), interleaved with the wire alone, against {url}"
            )
            total, more_total = ctx.together(
                worker, url, "wire+transform", events_path=str(events_path),
                transform_control=str(control_path), transform_s_per_bucket=s_per_bucket,
            )  # fmt: skip
            wire_s, apply_s = total["alone"]["median_s"], transform_alone["median_s"]
            tries.append({
                "s_per_bucket": s_per_bucket, "transform_alone": transform_alone, "total": total,
                "more_total": more_total,
                "off": _off_balance(apply_s, settings.transform_x * wire_s),
            })  # fmt: skip
            if tries[-1]["off"] <= BALANCE_WITHIN:
                break
            # Aim at the wire the pair just met, corrected by how far the calibration
            # itself missed its aim (the apply stage's own costs move with the machine).
            aim = wire_s + (aim - apply_s / settings.transform_x)
    return _wire_transform_record(ctx, tries)


def _wire_transform_record(ctx: _PairRun, tries: list[dict[str, Any]]) -> dict[str, Any]:
    """The wire+transform attempt closest to balance, with every attempt and its floors."""
    settings, plan, apply = ctx.settings, ctx.plan, ctx.apply
    kept = min(tries, key=lambda t: float(t["off"]))
    s_per_bucket, total, more_total = kept["s_per_bucket"], kept["total"], kept["more_total"]
    wire_s = total["alone"]["median_s"]
    apply_s = kept["transform_alone"]["median_s"]
    record = _overlap_record(
        {"wire": wire_s, "transform": apply_s}, total, more_total, 0,
        {"wire": more_total["alone"]["median_s"], "transform": apply_s},
    )  # fmt: skip
    record["transform_s_per_bucket"] = s_per_bucket
    record["attempts"] = _attempts(tries, kept, "transform_s_per_bucket", "s_per_bucket")
    # Every job costs its bytes at the transform's rate plus the copies' (measured).
    copy_s_per_bucket = (
        apply.copies["median_s"] * settings.apply_threads * (plan.bucket_bytes / plan.total_bytes)
    )
    floors = {
        mode: transform_floor(
            plan,
            transform_jobs(
                ctx.model, plan, settings.apply_threads, elementwise=elementwise,
                in_place=apply.stage.in_place,
            ),
            wire_s, s_per_bucket + copy_s_per_bucket, settings.apply_threads,
        )
        for mode, elementwise in (("elementwise", True), ("whole tensors", False))
    }  # fmt: skip
    record["floor"] = _floor_record(floors, record)
    return record


def _off_balance(stage_s: float, wire_s: float) -> float:
    """How far a pair is from the balance it aims at: the larger over the smaller."""
    return max(stage_s, wire_s) / min(stage_s, wire_s)


def _attempts(
    tries: list[dict[str, Any]], kept: dict[str, Any], knob: str, key: str
) -> list[dict[str, Any]]:
    """Each attempt at a balanced pair, in a line: its knob, balance and ratio."""
    out = []
    for t in tries:
        total = t["total"]
        if t is not kept:
            total.pop("timelines", None)
            t["more_total"].pop("timelines", None)
        alone = t.get("gather_alone") or t["transform_alone"]
        slower = max(float(alone["median_s"]), float(total["alone"]["median_s"]))
        out.append({
            knob: t[key], "off_balance": t["off"], "kept": t is kept,
            "median_s": total["median_s"], "total_vs_slower": total["median_s"] / slower,
        })  # fmt: skip
    return out


def _floor_record(floors: dict[str, float], pair: dict[str, Any]) -> dict[str, Any]:
    """Ideal-pipeline seconds by granularity, and each against the pair's slower stage."""
    slowest = pair["slowest_alone_s"]
    return {mode: {"s": s, "vs_slowest": s / slowest} for mode, s in floors.items()}


def _overlap(
    backend: BackendEntry,
    settings: BenchSettings,
    model: torch.nn.Module,
    shape: LlamaShape,
    wire: dict[str, Any],
    apply: _ApplyBench,
    trainer: TrainerRun,
    log: Log,
    log_dir: Path,
    env: dict[str, str],
) -> dict[str, Any]:
    """Slow gather + wire + slow transform together vs the slowest of them alone.

    By default each simulated stage alone is calibrated to the wire alone (the
    hardest case for overlap: three equal stages); `--gather-x`/`--transform-x` or
    fixed milliseconds change that.
    """
    rounds = settings.rounds
    config = settings.config
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=config.bucket_bytes)
    wire_s = wire["median_s"]
    gather_delay, s_per_bucket = _overlap_delays(settings, shape, wire_s, plan, apply)
    transform = TransformConfig(s_per_bucket=s_per_bucket, bucket_bytes=config.bucket_bytes)
    log(
        f"overlap: gather {gather_delay * 1e3:.2f} ms/tensor, transform {s_per_bucket * 1e3:.2f} ms/bucket "
        f"on {settings.apply_threads} apply thread(s)"
    )

    gather_alone = _gather_alone(model, gather_delay, rounds, plan.total_bytes)
    transform_alone = apply.alone(transform, rounds)

    events_path = log_dir / f"transform-events-{backend.name}.txt"
    events_path.unlink(missing_ok=True)
    worker_transform = TransformConfig(
        s_per_bucket=s_per_bucket, bucket_bytes=config.bucket_bytes, events_path=str(events_path)
    )
    worker, url = _slow_transform_worker(
        backend, settings, worker_transform, log_dir, env, role=f"worker-{backend.name}-overlap"
    )
    with worker:
        log(f"overlap: slow gather -> {backend.name} -> slow transform, against {url}")
        more = _more_buffers(settings)
        jobs = [
            TrainerJob(
                label=label, config=c, gather_s_per_tensor=gather_delay, verify=True,
                events_path=str(events_path),
            )
            for label, c in (("overlap", config), ("overlap, more buffers", more))
        ]  # fmt: skip
        total, more_buffers = trainer(worker, url, jobs)
    stages = {
        "gather": gather_alone["median_s"],
        "wire": wire_s,
        "transform": transform_alone["median_s"],
    }
    record = _overlap_record(stages, total, more_buffers, rounds.warmup)
    record["more_buffers"]["memory"] = more_buffers["memory"]
    return {
        "config": config.as_dict(),
        "gather_s_per_tensor": gather_delay,
        "transform_s_per_bucket": s_per_bucket,
        "apply_threads": settings.apply_threads,
        "transform_elementwise": settings.transform_elementwise,
        "gather_alone": gather_alone,
        "wire_alone": {
            k: wire[k] for k in ("median_s", "rounds_s", "gbps", "stage_busy_s", "config")
        },
        "transform_alone": transform_alone,
        "apply_copies_alone": apply.copies,
        **record,
        "sum_of_stages_s": sum(stages.values()),
        "total_vs_sum": total["median_s"] / sum(stages.values()),
    }


def _overlap_delays(
    settings: BenchSettings,
    shape: LlamaShape,
    wire_s: float,
    plan: TransferPlan,
    apply: _ApplyBench,
) -> tuple[float, float]:
    """The gather's seconds per tensor and the transform's per bucket: fixed if the
    options say so, else each stage alone calibrated to its multiple of the wire."""
    if settings.gather_ms_per_tensor is not None:
        gather_delay = settings.gather_ms_per_tensor / 1000
    else:
        gather_delay = settings.gather_x * wire_s / shape.num_tensors
    if settings.transform_ms_per_bucket is not None:
        s_per_bucket = settings.transform_ms_per_bucket / 1000
    else:
        s_per_bucket = _calibrated_transform_s(settings, wire_s, plan, apply)
    return gather_delay, s_per_bucket
