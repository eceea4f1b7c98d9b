"""One cluster bench run: build the hosts, start the workers, run every scenario.

The workers (`asyncwt worker`, one per worker host) start once and serve every
scenario; each scenario starts fresh trainer rank processes (`cluster.rank`) in the
trainer hosts. Per link rate (the caps change between scenarios, while no data flows):

- workers: one trainer (rank 0 on host t0) to N = 1, 2, 4, 8 workers, all N in one
  trainer process, one after the other;
- ranks: M = 2, 4 FSDP2 ranks (hosts t0..t{M-1}, gloo) to N = M workers; the M = 1
  row is the N = 1 row (one rank, nothing to shard). Once per `senders` mode: rank 0
  gathering and sending everything (`"rank0"`), or every rank sending its own shards
  (`"owners"`, a row beside it, with its ratio to the gathered row).

Every scenario's row holds each timed round, the median, the link-limited ideal
(the model's bytes over one link's rate: every worker must receive the whole model
through its own link, so no topology can beat it), today's star bound (N copies
through the trainer's link), the cores each process kept busy, and whether the row
was bound by this machine's CPU rather than by its links.

Teardown happens on every exit path: the processes are stopped and the cluster
removed in one `finally`, with Ctrl-C and SIGTERM deferred until it is done.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from ..._worker.server import API_KEY_ENV
from .._model import MODEL_ENV, LlamaShape
from .._procs import Child, _popen, spawn_bench_worker, worker_url
from .._util import Rounds
from .hosts import Cluster, Host, check_support, stale_namespaces
from .signals import deferred_signals

__all__ = [
    "ClusterSettings",
    "derive",
    "format_rate",
    "package_root",
    "run_cluster",
]

MiB = 1 << 20
WORKER_PORT = 8000
"""Every worker listens on this port of its own host (each host is its own namespace)."""
GLOO_PORT = 29500
"""The trainer ranks' rendezvous, on rank 0's host."""
LINK_BOUND_WITHIN = 1.2
"""A row within this factor of its star bound is held by its links (a 1500-byte MTU's
headers alone cost 4.6%)."""
SCENARIO_SLACK_S = 300.0
"""Seconds a scenario may take beyond 10x its star bound before it counts as hung."""

Log = Callable[[str], None]


def format_rate(rate_bps: int | None) -> str:
    """`250 Mbit/s`, `1 Gbit/s`, `uncapped`."""
    if rate_bps is None:
        return "uncapped"
    for unit, scale in (("Gbit/s", 10**9), ("Mbit/s", 10**6), ("kbit/s", 10**3)):
        if rate_bps >= scale:
            return f"{rate_bps / scale:g} {unit}"
    return f"{rate_bps} bit/s"


def package_root() -> str:
    """The folder holding this `asyncwt` package: children import the same code."""
    import asyncwt

    return str(Path(asyncwt.__file__).resolve().parent.parent)


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSettings:
    """Everything one cluster run needs; `cluster.cli` builds it from the command line."""

    preset: str = "default"
    model_mib: float = 32
    """Target model size (bf16)."""
    bucket_bytes: int = 4 * MiB
    num_buffers: int = 2
    workers: tuple[int, ...] = (1, 2, 4, 8)
    """Worker counts N of the one-trainer scenarios."""
    topologies: tuple[str, ...] = ("star",)
    """The tcp topologies of the one-trainer scenarios (`"star"`, `"chain"`), each
    measured at every N."""
    ranks: tuple[int, ...] = (1, 2, 4)
    """Trainer rank counts M of the FSDP2 scenarios (each to N = M workers)."""
    senders: tuple[str, ...] = ("rank0",)
    """Who sends in the FSDP2 scenarios: `"rank0"` (gathered), `"owners"`, or both."""
    rates_bps: tuple[int | None, ...] = (250 * 10**6, 10**9, 10 * 10**9, None)
    """Link rates, bits per second; None is uncapped."""
    rounds: Rounds = field(default_factory=Rounds)
    out: Path = Path("bench-out/cluster")
    torch_threads: int = 1
    cpu_bound_cores: float = 0.85 * (os.cpu_count() or 1)
    """A row whose processes kept at least this many cores busy in all is bound by
    the machine's CPU, not by its links."""
    cpu_bound_process: float = 0.95
    """...as is one whose busiest process kept this much of one core busy."""
    seed: int = 0

    def as_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["rounds"] = asdict(self.rounds)
        data["out"] = str(self.out)
        return data

    @property
    def host_numbers(self) -> dict[str, int]:
        """Host name → host number in the subnet: trainers from .1, workers from .101."""
        trainers = max((m for m in self.ranks), default=1)
        workers = max([*self.workers, *(m for m in self.ranks if m > 1)], default=1)
        numbers = {f"t{i}": 1 + i for i in range(max(trainers, 1))}
        numbers.update({f"w{i}": 101 + i for i in range(workers)})
        return numbers


def run_cluster(
    settings: ClusterSettings,
    log: Log = print,
    *,
    check: Callable[[], None] = check_support,
) -> dict[str, Any]:
    """Run every scenario; the report (see `cluster.report` for table and chart).

    Raises `ClusterUnsupportedError` (from `check`) before creating anything when the
    machine cannot emulate hosts.
    """
    check()
    stale = stale_namespaces()
    if stale:
        log(
            f"note: namespaces left by a cluster bench that was killed: {stale} "
            f"(remove them with `ip netns del NAME`); they do not affect this run"
        )
    started = time.perf_counter()
    log_dir = settings.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    shape = LlamaShape.for_mib(settings.model_mib)
    nbytes = shape.nbytes
    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [package_root(), os.environ.get("PYTHONPATH")])),
        MODEL_ENV: shape.to_json(),
        # Workers listen beyond loopback here, so they require an API key: one per run,
        # read by `asyncwt worker` and by each trainer rank's HttpClient.
        API_KEY_ENV: secrets.token_hex(16),
    }
    if settings.torch_threads:
        env["OMP_NUM_THREADS"] = str(settings.torch_threads)
    report: dict[str, Any] = {
        "meta": {
            "settings": settings.as_dict(),
            "model": {**asdict(shape), "bytes": nbytes, "tensors": shape.num_tensors},
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "started_unix": time.time(),
            "loadavg_at_start": os.getloadavg(),
        },
        "rows": [],
    }
    cluster = Cluster(settings.host_numbers)
    report["meta"]["tag"] = cluster.tag
    report["meta"]["hosts"] = {h.name: h.address for h in cluster.hosts.values()}
    stack = contextlib.ExitStack()
    try:
        stack.callback(_down, cluster, report, log)  # registered first: runs last
        log(
            f"cluster {cluster.tag}: {len(cluster.hosts)} hosts "
            f"({', '.join(h.name + '=' + h.address for h in cluster.hosts.values())}), "
            f"bridge in namespace {cluster.bridge_netns}"
        )
        cluster.up()
        log(
            f"model: synthetic Llama {shape.layers} layers, hidden {shape.hidden}, "
            f"{nbytes / MiB:.1f} MiB bf16; starting the workers"
        )
        workers = [h for name, h in cluster.hosts.items() if name.startswith("w")]
        pids, urls = _start_workers(stack, workers, env, log_dir)
        for rate in settings.rates_bps:
            cluster.set_rate(rate)
            log(
                "links uncapped"
                if rate is None
                else f"links capped at {format_rate(rate)} both ways"
            )
            rows = _workers_scenarios(settings, cluster, rate, urls, pids, env, log_dir, log)
            report["rows"] += rows
            for m in settings.ranks:
                if m == 1:
                    one = next((r for r in rows if r["workers"] == 1), None)
                    if one is not None:
                        report["rows"].append({**one, "kind": "ranks", "same_as": "workers N=1"})
                    continue
                for senders in settings.senders:
                    report["rows"].append(
                        _ranks_scenario(
                            settings, cluster, rate, m, urls, pids, env, log_dir, log, senders
                        )
                    )
    finally:
        with deferred_signals():
            stack.close()
    for row in report["rows"]:
        derive(row, nbytes, settings.cpu_bound_cores, settings.cpu_bound_process)
    report["meta"]["runtime_s"] = time.perf_counter() - started
    report["meta"]["loadavg_at_end"] = os.getloadavg()
    return report


def _down(cluster: Cluster, report: dict[str, Any], log: Log) -> None:
    left = cluster.down()
    left += [n for n in cluster.leftovers() if n not in left]
    report["meta"]["cleanup"] = {"left_behind": left}
    if left:
        log(f"WARNING: could not remove {left}; remove them with `ip netns del NAME`")
    else:
        log(f"cluster {cluster.tag}: every namespace, link and queue removed")


def _start_workers(
    stack: contextlib.ExitStack, hosts: Sequence[Host], env: dict[str, str], log_dir: Path
) -> tuple[list[int], list[str]]:
    """Start `asyncwt worker` in every worker host (all at once), wait until each listens."""
    children: list[Child] = []
    for host in hosts:
        child = spawn_bench_worker(
            f"worker-{host.name}",
            log_dir,
            "--backend",
            "tcp",
            host=host.address,
            port=WORKER_PORT,
            prefix=host.exec_prefix(env),
        )
        stack.callback(child.stop)
        children.append(child)
    urls = [worker_url(child) for child in children]
    return [c.pid for c in children], urls


def _rank_args(
    settings: ClusterSettings,
    cluster: Cluster,
    *,
    rank: int,
    world_size: int,
    jobs: list[dict[str, Any]],
    result_path: Path,
) -> dict[str, Any]:
    t0 = cluster.hosts["t0"]
    return {
        "rank": rank,
        "world_size": world_size,
        "master": t0.address,
        "master_port": GLOO_PORT,
        "trainer_host": cluster.hosts[f"t{rank}"].address,
        "shape": LlamaShape.for_mib(settings.model_mib).to_json(),
        "seed": settings.seed,
        "bucket_bytes": settings.bucket_bytes,
        "num_buffers": settings.num_buffers,
        "torch_threads": settings.torch_threads,
        "warmup": settings.rounds.warmup,
        "rounds": settings.rounds.rounds,
        "jobs": jobs,
        "result_path": str(result_path),
    }


def _run_ranks(
    settings: ClusterSettings,
    cluster: Cluster,
    *,
    world_size: int,
    jobs: list[dict[str, Any]],
    env: dict[str, str],
    log_dir: Path,
    worker_pids: Sequence[int],
    deadline_s: float,
    label: str,
) -> list[dict[str, Any]]:
    """Run `jobs` on `world_size` fresh trainer ranks; rank 0's job records."""
    result = log_dir / f"{label}.json"
    result.unlink(missing_ok=True)
    with contextlib.ExitStack() as stack:
        ranks = []
        for rank in range(world_size):
            host = cluster.hosts[f"t{rank}"]
            args = _rank_args(
                settings, cluster, rank=rank, world_size=world_size, jobs=jobs, result_path=result
            )
            rank_env = {**env, "GLOO_SOCKET_IFNAME": host.ifname}
            cmd = host.exec_prefix(rank_env) + [
                sys.executable, "-m", "asyncwt._bench.cluster.rank", json.dumps(args),
            ]  # fmt: skip
            child = _popen(cmd, f"{label}-rank{rank}", log_dir, None, None)
            stack.callback(child.stop)
            ranks.append(child)
        deadline = time.monotonic() + deadline_s
        while any(r.proc.poll() is None for r in ranks):
            for r in ranks:
                if r.proc.poll() not in (None, 0):
                    raise r.failure("a trainer rank failed")
            for pid in worker_pids:
                if not os.path.exists(f"/proc/{pid}"):
                    raise RuntimeError(f"worker process {pid} exited during {label}")
            if time.monotonic() > deadline:
                raise ranks[0].failure(f"{label} did not finish within {deadline_s:.0f}s")
            time.sleep(0.05)
        for r in ranks:
            if r.proc.returncode != 0:
                raise r.failure("a trainer rank failed")
        if not result.exists():
            raise ranks[0].failure("rank 0 wrote no result")
    records: list[dict[str, Any]] = json.loads(result.read_text())["jobs"]
    return records


def _deadline(settings: ClusterSettings, rate: int | None, copies: int) -> float:
    nbytes = LlamaShape.for_mib(settings.model_mib).nbytes
    per_copy = 0.0 if rate is None else nbytes * 8 / rate
    return SCENARIO_SLACK_S + 10 * settings.rounds.total * copies * per_copy


def _workers_scenarios(
    settings: ClusterSettings,
    cluster: Cluster,
    rate: int | None,
    urls: list[str],
    pids: list[int],
    env: dict[str, str],
    log_dir: Path,
    log: Log,
) -> list[dict[str, Any]]:
    if not settings.workers:
        return []
    rate_label = format_rate(rate).replace(" ", "").replace("/", "")
    rows = []
    for topology in settings.topologies:
        tail = "" if topology == "star" else f"-{topology}"
        jobs = [
            {"label": f"N{n}-{rate_label}{tail}", "urls": urls[:n], "worker_pids": pids[:n],
             "topology": topology}
            for n in settings.workers
        ]  # fmt: skip
        log(f"  one trainer to N = {', '.join(map(str, settings.workers))} workers ({topology})")
        records = _run_ranks(
            settings, cluster, world_size=1, jobs=jobs, env=env, log_dir=log_dir,
            worker_pids=pids, deadline_s=_deadline(settings, rate, sum(settings.workers)),
            label=f"workers-{rate_label}{tail}",
        )  # fmt: skip
        for n, record in zip(settings.workers, records):
            row = _row("workers", rate, n, 1, record, settings)
            row["topology"] = topology
            log(f"    N = {n}: {row['median_s']:.3f} s per round")
            rows.append(row)
    return rows


def _ranks_scenario(
    settings: ClusterSettings,
    cluster: Cluster,
    rate: int | None,
    m: int,
    urls: list[str],
    pids: list[int],
    env: dict[str, str],
    log_dir: Path,
    log: Log,
    senders: str = "rank0",
) -> dict[str, Any]:
    rate_label = format_rate(rate).replace(" ", "").replace("/", "")
    label = f"M{m}-{rate_label}" if senders == "rank0" else f"M{m}-{senders}-{rate_label}"
    log(f"  {m} FSDP2 trainer ranks to N = {m} workers, senders={senders}")
    job = {"label": label, "urls": urls[:m], "worker_pids": pids[:m], "senders": senders}
    (record,) = _run_ranks(
        settings, cluster, world_size=m,
        jobs=[job],
        env=env, log_dir=log_dir, worker_pids=pids,
        deadline_s=_deadline(settings, rate, 2 * m), label=f"ranks-{label}",
    )  # fmt: skip
    row = _row("ranks", rate, m, m, record, settings)
    row["senders"] = senders
    log(f"    M = {m}, senders={senders}: {row['median_s']:.3f} s per round")
    return row


def _row(
    kind: str, rate: int | None, n: int, m: int, record: dict[str, Any], settings: ClusterSettings
) -> dict[str, Any]:
    timed = [r for r in record["rounds"] if not r["warmup"]]
    times = [r["wall_s"] for r in timed]
    return {
        "kind": kind,
        "rate_bps": rate,
        "rate": format_rate(rate),
        "workers": n,
        "ranks": m,
        "rounds_s": times,
        "warmup_s": [r["wall_s"] for r in record["rounds"] if r["warmup"]],
        "median_s": statistics.median(times),
        "bytes_per_round": timed[0]["bytes"] if timed else 0,
        "trainer_link_bytes": statistics.median(
            [r["link_bytes"] for r in timed if r.get("link_bytes") is not None] or [0]
        ),
        "topology": "star",
        "cores_busy": record["cores_busy"],
        "machine_cores": record.get("machine_cores"),
        "bit_exact": record["bit_exact"],
        "loadavg": os.getloadavg(),
    }


def derive(
    row: dict[str, Any], nbytes: int, cpu_bound_cores: float, cpu_bound_process: float
) -> None:
    """Add the ideal, the star bound, their ratios, the CPU sums and what bound the row:
    `link` (within `LINK_BOUND_WITHIN` of its star bound), `CPU` (uncapped: the
    emulated wire is the kernel copying on this machine's cores; or the run's
    processes, one of them, or the whole machine busy while the links were not
    full), or `other` (neither: latency, protocol, collectives)."""
    rate = row["rate_bps"]
    ideal = None if rate is None else nbytes * 8 / rate
    row["model_bytes"] = nbytes
    row["ideal_s"] = ideal
    # Owner senders: each rank's link carries 1/M of the model to each of M workers,
    # one model's bytes in all, so the busiest link's bound is the ideal itself.
    copies = (
        1 if row.get("senders") == "owners" or row.get("topology") == "chain" else row["workers"]
    )
    row["star_bound_s"] = None if ideal is None else ideal * copies
    row["ratio_to_ideal"] = None if ideal is None else row["median_s"] / ideal
    row["ratio_to_star"] = None if ideal is None else row["median_s"] / (ideal * copies)
    # A chain's bound is one copy through a link (the trainer's), whatever N is.
    chain = row.get("topology") == "chain"
    bound_name, bound_ratio = (
        ("ideal", row["ratio_to_ideal"]) if chain else ("star bound", row["ratio_to_star"])
    )
    row["gbit_per_worker"] = nbytes * 8 / row["median_s"] / 1e9
    cores = row["cores_busy"]
    row["cores_sum"] = sum(cores.values())
    busiest = max(cores.items(), key=lambda kv: kv[1], default=("", 0.0))
    row["busiest"] = {"process": busiest[0], "cores": busiest[1]}
    machine = row.get("machine_cores")
    reasons = []
    if rate is None:
        reasons.append("no link cap: the wire is the kernel copying on this machine's cores")
    if row["cores_sum"] >= cpu_bound_cores:
        reasons.append(f"its processes kept {row['cores_sum']:.2f} cores busy")
    if busiest[1] >= cpu_bound_process:
        reasons.append(f"{busiest[0]} kept {busiest[1]:.2f} of a core busy")
    if machine is not None and machine >= cpu_bound_cores:
        reasons.append(f"the machine's cores were {machine:.2f} busy (other users included)")
    at_links = bound_ratio is not None and bound_ratio <= LINK_BOUND_WITHIN
    if at_links:
        row["bound"], why = "link", f"{bound_ratio:.2f}x its {bound_name}"
    elif reasons:
        row["bound"], why = "CPU", "; ".join(reasons)
    else:
        machine_text = "-" if machine is None else f"{machine:.2f}"
        row["bound"] = "other"
        why = (
            f"{bound_ratio or 0:.2f}x its {bound_name} with cores to spare (the run's "
            f"{row['cores_sum']:.2f}, the machine's {machine_text})"
        )
    row["bound_why"] = why
    row["cpu_bound"] = row["bound"] == "CPU"
