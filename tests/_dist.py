"""Run code on several real processes over gloo, for tests of DTensor and FSDP2 sources.

The parent calls `run_ranks(target, world_size, out_dir)`: it spawns one process per rank
(the `spawn` start method, so each child is a fresh interpreter), waits for all of them
with a deadline, and returns each rank's pickled results. A rank writes its results to
`out_dir/rank{N}.pkl`; the parent asserts, so a failure shows up as a test failure with
the data in hand. Targets live in this module so that `spawn` can import them by name.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

#: Collective timeout inside the ranks: a mismatched collective fails instead of hanging.
COLLECTIVE_TIMEOUT_S = 20.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_ranks(
    target: Callable[[int, int, int, str], None],
    world_size: int,
    out_dir: Path,
    *,
    timeout_s: float = 60.0,
) -> list[Any]:
    """Run `target(rank, world_size, port, out_dir)` on `world_size` spawned processes.

    Returns the object each rank pickled to `out_dir/rank{N}.pkl`, indexed by rank.
    Raises `AssertionError` if a rank is still running after `timeout_s` (it is killed)
    or exits non-zero.
    """
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(
            target=_rank_main, args=(target, rank, world_size, port, str(out_dir)), daemon=True
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        codes = [proc.exitcode for proc in procs]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for proc in procs:
            if not proc.is_alive():
                proc.close()
    assert not hung, f"ranks {hung} still running after {timeout_s} s (killed)"
    written = [(Path(out_dir) / f"rank{rank}.pkl").exists() for rank in range(world_size)]
    assert codes == [0] * world_size, f"rank exit codes: {codes}; results written: {written}"
    results = []
    for rank in range(world_size):
        with open(Path(out_dir) / f"rank{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


def _rank_main(
    target: Callable[[int, int, int, str], None],
    rank: int,
    world_size: int,
    port: int,
    out_dir: str,
) -> None:
    """Run `target` in a spawned rank, then leave without interpreter finalization.

    Everything a test checks is written to `out_dir` before `target` returns. What
    finalization would add is gloo's C++ threads being torn down while Python
    objects go away, which can abort the process (SIGABRT, "terminate called without
    an active exception"; seen once in CI on a rank whose rounds had all passed), so
    a rank exits with `os._exit` instead: 0 once `target` returned, 1 if it raised.
    """
    code = 1
    try:
        target(rank, world_size, port, out_dir)
        code = 0
    except BaseException:  # noqa: BLE001 - any failure becomes the rank's exit code 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _init(rank: int, world_size: int, port: int) -> None:
    import faulthandler

    import torch.distributed as dist

    # A rank killed by a signal (SIGABRT from C++, say) prints every thread's stack.
    faulthandler.enable(all_threads=True)

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def _record(source: Any, rank: int, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Everything a test checks about a ModuleSource on this rank, as plain objects."""
    metadata = source.metadata
    return {
        "metadata": list(metadata),
        "metadata_cached": source.metadata is metadata,
        "owned": source.owned_names(rank),
        "full": [(name, type(t).__name__, t.detach().clone()) for name, t in source.iter_full()],
        "local": [(name, type(t).__name__, t.detach().clone()) for name, t in source.iter_local()],
        "reference": reference,
    }


def _param(tensor: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(tensor, requires_grad=False)


def _scenario_mesh_1d(rank: int, world_size: int) -> dict[str, Any]:
    """A 1-D mesh over both ranks: Shard(0), Shard(1), Replicate, Partial; a plain
    tensor; and a parameter on a mesh of rank 0 only."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from asyncwt import ModuleSource

    mesh = init_device_mesh("cpu", (world_size,))
    solo_mesh = DeviceMesh("cpu", [0])  # every rank builds it; only rank 0 is in it
    torch.manual_seed(1234)  # same full tensors on every rank
    reference = {
        "row": torch.randn(5, 3),  # uneven: chunks of 3 and 2 rows
        "col": torch.randn(2, 5),  # uneven: chunks of 3 and 2 columns
        "rep": torch.randn(4),
        "plain": torch.randn(3),
        "solo": torch.randn(4, 2),
        "partial": torch.full((2, 2), float(sum(range(1, world_size + 1)))),
    }
    module = torch.nn.Module()
    module.row = _param(distribute_tensor(reference["row"], mesh, [Shard(0)]))
    module.col = _param(distribute_tensor(reference["col"], mesh, [Shard(1)]))
    module.rep = _param(distribute_tensor(reference["rep"], mesh, [Replicate()]))
    module.plain = _param(reference["plain"].clone())
    module.solo = _param(distribute_tensor(reference["solo"], solo_mesh, [Shard(0)]))
    # Each rank holds rank + 1; the full tensor is their sum.
    module.partial = _param(
        DTensor.from_local(torch.full((2, 2), float(rank + 1)), mesh, [Partial()])
    )
    return _record(ModuleSource(module), rank, reference)


def _scenario_mesh_2d(rank: int, world_size: int) -> dict[str, Any]:
    """2-D meshes of shape (2, 1) and (1, 2) over both ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from asyncwt import ModuleSource

    tall = init_device_mesh("cpu", (world_size, 1))
    wide = init_device_mesh("cpu", (1, world_size))
    torch.manual_seed(99)
    reference = {
        "shard_shard": torch.randn(4, 6),
        "replicate_shard": torch.randn(5, 2),
        "shard_dim1_twice": torch.randn(3, 7),
        "replicate_replicate": torch.randn(3),
    }
    module = torch.nn.Module()
    module.shard_shard = _param(
        distribute_tensor(reference["shard_shard"], tall, [Shard(0), Shard(1)])
    )
    module.replicate_shard = _param(
        distribute_tensor(reference["replicate_shard"], wide, [Replicate(), Shard(0)])
    )
    module.shard_dim1_twice = _param(
        distribute_tensor(reference["shard_dim1_twice"], tall, [Shard(1), Shard(1)])
    )
    module.replicate_replicate = _param(
        distribute_tensor(reference["replicate_replicate"], wide, [Replicate(), Replicate()])
    )
    return _record(ModuleSource(module), rank, reference)


def _scenario_fsdp2(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 (`fully_shard`) over a small nn.Sequential."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from asyncwt import ModuleSource

    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3), torch.nn.LayerNorm(3)
    )
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    record = _record(ModuleSource(model), rank, reference)
    record["param_types"] = [type(p).__name__ for p in model.parameters()]
    return record


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "mesh_1d": _scenario_mesh_1d,
    "mesh_2d": _scenario_mesh_2d,
    "fsdp2": _scenario_fsdp2,
}


def source_scenarios(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Rank entry point: run every scenario in the same order on every rank.

    A scenario that raises is recorded as `{"error": traceback}` and the next one runs,
    so each test reports its own failure.
    """
    import torch.distributed as dist

    _init(rank, world_size, port)
    results: dict[str, Any] = {}
    try:
        for name, scenario in SCENARIOS.items():
            try:
                results[name] = scenario(rank, world_size)
            except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(results, f)
