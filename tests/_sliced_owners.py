"""Owner trainer ranks pushing to sliced receivers (spawned; see `_dist.run_ranks`).

Every rank holds its shards of a model (`Shard(0)` over the ranks) and sends them with
`senders="owners"` to the tensor-parallel workers whose URLs `ASYNCWT_TEST_WORKERS`
lists, each declaring its boxes (`fanout=Star(slices=True)`). A case says which model,
how each round changes it and what rank 0 records about the workers after the round:
`sliced_owners` runs `_slice_models.full` into `_slice_models.rank(i, 2)` workers
(each worker's version and checksum next to the checksum of the shards it should hold),
`vllm_owners` runs the tiny Llama (`_vllm_model`, FSDP2) into a vLLM server of two
ranks (its greedy tokens on `ASYNCWT_TEST_PROMPTS` and the version it reports). Every
rank records the bytes it sent each round and, per worker it reached, the bytes of its
pairs.
"""

from __future__ import annotations

import json
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
VLLM_SEEDS = (1, 2)
"""`vllm_owners`' round r sends the tiny Llama drawn from `VLLM_SEEDS[r - 1]`."""


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


class SliceCase:
    """`_slice_models.full` into asyncwt workers; rank 0 checks their checksums."""

    embed = "embed.weight"

    def build(self, world: int) -> torch.nn.Module:
        return _sharded(world)

    def update(self, model: torch.nn.Module, r: int) -> None:
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(-1.5).add_(r)

    async def record(self, rank: int, client: Any, model: torch.nn.Module) -> dict[str, Any]:
        from asyncwt._core.checksum import model_checksum

        full = _gathered(model)  # a collective: on every rank
        if rank != 0:
            return {}
        statuses = await client.weights_status(checksum=True)
        return {
            "workers": [(s["weight_version"], s["checksum"]) for s in statuses],
            "expected": [model_checksum(sm.shard_of(full, i, 2)) for i in (0, 1)],
        }


class VllmCase:
    """The tiny Llama of `_vllm_model` (shape in `ASYNCWT_TEST_SHAPE`, vocabulary in
    `ASYNCWT_TEST_VOCAB`) under FSDP2 into a vLLM server; rank 0 asks vLLM for its
    greedy tokens and weight version after each round."""

    embed = "model.embed_tokens.weight"

    def _full(self, seed: int) -> Any:
        import _vllm_model

        shape = json.loads(os.environ["ASYNCWT_TEST_SHAPE"])
        return _vllm_model.build_model(int(os.environ["ASYNCWT_TEST_VOCAB"]), seed, **shape)

    def build(self, world: int) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = self._full(seed=0)
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        return model  # type: ignore[no-any-return]

    def update(self, model: torch.nn.Module, r: int) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        full = dict(self._full(VLLM_SEEDS[r - 1]).named_parameters())
        with torch.no_grad():
            for name, param in model.named_parameters():
                assert isinstance(param, DTensor), name
                shard = distribute_tensor(full[name].detach(), param.device_mesh, param.placements)
                param.to_local().copy_(shard.to_local())

    async def record(self, rank: int, client: Any, model: torch.nn.Module) -> dict[str, Any]:
        if rank != 0:
            return {}
        from test_vllm import fresh_session, served_tokens, served_version

        (url,) = os.environ["ASYNCWT_TEST_WORKERS"].split(",")
        prompts = json.loads(os.environ["ASYNCWT_TEST_PROMPTS"])
        async with fresh_session() as session:
            return {
                "tokens": await served_tokens(session, url, prompts),
                "version": await served_version(session, url),
            }


def sliced_owners(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Rank entry point: `SliceCase` (see the module docstring)."""
    _owners(SliceCase(), rank, world_size, port, out_dir)


def vllm_owners(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Rank entry point: `VllmCase` (see the module docstring)."""
    _owners(VllmCase(), rank, world_size, port, out_dir)


def _owners(
    case: SliceCase | VllmCase, rank: int, world_size: int, port: int, out_dir: str
) -> None:
    import anyio
    import torch.distributed as dist

    from asyncwt import HttpClient, ModuleSource, Star, TcpTrainerInitInfo, trainer_init

    _dist._init(rank, world_size, port)
    urls = os.environ["ASYNCWT_TEST_WORKERS"].split(",")
    record: dict[str, Any] = {"rounds": []}

    async def main() -> None:
        model = case.build(world_size)
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
                embed = dict(zip(names, layout.boxes))[case.embed]
                pair = pairs.pair(rank, i)
                key = str((embed.start, embed.size))
                record["pairs"][key] = pair.total_bytes if pair is not None else 0
            for r in range(1, ROUNDS + 1):
                case.update(model, r)
                stats = await engine.send_weights(weight_version=f"v{r}")
                row: dict[str, Any] = {"wire_bytes": stats.wire_bytes, "workers": stats.workers}
                row.update(await case.record(rank, client, model))
                record["rounds"].append(row)

    try:
        anyio.run(main)
    except Exception:  # noqa: BLE001 - reported to the parent, which fails the test
        record["error"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    with open(Path(out_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(record, f)
