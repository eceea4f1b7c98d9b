"""The cluster bench's M:N rows: M trainer ranks to the ranks of tensor-parallel engines.

For each layout (`cluster.layouts`: `tp2`, `tp4`, `2xtp2`) its receivers start as
`asyncwt worker --ranks N --rank r`, one per worker host, each holding its slices of
the synthetic Llama. Then for each M (1: rank 0 sends everything; more: FSDP2 owner
senders, every rank its own rows, no gather) two rows:

- `sliced`: `fanout=Star(slices=True)`, each rank receives exactly its boxes;
- `whole`: today's receivers, as many hosts, each taking the whole model (the run's
  whole workers); run once per (receivers, M) and shared by the layouts alike.

Each row carries its ideal (max(bytes through the busiest trainer link, bytes through
the busiest receiver link) / rate, counted from the boxes by `link_payloads`) and the
bytes every host's link carried per round, read from its interface's counters.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._model import LlamaShape
from .hosts import Cluster
from .jobs import deadline, run_ranks, scenario_row, start_workers
from .layouts import Layout, Shard, link_payloads
from .settings import WORKER_PORT, ClusterSettings, Log, rate_label

__all__ = ["TP_MODEL", "layout_rows"]

TP_MODEL = "asyncwt._bench._tp_model:tp_worker_model"
"""The factory a sliced receiver serves (`--ranks N --rank r`)."""
SLICED_PORT = WORKER_PORT + 1
"""Sliced receivers listen here, beside the run's whole workers on `WORKER_PORT`."""


def layout_rows(
    settings: ClusterSettings,
    cluster: Cluster,
    rate: int | None,
    urls: list[str],
    pids: list[int],
    env: dict[str, str],
    log_dir: Path,
    log: Log,
) -> list[dict[str, Any]]:
    """Every layout's sliced rows and the whole rows beside them, at `rate`; `urls` and
    `pids` are the run's whole workers, one per worker host."""
    rows: list[dict[str, Any]] = []
    whole: dict[tuple[int, int], dict[str, Any]] = {}
    hosts = [host for name, host in cluster.hosts.items() if name.startswith("w")]
    for name in settings.layouts:
        layout = Layout.parse(name)
        shards = layout.shards
        n = layout.receivers
        with contextlib.ExitStack() as stack:
            log(f"  layout {layout.name}: starting {n} sliced worker ranks")
            sliced_pids, sliced_urls = start_workers(
                stack,
                hosts[:n],
                env,
                log_dir,
                model=TP_MODEL,
                port=SLICED_PORT,
                args=functools.partial(_worker_args, shards),
                role=f"{layout.name}-rank",
            )
            for m in settings.layout_ranks:
                scenario = functools.partial(_row, settings, cluster, rate, m, env, log_dir, log)
                rows.append(scenario(layout.name, shards, sliced_urls, sliced_pids))
                if (n, m) not in whole:
                    whole[n, m] = scenario("whole", [None] * n, urls[:n], pids[:n])
                    rows.append(whole[n, m])
    return rows


def _worker_args(shards: Sequence[Shard], index: int) -> tuple[str, ...]:
    """The worker arguments of receiver `index`: its place in its engine."""
    rank, world_size = shards[index]
    return ("--ranks", str(world_size), "--rank", str(rank))


def _row(
    settings: ClusterSettings,
    cluster: Cluster,
    rate: int | None,
    m: int,
    env: dict[str, str],
    log_dir: Path,
    log: Log,
    layout: str,
    shards: Sequence[Shard | None],
    urls: list[str],
    pids: list[int],
) -> dict[str, Any]:
    shape = LlamaShape.for_mib(settings.model_mib)
    sliced = layout != "whole"
    senders = "rank0" if m == 1 else "owners"
    label = f"M{m}-{layout}{len(shards) if not sliced else ''}-{rate_label(rate)}"
    sent, received = link_payloads(shape, shards, m)
    busiest = max(*sent, *received)
    job = {
        "label": label, "urls": urls, "worker_pids": pids, "senders": senders,
        "slices": sliced, "shards": list(shards),
    }  # fmt: skip
    (record,) = run_ranks(
        settings, cluster, world_size=m, jobs=[job], env=env, log_dir=log_dir,
        worker_pids=pids, deadline_s=deadline(settings, rate, 2 * busiest / shape.nbytes),
        label=f"mn-{label}",
    )  # fmt: skip
    row = scenario_row("layouts", rate, len(shards), m, record, settings)
    row.update(
        layout=layout,
        senders=senders,
        sliced=sliced,
        ideal_bytes=busiest,
        plan_sent=sent,
        plan_received=received,
        link_bytes=record["host_bytes"],
    )
    log(
        f"    M = {m} to {layout if sliced else f'{len(shards)} whole receivers'}: "
        f"{row['median_s']:.3f} s per round"
    )
    return row
