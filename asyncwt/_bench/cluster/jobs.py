"""Running a cluster scenario: start the workers, run trainer ranks, make the row.

`start_workers` starts `asyncwt worker` in worker hosts; `run_ranks` starts fresh
trainer rank processes (`cluster.rank`) in the trainer hosts, runs their jobs and
returns rank 0's records, failing fast when a rank or a worker dies or the scenario
outlives its deadline; `scenario_row` turns a record into a report row.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .._model import LlamaShape
from .._procs import BENCH_MODEL, Child, _popen, spawn_bench_worker, worker_url
from .hosts import Cluster, Host
from .settings import GLOO_PORT, WORKER_PORT, ClusterSettings, format_rate

__all__ = ["deadline", "run_ranks", "scenario_row", "start_workers"]

SCENARIO_SLACK_S = 300.0
"""Seconds a scenario may take beyond 10x its star bound before it counts as hung."""


def start_workers(
    stack: contextlib.ExitStack,
    hosts: Sequence[Host],
    env: dict[str, str],
    log_dir: Path,
    *,
    model: str = BENCH_MODEL,
    port: int = WORKER_PORT,
    args: Callable[[int], Sequence[str]] = lambda _: (),
    role: str = "worker",
) -> tuple[list[int], list[str]]:
    """Start `asyncwt worker` (serving `model`'s factory, with `args(i)` added for the
    i-th host) in every worker host, all at once; their pids and URLs once each listens.
    `stack` stops them."""
    children: list[Child] = []
    for index, host in enumerate(hosts):
        child = spawn_bench_worker(
            f"{role}-{host.name}",
            log_dir,
            "--backend",
            "tcp",
            *args(index),
            host=host.address,
            port=port,
            prefix=host.exec_prefix(env),
            model=model,
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


def run_ranks(
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


def deadline(settings: ClusterSettings, rate: int | None, copies: float) -> float:
    """Seconds a scenario sending `copies` models through its busiest link may take."""
    nbytes = LlamaShape.for_mib(settings.model_mib).nbytes
    per_copy = 0.0 if rate is None else nbytes * 8 / rate
    return SCENARIO_SLACK_S + 10 * settings.rounds.total * copies * per_copy


def scenario_row(
    kind: str, rate: int | None, n: int, m: int, record: dict[str, Any], settings: ClusterSettings
) -> dict[str, Any]:
    """A scenario's row from rank 0's record: every round's time, the median, bytes,
    cores, bit-exactness."""
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
