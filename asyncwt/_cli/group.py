"""`asyncwt worker --ranks N`: a group of worker ranks holding one sharded model.

For users who serve with their own engine, split over N ranks (tensor
parallelism): the parent starts N `asyncwt worker` children, rank `r` calling the
model factory with `rank=r, world_size=N` (its shard, whose `asyncwt_layout`
declares the part of each parameter it holds), each serving on its own port. The
parent prints each rank's URL, then waits: SIGTERM or SIGINT stops every rank
(exit 0); a rank that exits on its own stops the others (exit 1). A trainer
reaches the group with one client over the N URLs, and `fanout=Star(slices=True)`
sends each rank only its slices.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence

from .._worker.launch import WorkerStartError, spawn_worker, stop_worker, wait_for_url

__all__ = ["run_group"]

START_TIMEOUT_S = 120.0


def rank_argv(argv: Sequence[str], rank: int, port: int) -> list[str]:
    """The worker arguments of rank `rank`: the group's, on its own port."""
    return [*argv, "--rank", str(rank), "--port", str(port + rank if port else 0)]


def run_group(model: str, argv: Sequence[str], ranks: int, port: int) -> int:
    """Start `ranks` worker ranks with `argv` (the command's own arguments but
    `--model`), print their URLs, and supervise them (see the module docstring)."""
    stop = threading.Event()
    previous = {
        signum: signal.signal(signum, lambda *_: stop.set())
        for signum in (signal.SIGTERM, signal.SIGINT)
    }
    children = []
    try:
        for rank in range(ranks):
            children.append(spawn_worker(model, *rank_argv(argv, rank, port)))
        for rank, child in enumerate(children):
            try:
                url = wait_for_url(child, START_TIMEOUT_S)
            except WorkerStartError as exc:
                print(f"asyncwt worker: error: rank {rank} of {ranks}: {exc}", file=sys.stderr)
                return 1
            print(f"asyncwt worker rank {rank} of {ranks} listening on {url}", flush=True)
        while not stop.is_set():
            exited = [rank for rank, child in enumerate(children) if child.poll() is not None]
            if exited:
                codes = [children[r].returncode for r in exited]
                print(
                    f"asyncwt worker: error: rank {exited[0]} of {ranks} exited with "
                    f"{codes[0]}; stopping the others",
                    file=sys.stderr,
                )
                return 1
            stop.wait(0.2)
        return 0
    finally:
        for child in children:
            stop_worker(child)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
