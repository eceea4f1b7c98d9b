"""Two FSDP2 trainer ranks push a sharded model to one worker after every step.

The parent process starts a worker server (`asyncwt worker --model
fsdp_trainer:make_model`), then spawns two trainer ranks with
`torch.multiprocessing` (gloo on 127.0.0.1, CPU only). Each rank shards the same MLP
with FSDP2 (`torch.distributed.fsdp.fully_shard`), trains it on its own data, and
after every optimizer step pushes the weights.

What it shows:

- every rank calls `asyncwt.trainer_init` and `send_weights`, in the same order:
  every rank iterates the model so the `full_tensor()` all-gathers line up, and
  only rank 0 sends bytes and talks to the worker (rank 1 holds a client that is
  never called, and its `RoundStats.bytes` is 0);
- `asyncwt.ModuleSource` reads FSDP2's DTensor parameters: the plan is built from
  global shapes, and each tensor is gathered only when it is sent;
- verification: after each round, every rank computes the checksum of the full
  model (a collective) and rank 0 compares it with the worker's
  (`HttpClient.weights_status(checksum=True)`, the worker's `GET /weights_status`);
- `--senders owners`: no gather at all; every rank sends its own shards
  (`iter_local()`) over its own connection to the worker, and rank 0 still makes
  the control-plane calls (`RoundStats.bytes` is each rank's share,
  `RoundStats.total_bytes` the round's).

Run it: `python examples/fsdp_trainer.py [--steps N] [--senders owners]` (CPU, ~10 seconds).
"""

from __future__ import annotations

import argparse
import os
import socket
from datetime import timedelta
from pathlib import Path

import anyio
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from asyncwt import HttpClient, ModuleSource, TcpTrainerInitInfo, model_checksum, trainer_init
from asyncwt._worker.launch import worker_process  # starts `asyncwt worker` (a private helper)

WORLD_SIZE = 2
HERE = Path(__file__).resolve().parent


def make_model() -> nn.Sequential:
    """The model, built the same way by every trainer rank and by the worker."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
    )


def run_rank(rank: int, url: str, port: int, steps: int, senders: str) -> None:
    """One trainer rank (the entry point of each spawned process)."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),  # a rank that goes missing fails the others
    )
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = make_model()
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        anyio.run(train, rank, model, url, steps, senders)
    finally:
        dist.destroy_process_group()


async def train(rank: int, model: nn.Module, url: str, steps: int, senders: str) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(rank)  # each rank trains on its own data
    async with HttpClient(url) as client:  # only rank 0's is ever called
        info = TcpTrainerInitInfo(rank=rank, bucket_bytes=64 << 10, senders=senders)
        engine = await trainer_init(info, client=client, source=ModuleSource(model))
        async with engine:
            for step in range(1, steps + 1):
                inputs = torch.randn(64, 32, generator=data)
                loss = nn.functional.mse_loss(model(inputs), inputs[:, :1].sin())
                optimizer.zero_grad()
                loss.backward()  # FSDP2 reduce-scatters the gradients across the ranks
                optimizer.step()

                version = f"step-{step}"
                stats = await engine.send_weights(weight_version=version)  # on every rank
                checksum = model_checksum(model)  # gathers every parameter: every rank calls it
                if rank != 0:
                    if (stats.bytes != 0) != (senders == "owners"):
                        raise SystemExit(f"rank {rank} sent {stats.bytes} bytes ({senders=})")
                    continue
                (status,) = await client.weights_status(checksum=True)
                if (status["weight_version"], status["checksum"]) != (version, checksum):
                    raise SystemExit(f"step {step}: the worker's weights differ: {status}")
                pushed = (
                    f"rank 0 pushed {stats.bytes / 2**10:.0f} KiB"
                    if stats.total_bytes is None
                    else f"ranks pushed {stats.total_bytes / 2**10:.0f} KiB, rank 0 "
                    f"{stats.bytes / 2**10:.0f} KiB"
                )
                print(
                    f"step {step}: loss {loss.item():.4f} | {pushed} in {stats.buckets} buckets "
                    f"({stats.wall_s * 1e3:.0f} ms) | worker at {status['weight_version']}, "
                    f"checksum matches the gathered model",
                    flush=True,
                )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main(steps: int, senders: str = "rank0") -> None:
    # The worker imports `fsdp_trainer:make_model`, so it needs this folder on its path.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    with worker_process("fsdp_trainer:make_model", env=env) as url:
        print(f"worker server at {url}; spawning {WORLD_SIZE} FSDP2 trainer ranks", flush=True)
        mp.spawn(run_rank, args=(url, free_port(), steps, senders), nprocs=WORLD_SIZE, join=True)
    print(f"fsdp trainer finished: {steps} rounds from {WORLD_SIZE} ranks arrived bit-exact")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--senders",
        choices=("rank0", "owners"),
        default="rank0",
        help="rank0: rank 0 gathers and sends; owners: every rank sends its own shards",
    )
    args = parser.parse_args()
    main(args.steps, args.senders)
