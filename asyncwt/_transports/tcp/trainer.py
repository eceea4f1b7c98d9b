"""The `"tcp"` backend, trainer side: every bucket streams over each worker's connection."""

from __future__ import annotations

import torch

from ..._core.bytes import byte_view
from ..._core.plan import Bucket, TransferPlan
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

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[Segment]) -> None:
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

    @classmethod
    def make_transport(
        cls, info: TcpTrainerInitInfo, plan: TransferPlan, device: torch.device
    ) -> SenderTransport:
        return TcpSender(info, plan)
