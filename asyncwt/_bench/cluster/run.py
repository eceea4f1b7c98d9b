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
import os
import platform
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..._worker.server import API_KEY_ENV
from .._model import MODEL_ENV, LlamaShape
from .hosts import Cluster, check_support, stale_namespaces
from .jobs import deadline, run_ranks, scenario_row, start_workers
from .mn import layout_rows
from .settings import ClusterSettings, Log, MiB, format_rate, rate_label
from .signals import deferred_signals

__all__ = [
    "ClusterSettings",
    "derive",
    "format_rate",
    "package_root",
    "run_cluster",
]

LINK_BOUND_WITHIN = 1.2
"""A row within this factor of its star bound is held by its links (a 1500-byte MTU's
headers alone cost 4.6%)."""


def package_root() -> str:
    """The folder holding this `asyncwt` package: children import the same code."""
    import asyncwt

    return str(Path(asyncwt.__file__).resolve().parent.parent)


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
        pids, urls = start_workers(stack, workers, env, log_dir)
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
            report["rows"] += layout_rows(settings, cluster, rate, urls, pids, env, log_dir, log)
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
    rows = []
    for topology in settings.topologies:
        tail = "" if topology == "star" else f"-{topology}"
        jobs = [
            {"label": f"N{n}-{rate_label(rate)}{tail}", "urls": urls[:n], "worker_pids": pids[:n],
             "topology": topology}
            for n in settings.workers
        ]  # fmt: skip
        log(f"  one trainer to N = {', '.join(map(str, settings.workers))} workers ({topology})")
        records = run_ranks(
            settings, cluster, world_size=1, jobs=jobs, env=env, log_dir=log_dir,
            worker_pids=pids, deadline_s=deadline(settings, rate, sum(settings.workers)),
            label=f"workers-{rate_label(rate)}{tail}",
        )  # fmt: skip
        for n, record in zip(settings.workers, records):
            row = scenario_row("workers", rate, n, 1, record, settings)
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
    tail = "" if senders == "rank0" else f"-{senders}"
    label = f"M{m}{tail}-{rate_label(rate)}"
    log(f"  {m} FSDP2 trainer ranks to N = {m} workers, senders={senders}")
    job = {"label": label, "urls": urls[:m], "worker_pids": pids[:m], "senders": senders}
    (record,) = run_ranks(
        settings, cluster, world_size=m,
        jobs=[job],
        env=env, log_dir=log_dir, worker_pids=pids,
        deadline_s=deadline(settings, rate, 2 * m), label=f"ranks-{label}",
    )  # fmt: skip
    row = scenario_row("ranks", rate, m, m, record, settings)
    row["senders"] = senders
    log(f"    M = {m}, senders={senders}: {row['median_s']:.3f} s per round")
    return row


def derive(
    row: dict[str, Any], nbytes: int, cpu_bound_cores: float, cpu_bound_process: float
) -> None:
    """Add the ideal, the star bound, their ratios, the CPU sums and what bound the row:
    `link` (within `LINK_BOUND_WITHIN` of its star bound), `CPU` (uncapped: the
    emulated wire is the kernel copying on this machine's cores; or the run's
    processes, one of them, or the whole machine busy while the links were not
    full), or `other` (neither: latency, protocol, collectives)."""
    rate = row["rate_bps"]
    # An M:N row's ideal is its busiest link's payload (`cluster.layouts`); any other
    # row's, the model through a worker's link.
    ideal = None if rate is None else row.get("ideal_bytes", nbytes) * 8 / rate
    row["model_bytes"] = nbytes
    row["ideal_s"] = ideal
    # Owner senders: each rank's link carries 1/M of the model to each of M workers,
    # one model's bytes in all, so the busiest link's bound is the ideal itself.
    one_copy = (
        row["kind"] == "layouts" or row.get("senders") == "owners" or row.get("topology") == "chain"
    )
    copies = 1 if one_copy else row["workers"]
    row["star_bound_s"] = None if ideal is None else ideal * copies
    row["ratio_to_ideal"] = None if ideal is None else row["median_s"] / ideal
    row["ratio_to_star"] = None if ideal is None else row["median_s"] / (ideal * copies)
    # A chain's bound is one copy through a link (the trainer's), whatever N is.
    chain = row.get("topology") == "chain" or row["kind"] == "layouts"
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
