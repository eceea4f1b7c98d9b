"""Owner trainer ranks pushing to sliced receivers (spawned; see `_dist.run_ranks`).

Every rank holds `_slice_models.full`'s parameters FSDP-like (`Shard(0)` over the
ranks) and sends its own shards with `senders="owners"` to the tensor-parallel
workers whose URLs `ASYNCWT_TEST_WORKERS` lists (`_slice_models.rank(i, 2)`, started
by the test), each declaring its boxes (`fanout=Star(slices=True)`). Rank 0 drives
the control plane and records, after each round, each worker's version and
checksum next to the checksum of the shards it should hold; every rank records
the bytes it sent each round and, per worker it reached, the bytes of its pairs.
"""

from __future__ import annotations

import os
import pickle
import traceback
from pathlib import Path
from typing import Any

import _dist
import _slice_models as sm
import torch
from _owners_ranks import _NoClient

ROUNDS = 2


def _sharded(world: int) -> torch.nn.Module:
    """`sm.full(1)`, every parameter a `Shard(0)` DTensor over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = sm.full(seed=1)
    for name, param in list(model.named_parameters()):
        module_name, leaf = name.split(".")
        sharded = distribute_tensor(param.data, mesh, [Shard(0)])
        getattr(model, module_name).register_parameter(
            leaf, torch.nn.Parameter(sharded, requires_grad=False)
        )
    return model


def _gathered(model: torch.nn.Module) -> torch.nn.Module:
    """The full model `model`'s shards make (a collective on every rank)."""
    from asyncwt._core.source import materialize_full_tensor

    out = sm.full(seed=0)
    for name, param in model.named_parameters():
        out.get_parameter(name).data.copy_(materialize_full_tensor(param.detach()))
    return out


def sliced_owners(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Rank entry point (see the module docstring)."""
    import anyio
    import torch.distributed as dist

    from asyncwt import HttpClient, ModuleSource, Star, TcpTrainerInitInfo, trainer_init
    from asyncwt._core.checksum import model_checksum

    _dist._init(rank, world_size, port)
    urls = os.environ["ASYNCWT_TEST_WORKERS"].split(",")
    record: dict[str, Any] = {"rounds": []}

    async def main() -> None:
        model = _sharded(world_size)
        client: Any = HttpClient(urls, timeout=30) if rank == 0 else _NoClient()
        info = TcpTrainerInitInfo(
            rank=rank, bucket_bytes=4096, senders="owners", fanout=Star(slices=True)
        )
        try:
            await run(client, info, model)
        finally:
            if rank == 0:
                await client.close()

    async def run(client: Any, info: TcpTrainerInitInfo, model: torch.nn.Module) -> None:
        engine = await trainer_init(info, client=client, source=ModuleSource(model))
        async with engine:
            pairs = engine.round_plan.pairs
            assert pairs is not None
            names = [m.name for m in engine.round_plan.plan.params]
            # Per worker this rank reached (named by its embedding's box), the bytes
            # of its pair: what this rank's share holds of the worker's boxes.
            record["pairs"] = {}
            for i, layout in enumerate(pairs.layouts):
                embed = dict(zip(names, layout.boxes))["embed.weight"]
                pair = pairs.pair(rank, i)
                key = str((embed.start, embed.size))
                record["pairs"][key] = pair.total_bytes if pair is not None else 0
            for r in range(1, ROUNDS + 1):
                with torch.no_grad():
                    for param in model.parameters():
                        param.mul_(-1.5).add_(r)
                stats = await engine.send_weights(weight_version=f"v{r}")
                full = _gathered(model)
                row: dict[str, Any] = {"wire_bytes": stats.wire_bytes}
                if rank == 0:
                    statuses = await client.weights_status(checksum=True)
                    row["workers"] = [(s["weight_version"], s["checksum"]) for s in statuses]
                    row["expected"] = [model_checksum(sm.shard_of(full, i, 2)) for i in (0, 1)]
                record["rounds"].append(row)

    try:
        anyio.run(main)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
        record["error"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
