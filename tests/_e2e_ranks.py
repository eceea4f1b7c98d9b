"""Trainer ranks for the two-rank end-to-end test (spawned; see `_dist.run_ranks`)."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import _dist
import _models
import torch

ROUNDS = 2


def fsdp_push(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Shard `dtensor_mlp` with FSDP2 over both ranks and push it to the worker twice.

    Every rank calls `trainer_init` and `send_weights`; only rank 0 talks to the
    worker. Rank 0 records the worker's status and the trainer's full checksum.
    """
    import anyio
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncwt import (
        HttpClient,
        ModuleSource,
        ShmTrainerInitInfo,
        TcpTrainerInitInfo,
        TorchDistTrainerInitInfo,
        model_checksum,
        trainer_init,
    )

    _dist._init(rank, world_size, port)
    torch.manual_seed(0)
    model = _models.dtensor_mlp()
    mesh = init_device_mesh("cpu", (world_size,))
    for index in (0, 2, 3):
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    url = os.environ["ASYNCWT_TEST_WORKER_URL"]
    record: dict[str, Any] = {"rounds": []}

    async def main() -> None:
        async with HttpClient(url) as client:
            backend = os.environ.get("ASYNCWT_TEST_BACKEND", "tcp")
            if backend == "torch_dist":
                info: Any = TorchDistTrainerInitInfo(rank=rank, bucket_bytes=4 << 10, num_workers=1)
            elif backend == "shm":
                info = ShmTrainerInitInfo(rank=rank, bucket_bytes=4 << 10)
            else:
                info = TcpTrainerInitInfo(rank=rank, bucket_bytes=4 << 10)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                for r in range(1, ROUNDS + 1):
                    with torch.no_grad():
                        for param in model.parameters():
                            param.mul_(-1.5).add_(r)
                    stats = await engine.send_weights(weight_version=f"fsdp-{r}")
                    checksum = model_checksum(model)  # gathers: a collective on both ranks
                    status = (await client.weights_status(checksum=True))[0] if rank == 0 else None
                    record["rounds"].append(
                        {"bytes": stats.bytes, "checksum": checksum, "status": status}
                    )

    try:
        anyio.run(main)
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
