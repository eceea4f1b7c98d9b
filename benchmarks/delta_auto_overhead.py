#!/usr/bin/env python
"""What `delta=True` (the default policy) costs on one host: alternating rounds, paired.

    python benchmarks/delta_auto_overhead.py              # the 55 M-param model, 30 rounds
    python benchmarks/delta_auto_overhead.py --quick      # the small one, 60 rounds

Three trainers push the same bf16 weights, round after round, to three `asyncwt worker`
processes over `--backend` (tcp or shm): `delta=False` (full), `delta=True` (auto) and
a second `delta=False` (twin). Each round every trainer sends once, the order rotating,
so the three meet the same seconds of the machine. Reported: the median per-round ratio
auto / full, and twin / full beside it (the same work twice: the noise). The weights do
not change between rounds, which does not matter to auto on one host: there it keeps no
copy and codes nothing (it says so: `host_bytes` at the end).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import anyio
import torch

from asyncwt import HttpClient, ModuleSource, trainer_init
from asyncwt._bench._model import MODEL_ENV, SyntheticLlama, fill_random
from asyncwt._worker.launch import start_worker, stop_worker

sys.path.insert(0, str(Path(__file__).resolve().parent))
from delta_trajectory import WORKER_MODEL, shape_for, trainer_info

KINDS = ("full", "auto", "twin")


async def run(args: argparse.Namespace, urls: dict[str, str], model: torch.nn.Module) -> None:
    engines = {}
    clients = {kind: HttpClient(urls[kind]) for kind in KINDS}
    try:
        for kind in KINDS:
            info = trainer_info(kind, args.bucket_mib << 20, "127.0.0.1", args.backend)
            engines[kind] = await trainer_init(
                info, client=clients[kind], source=ModuleSource(model)
            )
        seconds: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for index in range(args.rounds + args.warmup):
            for kind in KINDS[index % 3 :] + KINDS[: index % 3]:
                stats = await engines[kind].send_weights()
                if index >= args.warmup:
                    seconds[kind].append(stats.wall_s)
        ratio = {
            kind: statistics.median(a / f for a, f in zip(seconds[kind], seconds["full"]))
            for kind in ("auto", "twin")
        }
        full_ms = 1e3 * statistics.median(seconds["full"])
        copy = engines["auto"].transport.state.host_bytes  # type: ignore[attr-defined]
        print(
            f"{args.backend}, {args.rounds} rounds of {full_ms:.1f} ms (full, median): "
            f"auto / full {ratio['auto']:.3f}x, twin / full {ratio['twin']:.3f}x (the noise); "
            f"auto's host copy at the end: {copy} bytes"
        )
    finally:
        for engine in engines.values():
            await engine.shutdown()
        for client in clients.values():
            await client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small model, 60 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (30; 60 quick)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--backend", choices=("tcp", "shm"), default="tcp")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 60 if args.quick else 30
    torch.set_num_threads(1)
    shape = shape_for(args.quick)
    model = SyntheticLlama(shape)
    fill_random(model, 0)
    env = dict(os.environ, **{MODEL_ENV: shape.to_json(), "OMP_NUM_THREADS": "1"})
    workers = {
        kind: start_worker(WORKER_MODEL, "--backend", args.backend, env=env) for kind in KINDS
    }
    try:
        anyio.run(run, args, {kind: url for kind, (_, url) in workers.items()}, model)
    finally:
        for proc, _ in workers.values():
            stop_worker(proc)


if __name__ == "__main__":
    main()
