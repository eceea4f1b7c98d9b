"""Owner senders on the trainer: every rank streams its own shards, no gather.

With `senders="owners"` (tcp and shm) each rank builds the same round plan (its
`OwnersLayout`) from `source.metadata`, opens its own endpoint for its share plan,
and every round runs its own pipeline over `ShareSource` (its pieces, cut from
`iter_local()`): no collective moves weights. Rank 0 alone keeps the control plane:
it inits the workers (telling them every rank's endpoint) and calls
start/update/finish; the other ranks open and close their links' rounds only
(`asyncwt._trainer.senders.share_round`). `OwnerRanks` is what the engine is handed.

At init the ranks exchange their endpoints (host, port, token, transport fields)
over a gloo group made for the purpose, then learn from rank 0 whether the
workers' init succeeded; nothing crosses ranks during a round.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import cached_property
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import torch

from .._core.errors import SourceMismatchError, TransferError
from .._core.meta import ParamMeta
from .._core.owners import OwnersLayout, pieces_by_param
from .._core.round_plan import RoundChoices
from .._core.source import WeightSource
from .._transports.base import InitWorkers, SenderTransport
from .senders import SenderSide, round_plan_for

__all__ = ["OwnerRanks", "ShareSource"]


class ShareSource(WeightSource):
    """One rank's pieces, cut from `source.iter_local()`: what its pipeline sends.

    Checks every local shard against the layout: a shard whose shape disagrees
    with the metadata (owners, mesh shape, placements) fails the round naming the
    parameter and the rank. Never calls `iter_full` or gathers.
    """

    def __init__(self, source: WeightSource, layout: OwnersLayout, rank: int) -> None:
        self._source = source
        self._layout = layout
        self._rank = rank
        self._pieces = pieces_by_param(layout.pieces[rank])
        self._owned = sorted(layout.local[rank])

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return list(self._layout.share_plans[self._rank].params)

    def device(self) -> torch.device | None:
        return self._source.device()

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        params = self._layout.plan.params
        rank = self._rank
        pos = 0
        pairs = self._source.iter_local()
        try:
            for name, local in pairs:
                if pos >= len(self._owned) or params[self._owned[pos]].name != name:
                    want = params[self._owned[pos]].name if pos < len(self._owned) else "the end"
                    raise SourceMismatchError(
                        f"rank {rank}: iter_local yielded {name!r} at index {pos}, expected "
                        f"{want!r} (the parameters the metadata says this rank owns, in order)"
                    )
                index = self._owned[pos]
                pos += 1
                box = self._layout.local[rank][index]
                if not isinstance(local, torch.Tensor) or tuple(local.shape) != box.size:
                    got = tuple(local.shape) if isinstance(local, torch.Tensor) else type(local)
                    raise SourceMismatchError(
                        f"parameter {name!r} on rank {rank}: the local shard's shape is {got}, "
                        f"the metadata (owners, mesh_shape, placements) says {box.size}"
                    )
                if local.dtype != params[index].dtype:
                    raise SourceMismatchError(
                        f"parameter {name!r} on rank {rank}: the local shard's dtype is "
                        f"{local.dtype}, the metadata says {params[index].dtype}"
                    )
                piece = self._pieces.get(index)
                if piece is not None:
                    yield name, local[piece.box.within(box)]
        finally:
            close = getattr(pairs, "close", None)
            if close is not None:
                close()
        if pos < len(self._owned):
            raise SourceMismatchError(
                f"rank {rank}: iter_local stopped after {pos} parameters, expected "
                f"{len(self._owned)}; first missing: {params[self._owned[pos]].name!r}"
            )


class _Exchange:
    """Init-time exchange of small JSON values between the trainer ranks (gloo)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.group = dist.new_group(backend="gloo")

    def all(self, value: Any) -> list[Any]:
        """Every rank's `value`, by rank (blocking: run it in a thread)."""
        dist = self._dist
        data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)
        world = dist.get_world_size()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([data.numel()]), group=self.group)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(out, padded, group=self.group)
        return [json.loads(bytes(t[: int(s.item())].tolist()).decode()) for t, s in zip(out, sizes)]

    def close(self) -> None:
        self._dist.destroy_process_group(self.group)


def _world(rank: int) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "senders='owners' needs torch.distributed initialised on every trainer rank (the "
            "ranks exchange their endpoints at init)"
        )
    if dist.get_rank() != rank:
        raise ValueError(
            f"init_info.rank should be this process's global rank {dist.get_rank()} with "
            f"senders='owners', got {rank}"
        )
    return dist.get_world_size()


class OwnerRanks(SenderSide):
    """Every trainer rank sends the pieces it holds (`senders="owners"`): each opens
    its own endpoint for its share plan; rank 0 alone inits the workers, telling them
    every rank's endpoint (see the module docstring)."""

    @classmethod
    def build(cls, info: Any, source: WeightSource | None, choices: RoundChoices) -> OwnerRanks:
        if source is None or not source.implements_iter_local():
            raise ValueError(
                f"source should be a WeightSource implementing iter_local (senders='owners' "
                f"sends each rank's local shards), got {type(source).__name__}"
            )
        rank = info.rank
        round_plan = round_plan_for(info, source, choices, _world(rank))
        assert round_plan.layout is not None
        return cls(round_plan, ShareSource(source, round_plan.layout, rank), rank)

    def opens_transport(self, is_sender: bool) -> bool:
        return True

    async def open(
        self,
        make: Callable[[], SenderTransport],
        prepare: Callable[[SenderTransport], None],
        fields: dict[str, Any],
        init_all: InitWorkers,
    ) -> SenderTransport:
        layout = self.round_plan.layout
        assert layout is not None
        rank = self.rank
        exchange = await anyio.to_thread.run_sync(_Exchange)
        joined = False  # whether this rank reached the endpoint exchange

        async def init_workers(mine: dict[str, Any]) -> None:
            nonlocal joined
            joined = True
            everyone = await anyio.to_thread.run_sync(exchange.all, mine)
            ok = rank != 0
            try:
                failed = [e["failed"] for e in everyone if "failed" in e]
                if failed:
                    raise TransferError(f"senders='owners' init failed on other ranks: {failed}")
                if rank == 0:
                    # Each worker derives every rank's share plan from the layout: only the
                    # endpoints travel (a plan per rank would multiply the init's size).
                    endpoints = [{k: v for k, v in e.items() if k != "plan"} for e in everyone]
                    owners = {**layout.to_wire(), "senders": endpoints}
                    await init_all({**mine, "plan": layout.plan.to_wire(), "owners": owners})
                    ok = True
            finally:
                with anyio.CancelScope(shield=True):
                    status = await anyio.to_thread.run_sync(exchange.all, ok)
            if not status[0]:
                raise TransferError(
                    f"rank {rank}: rank 0 could not init the workers (see rank 0's error); "
                    f"senders='owners' init failed"
                )

        transport: SenderTransport | None = None
        error: BaseException | None = None
        try:
            transport = make()
            await anyio.to_thread.run_sync(prepare, transport)
            await transport.rendezvous(fields, init_workers)
        except BaseException as exc:  # noqa: BLE001 - re-raised after the exchanges below
            error = exc
        # Every rank runs the same exchanges whatever happened here, so that a rank that
        # failed before its endpoint existed fails the others instead of leaving them
        # blocked in a collective.
        with anyio.CancelScope(shield=True):
            try:
                if error is not None and not joined:
                    why = f"rank {rank}: {type(error).__name__}: {error}"
                    await anyio.to_thread.run_sync(exchange.all, {"failed": why})
                    await anyio.to_thread.run_sync(exchange.all, False)
                count = -1 if error is not None or transport is None else transport.num_workers
                counts = await anyio.to_thread.run_sync(exchange.all, count)
            finally:
                await anyio.to_thread.run_sync(exchange.close)
        if error is None and len(set(counts)) != 1:
            error = TransferError(
                f"rank {rank}: not every rank was initialised with the same workers (workers "
                f"per rank, -1 where init failed: {counts}); every worker must reach every rank"
            )
        if error is not None:
            if transport is not None:
                transport.close()
            raise error
        assert transport is not None
        return transport
