"""`python -m asyncwt._bench.cluster.rank JSON_ARGS`: one trainer rank on an emulated host.

Started by the cluster bench inside a trainer host's namespace. Every rank builds the
synthetic model (the same values on every rank); with several ranks they join a gloo
group across the trainer hosts and shard it with FSDP2 (`fully_shard`, one unit per
decoder layer), so every round's `full_tensor()` all-gathers cross the capped links.
Then, for each job (a set of workers), every rank runs `trainer_init` and the rounds
through the public API; rank 0 talks to the workers. With a job's `senders` of
`"rank0"` (the default) only rank 0 sends, after gathering every parameter; with
`"owners"` every rank sends its own shards over its own link, no gather.

Each round sends different weights: before every round but the first, every rank
negates its (local shard of the) weights, an exact involution on bf16. After each
round rank 0 asks every worker for `/weights_status` and checks the version and the
checksum against the expected one of that parity (`model_checksum`, computed before
sharding). Rank 0 writes every round's time, bytes and cores busy to `result_path`.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from typing import Any

__all__ = ["main", "run_rank"]

GLOO_TIMEOUT_S = 600.0


def run_rank(
    *,
    rank: int,
    world_size: int,
    master: str,
    master_port: int,
    trainer_host: str,
    shape: str,
    seed: int,
    bucket_bytes: int,
    num_buffers: int,
    torch_threads: int,
    warmup: int,
    rounds: int,
    jobs: list[dict[str, Any]],
    result_path: str,
) -> None:
    """Build the model, run every job (`{"label", "urls", "worker_pids"}`, optionally
    `"senders"`), write results."""
    import torch
    import torch.distributed as dist

    from ..._core.checksum import model_checksum
    from .._model import LlamaShape, SyntheticLlama, fill_random
    from .._util import run_async

    if torch_threads:
        torch.set_num_threads(torch_threads)
    model = SyntheticLlama(LlamaShape.from_json(shape))
    fill_random(model, seed)
    expected = _expected_checksums(model, jobs) if rank == 0 else {}
    distributed = world_size > 1
    rank_pids = {0: os.getpid()}
    if distributed:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}:{master_port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=GLOO_TIMEOUT_S),
        )
    try:
        if distributed:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world_size,))
            for layer in model.get_submodule("model.layers").children():
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            # A tensor gather, not all_gather_object: that one needs numpy, not a dependency.
            pids = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
            dist.all_gather(pids, torch.tensor([os.getpid()], dtype=torch.int64))
            rank_pids = {r: int(pid.item()) for r, pid in enumerate(pids)}
            sharded = model_checksum(model)  # a collective: every rank takes part
            if rank == 0 and sharded != expected[None][0]:
                raise RuntimeError("the sharded model's checksum differs from the unsharded one")
        results = []
        flipped = False
        for job in jobs:
            record, flipped = run_async(
                functools.partial(
                    _run_job, job, model=model, rank=rank, trainer_host=trainer_host,
                    rank_pids=rank_pids, bucket_bytes=bucket_bytes, num_buffers=num_buffers,
                    warmup=warmup, rounds=rounds, expected=expected, flipped=flipped,
                )
            )  # fmt: skip
            results.append(record)
        if rank == 0:
            tmp = result_path + ".tmp"
            with open(tmp, "w") as out:
                json.dump({"trainer_checksum": expected[None][0], "jobs": results}, out)
            os.replace(tmp, result_path)
    finally:
        if distributed:
            dist.destroy_process_group()


def _expected_checksums(model: Any, jobs: list[dict[str, Any]]) -> dict[Any, list[str]]:
    """What each receiver should hold after a round, by its shard (None: the whole
    model): `[checksum as built, checksum negated]`."""
    from ..._core.checksum import model_checksum
    from .._tp_model import tp_shard

    shards = {None, *(tuple(s) for job in jobs for s in job.get("shards", []) if s)}
    expected: dict[Any, list[str]] = {shard: [] for shard in shards}
    for _ in range(2):
        for shard in shards:
            held = model if shard is None else tp_shard(model, *shard)
            expected[shard].append(model_checksum(held))
        _negate(model)
    return expected


def _negate(model: Any) -> None:
    """Negate every weight in place (the local shard of a DTensor): exact on bf16."""
    import torch
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for param in model.parameters():
            local = param.to_local() if isinstance(param, DTensor) else param.data
            local.neg_()


async def _run_job(
    job: dict[str, Any],
    *,
    model: Any,
    rank: int,
    trainer_host: str,
    rank_pids: dict[int, int],
    bucket_bytes: int,
    num_buffers: int,
    warmup: int,
    rounds: int,
    expected: dict[Any, list[str]],
    flipped: bool,
) -> tuple[dict[str, Any], bool]:
    """Warm-up + timed rounds to `job["urls"]`; (record, whether the model ends negated)."""
    from ... import HttpClient, Listen, ModuleSource, Star, TcpTrainerInitInfo, trainer_init
    from ..._core.config import FANOUTS
    from ..._worker.server import API_KEY_ENV
    from .._cpu import CpuMeter, machine_cpu_s, median_cores

    label = job["label"]
    pids: dict[str, int | None] = {"trainer rank 0": None}
    pids.update({f"trainer rank {r}": pid for r, pid in rank_pids.items() if r != 0})
    pids.update({f"worker {i}": pid for i, pid in enumerate(job["worker_pids"])})
    meter = CpuMeter(pids)
    shards = [None if s is None else tuple(s) for s in job.get("shards", [None] * len(job["urls"]))]
    hosts = {f"trainer rank {r}": (pid or os.getpid(), "tx") for r, pid in rank_pids.items()}
    hosts.update({f"worker {i}": (pid, "rx") for i, pid in enumerate(job["worker_pids"])})
    records: list[dict[str, Any]] = []
    print(f"rank {rank}: {label}", file=sys.stderr, flush=True)
    api_key = os.environ[API_KEY_ENV]  # set by the run for its workers
    async with HttpClient(job["urls"], timeout=900.0, api_key=api_key) as client:
        try:
            info = TcpTrainerInitInfo(
                rank=rank, listen=Listen(host=trainer_host), bucket_bytes=bucket_bytes,
                num_buffers=num_buffers, senders=job.get("senders", "rank0"),
                fanout=Star(slices=True) if job.get("slices") else FANOUTS[job.get("topology", "star")](),
            )  # fmt: skip
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            try:
                for index in range(warmup + rounds):
                    if index:
                        _negate(model)
                        flipped = not flipped
                    version = f"{label}-{index}"
                    mark = meter.mark()
                    machine_mark = machine_cpu_s()
                    hosts_before = _host_bytes(hosts) if rank == 0 else {}
                    started = time.monotonic()
                    stats = await engine.send_weights(weight_version=version)
                    hosts_after = _host_bytes(hosts) if rank == 0 else {}
                    host_bytes = {
                        h: hosts_after[h] - hosts_before[h]
                        for h in hosts_after
                        if h in hosts_before
                    }
                    wall = stats.wall_s if stats.wall_s > 0 else time.monotonic() - started
                    cores = meter.cores_busy(mark, wall)
                    machine_now = machine_cpu_s()
                    machine = (
                        None
                        if machine_mark is None or machine_now is None
                        else (machine_now - machine_mark) / wall
                    )
                    if rank != 0:
                        continue
                    statuses = await client.weights_status(checksum=True)
                    want = [expected[shard][1 if flipped else 0] for shard in shards]
                    exact = len(statuses) == len(want) and all(
                        s.get("weight_version") == version
                        and s.get("checksum") == w
                        and not s.get("weights_incomplete")
                        for s, w in zip(statuses, want)
                    )
                    if not exact:
                        raise RuntimeError(
                            f"{label} round {index}: a worker's weights differ from the "
                            f"trainer's (expected version {version}, checksums {[w[:16] for w in want]}): "
                            f"{statuses}"
                        )
                    records.append(
                        {"wall_s": wall, "bytes": stats.total_bytes or stats.bytes,
                         "rank0_bytes": stats.bytes, "buckets": stats.buckets,
                         "cores": cores, "machine_cores": machine, "bit_exact": exact, "warmup": index < warmup,
                         "link_bytes": host_bytes.get("trainer rank 0"), "host_bytes": host_bytes}
                    )  # fmt: skip
            finally:
                await engine.shutdown()
        finally:
            if rank == 0:
                await client.shutdown()
    timed = [r for r in records if not r["warmup"]]
    return {
        "label": label,
        "senders": job.get("senders", "rank0"),
        "workers": len(job["urls"]),
        "rounds": records,
        "cores_busy": median_cores([r["cores"] for r in timed]),
        "machine_cores": median_cores(
            [{"machine": r["machine_cores"]} for r in timed if r["machine_cores"] is not None]
        ).get("machine"),
        "bit_exact": bool(timed) and all(r["bit_exact"] for r in timed),
        "host_bytes": _mean_bytes([r["host_bytes"] for r in timed]),
    }, flipped


def _mean_bytes(rounds: list[dict[str, int]]) -> dict[str, float]:
    """Each host's bytes per round, the mean over `rounds` (a lagging rank's bytes
    counted in the next round still count)."""
    names = set().union(*rounds) if rounds else set()
    return {n: sum(r.get(n, 0) for r in rounds) / len(rounds) for n in sorted(names)}


def _host_bytes(hosts: dict[str, tuple[int, str]]) -> dict[str, int]:
    """Bytes each host's link has sent (`"tx"`) or received (`"rx"`), by the counters
    of the network namespace of a process in it (`/proc/PID/net/dev`, loopback left
    out); a host whose process is gone is left out."""
    counts = {}
    for name, (pid, way) in hosts.items():
        try:
            with open(f"/proc/{pid}/net/dev") as dev:
                lines = dev.read().splitlines()[2:]
        except OSError:
            continue
        column = 0 if way == "rx" else 8
        counts[name] = sum(
            int(fields.split()[column])
            for ifname, _, fields in (line.partition(":") for line in lines)
            if ifname.strip() != "lo"
        )
    return counts


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: python -m asyncwt._bench.cluster.rank JSON_ARGS", file=sys.stderr)
        return 2
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch  # noqa: F401
    run_rank(**json.loads(sys.argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
