"""The `"tcp"` backend, trainer side: every bucket streams over each worker's connection."""

from __future__ import annotations

import torch

from ..._core.bytes import byte_view
from ..._core.plan import Bucket, TransferPlan
from ..._delta.links import DeltaLinks
from ..._trainer.engine import PipelinedTrainerEngine
from ..base import Segment, SenderTransport
from ..link import LinkedSender
from ..wire import FrameKind
from .settings import TcpTrainerInitInfo

__all__ = ["TcpSender", "TcpTrainerEngine"]


class TcpSender(LinkedSender):
    """Sends each bucket (header, then its segments, scatter-gather) to every worker."""

    min_view_bytes = 0

    def __init__(self, info: TcpTrainerInitInfo, plan: TransferPlan) -> None:
        super().__init__(info.link_settings(), plan)
        self.delta = (
            DeltaLinks(self.links, plan, full_every=info.delta_full_every, policy=info.delta_policy)
            if info.delta
            else None
        )

    @property
    def round_wire_bytes(self) -> int | None:
        """Bytes on the wire to each worker in the last round (delta rounds), else None."""
        return self.delta.round_wire_bytes if self.delta is not None else None

    async def begin_round(self, round_id: int) -> None:
        await super().begin_round(round_id)
        if self.delta is not None:
            self.delta.begin_round(round_id)

    async def end_round(self) -> None:
        await super().end_round()
        if self.delta is not None:
            self.delta.end_round(self.links.round_id)

    async def abort_round(self, reason: str) -> None:
        if self.delta is not None:
            self.delta.abort_round()
        await super().abort_round(reason)

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[Segment]) -> None:
        if self.delta is not None:
            await self.delta.send_bucket(bucket, segments)
            return
        header = self.links.frame(FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes)
        frame = [memoryview(header.pack()), *map(byte_view, segments)]
        await self.links.each(self.links.send_frame, frame, f"bucket {bucket.index}")


class TcpTrainerEngine(PipelinedTrainerEngine[TcpTrainerInitInfo]):
    """Trainer engine of the `"tcp"` backend.

    Rank 0 listens during `trainer_init` only; each worker connects and proves the
    token while its `init_weight_transfer_engine` call runs. Each round, every worker
    receives every bucket over its own connection, all concurrently.
    """

    init_info_cls = TcpTrainerInitInfo
    supports_delta = True

    @classmethod
    def make_transport(
        cls, info: TcpTrainerInitInfo, plan: TransferPlan, device: torch.device
    ) -> SenderTransport:
        return TcpSender(info, plan)
