"""A layer around a linked sender: what it does not change, it passes through.

A codec (delta rounds) or a per-worker filter (sliced receivers) changes how a
bucket reaches some workers and nothing else; `SenderLayer` hands every other
call to the sender it wraps, so a layer says only what it changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._core.receiver_layout import ReceiverLayout
from .base import InitWorkers, SenderTransport
from .link import LinkedSender

__all__ = ["SenderLayer"]


class SenderLayer(SenderTransport):
    """A `SenderTransport` around `inner`, passing through what a subclass keeps."""

    def __init__(self, inner: LinkedSender) -> None:
        self.inner = inner
        self.links = inner.links
        self.min_view_bytes = inner.min_view_bytes
        self.in_flight_buckets = inner.in_flight_buckets
        self.own_staging = inner.own_staging

    def staging(self, slot: int) -> torch.Tensor | None:
        return self.inner.staging(slot)

    def receiver_layouts(self) -> Sequence[ReceiverLayout] | None:
        return self.inner.receiver_layouts()

    def prepare(self) -> None:
        self.inner.prepare()

    async def reclaim(self, slot: int) -> None:
        await self.inner.reclaim(slot)

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        await self.inner.rendezvous(worker_fields, init_workers)

    @property
    def num_workers(self) -> int:
        return self.inner.num_workers

    def check_usable(self) -> None:
        self.inner.check_usable()

    async def begin_round(self, round_id: int) -> None:
        await self.inner.begin_round(round_id)
        self.min_view_bytes = self.inner.min_view_bytes  # the round's, now it is open

    async def end_round(self) -> None:
        await self.inner.end_round()

    async def abort_round(self, reason: str) -> None:
        await self.inner.abort_round(reason)

    def close(self) -> None:
        self.inner.close()
