"""Trainer ranks for the owner-senders tests (spawned; see `_dist.run_ranks`).

Every scenario builds a sharded model on every rank and two workers in rank 0's
process (driven by a `LocalClient`): one fed with `senders="owners"`, one with the
gathered path (`senders="rank0"`). Each of two rounds changes the weights, sends
them both ways, and rank 0 records whether each worker's parameters equal the
gathered full tensors bit for bit. While the owners engine runs, `iter_full` and
`DTensor.full_tensor` are patched to count calls: the count must stay 0.
"""

from __future__ import annotations

import copy
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _dist
import torch

ROUNDS = 2


def _param(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


def _fsdp2(world: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """FSDP2 over an MLP whose dims do not divide by the world (uneven shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3), torch.nn.LayerNorm(3)
    )
    plain = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world,))
    for index in (0, 2, 3):
        fully_shard(model[index], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, plain


def _tensor_parallel(world: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Tensor-parallel layouts: Shard(1) (row-parallel), Shard(0) (column-parallel),
    an uneven Shard(1), a replicated DTensor and a plain (replicated) tensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(11)
    full = {
        "row": torch.randn(6, 8),
        "col": torch.randn(8, 6, dtype=torch.bfloat16),
        "odd": torch.randn(3, 5),
        "rep": torch.randn(9),
        "plain": torch.randn(2, 3),
    }
    plain = torch.nn.Module()
    for name, tensor in full.items():
        setattr(plain, name, _param(tensor.clone()))
    mesh = init_device_mesh("cpu", (world,))
    model = torch.nn.Module()
    model.row = _param(distribute_tensor(full["row"], mesh, [Shard(1)]))
    model.col = _param(distribute_tensor(full["col"], mesh, [Shard(0)]))
    model.odd = _param(distribute_tensor(full["odd"], mesh, [Shard(1)]))
    model.rep = _param(distribute_tensor(full["rep"], mesh, [Replicate()]))
    model.plain = _param(full["plain"].clone())
    return model, plain


def _mesh_2d(world: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A 2-D mesh (FSDP x TP): Shard(0) x Shard(1), Replicate x Shard(0) (HSDP-like),
    Shard(1) twice (nested, uneven)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.manual_seed(13)
    full = {
        "fsdp_tp": torch.randn(6, 10),
        "hsdp": torch.randn(7, 4),
        "nested": torch.randn(3, 11),
    }
    plain = torch.nn.Module()
    for name, tensor in full.items():
        setattr(plain, name, _param(tensor.clone()))
    mesh = init_device_mesh("cpu", (2, world // 2))
    model = torch.nn.Module()
    model.fsdp_tp = _param(distribute_tensor(full["fsdp_tp"], mesh, [Shard(0), Shard(1)]))
    model.hsdp = _param(distribute_tensor(full["hsdp"], mesh, [Replicate(), Shard(0)]))
    model.nested = _param(distribute_tensor(full["nested"], mesh, [Shard(1), Shard(1)]))
    return model, plain


SCENARIOS: dict[str, Callable[[int], tuple[torch.nn.Module, torch.nn.Module]]] = {
    "fsdp2": _fsdp2,
    "tensor_parallel": _tensor_parallel,
    "mesh_2d": _mesh_2d,
}


def _gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (a collective on every rank), for the reference."""
    from asyncwt._core.source import materialize_full_tensor

    return {n: materialize_full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


class _GatherCounter:
    """Counts `iter_full` and `full_tensor()` calls while installed."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __enter__(self) -> _GatherCounter:  # noqa: PYI034
        from torch.distributed.tensor import DTensor

        from asyncwt import ModuleSource

        self._saved = (DTensor.full_tensor, ModuleSource.iter_full)
        counter = self

        def full_tensor(self: Any, *args: Any, **kwargs: Any) -> Any:
            counter.calls.append("full_tensor")
            return counter._saved[0](self, *args, **kwargs)

        def iter_full(self: Any) -> Any:
            counter.calls.append("iter_full")
            return counter._saved[1](self)

        DTensor.full_tensor = full_tensor  # type: ignore[method-assign]
        ModuleSource.iter_full = iter_full  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from torch.distributed.tensor import DTensor

        from asyncwt import ModuleSource

        DTensor.full_tensor, ModuleSource.iter_full = self._saved  # type: ignore[method-assign]


def _scenario(rank: int, world: int, name: str, backend: str) -> dict[str, Any]:
    import anyio

    import asyncwt
    from asyncwt import LocalClient, ModuleSource, trainer_init

    model, plain = SCENARIOS[name](world)
    info_cls: Any = asyncwt.ShmTrainerInitInfo if backend == "shm" else asyncwt.TcpTrainerInitInfo
    record: dict[str, Any] = {"rounds": [], "gather_calls": []}

    def workers(count: int) -> list[Any]:
        config = asyncwt.WeightTransferConfig(backend=backend)
        out = []
        for _ in range(count):
            worker_model = copy.deepcopy(plain)
            with torch.no_grad():
                for p in worker_model.parameters():
                    p.zero_()
            out.append(asyncwt.create_worker_engine(config, model=worker_model))
        return out

    async def main() -> None:
        owners_workers = workers(2) if rank == 0 else []
        gathered_workers = workers(1) if rank == 0 else []
        owners_client = LocalClient(owners_workers) if rank == 0 else _NoClient()
        gathered_client = LocalClient(gathered_workers) if rank == 0 else _NoClient()
        source = ModuleSource(model)
        bucket = 64  # small: pieces span several buckets
        owners = await trainer_init(
            info_cls(rank=rank, bucket_bytes=bucket, senders="owners"),
            client=owners_client,
            source=source,
        )
        gathered = await trainer_init(
            info_cls(rank=rank, bucket_bytes=bucket), client=gathered_client, source=source
        )
        async with owners, gathered:
            for r in range(1, ROUNDS + 1):
                with torch.no_grad():
                    for param in model.parameters():
                        param.mul_(-1.5).add_(r)
                with _GatherCounter() as counter:
                    stats = await owners.send_weights(weight_version=f"v{r}")
                record["gather_calls"].extend(counter.calls)
                await gathered.send_weights(weight_version=f"v{r}")
                reference = _gathered(model)
                row: dict[str, Any] = {"bytes": stats.bytes, "total": stats.total_bytes}
                if rank == 0:
                    row["owners_exact"] = [_equal(w.model, reference) for w in owners_workers]
                    row["gathered_exact"] = [_equal(w.model, reference) for w in gathered_workers]
                    row["versions"] = [w.weight_version for w in owners_workers]
                    row["full_bytes"] = sum(t.numel() * t.itemsize for t in reference.values())
                record["rounds"].append(row)
        for w in owners_workers + gathered_workers:
            w.shutdown()

    anyio.run(main)
    record["receive_threads_left"] = [
        t.name for t in threading.enumerate() if t.name.startswith("asyncwt-owner")
    ]
    return record


def _equal(model: torch.nn.Module, reference: dict[str, torch.Tensor]) -> dict[str, bool]:
    params = dict(model.named_parameters())
    return {n: torch.equal(params[n].detach(), t) for n, t in reference.items()}


class _NoClient:
    """Ranks other than 0 never call the control plane."""

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        raise AssertionError("only rank 0 calls the client")

    async def start_weight_update(self) -> None:
        raise AssertionError("only rank 0 calls the client")

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        raise AssertionError("only rank 0 calls the client")

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        raise AssertionError("only rank 0 calls the client")


def owners_scenarios(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Rank entry point: every scenario in `ASYNCWT_TEST_SCENARIOS`, in order."""
    import torch.distributed as dist

    _dist._init(rank, world_size, port)
    backend = os.environ.get("ASYNCWT_TEST_BACKEND", "tcp")
    names = os.environ.get("ASYNCWT_TEST_SCENARIOS", ",".join(SCENARIOS)).split(",")
    results: dict[str, Any] = {}
    try:
        for name in names:
            try:
                results[name] = _scenario(rank, world_size, name, backend)
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)


def failing_share(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Round 2 fails on rank 1 (its shard disagrees with the metadata); rounds 1 and 3
    succeed: the worker keeps v1 through the failure, then takes v3 bit for bit."""
    import anyio
    import torch.distributed as dist

    import asyncwt
    from asyncwt import LocalClient, ModuleSource, trainer_init

    _dist._init(rank, world_size, port)
    model, plain = _fsdp2(world_size)
    armed = {"on": False}

    class Source(ModuleSource):
        def iter_local(self) -> Any:
            for name, tensor in super().iter_local():
                if armed["on"] and rank == 1 and name == "2.weight":
                    tensor = tensor[:-1]
                yield name, tensor

    record: dict[str, Any] = {"rounds": []}

    async def main() -> None:
        workers = []
        if rank == 0:
            worker_model = copy.deepcopy(plain)
            config = asyncwt.WeightTransferConfig(backend="tcp")
            workers.append(asyncwt.create_worker_engine(config, model=worker_model))
        client: Any = LocalClient(workers) if rank == 0 else _NoClient()
        info = asyncwt.TcpTrainerInitInfo(rank=rank, bucket_bytes=64, senders="owners")
        engine = await trainer_init(info, client=client, source=Source(model))
        async with engine:
            for r in (1, 2, 3):
                with torch.no_grad():
                    for param in model.parameters():
                        param.mul_(-1.5).add_(r)
                armed["on"] = r == 2
                row: dict[str, Any] = {}
                try:
                    await engine.send_weights(weight_version=f"v{r}")
                    row["error"] = None
                except Exception as exc:  # noqa: BLE001 - recorded for the parent
                    row["error"] = f"{type(exc).__name__}: {exc}"
                reference = _gathered(model)
                if rank == 0:
                    row["version"] = workers[0].weight_version
                    row["exact"] = _equal(workers[0].model, reference)
                record["rounds"].append(row)
        for w in workers:
            w.shutdown()

    try:
        anyio.run(main)
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)


def init_fails_on_one_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Rank 1 cannot listen (its port is taken): every rank's trainer_init fails, none
    hangs, and rank 0's error names rank 1."""
    import socket

    import anyio
    import torch.distributed as dist

    import asyncwt
    from asyncwt import LocalClient, ModuleSource, trainer_init

    _dist._init(rank, world_size, port)
    model, plain = _fsdp2(world_size)
    taken = socket.create_server(("127.0.0.1", 0))
    listen = taken.getsockname()[1] if rank == 1 else 0
    record: dict[str, Any] = {}

    async def main() -> None:
        workers = []
        if rank == 0:
            config = asyncwt.WeightTransferConfig(backend="tcp")
            workers.append(asyncwt.create_worker_engine(config, model=copy.deepcopy(plain)))
        client: Any = LocalClient(workers) if rank == 0 else _NoClient()
        info = asyncwt.TcpTrainerInitInfo(
            rank=rank, listen=asyncwt.Listen(port=listen), senders="owners"
        )
        try:
            await trainer_init(info, client=client, source=ModuleSource(model))
            record["error"] = None
        except Exception as exc:  # noqa: BLE001 - recorded for the parent
            record["error"] = f"{type(exc).__name__}: {exc}"
        for w in workers:
            w.shutdown()

    try:
        anyio.run(main)
    finally:
        taken.close()
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
