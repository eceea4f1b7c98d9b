"""The `"tcp"` backend's star sender: each bucket to every worker over its connection."""

from __future__ import annotations

from ..._core.bytes import byte_view
from ..._core.plan import Bucket, TransferPlan
from ..._transports.base import Segment
from ..._transports.link import LinkedSender, Peer
from ..._transports.wire import FrameKind
from .settings import TcpTrainerInitInfo

__all__ = ["TcpSender"]


class TcpSender(LinkedSender):
    """Sends each bucket (header, then its segments, scatter-gather) to every worker."""

    min_view_bytes = 0

    def __init__(self, info: TcpTrainerInitInfo, plan: TransferPlan) -> None:
        super().__init__(info.link_settings(), plan)

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[Segment]) -> None:
        await self.send_bucket_to(bucket, slot, segments, self.links.peers)

    async def send_bucket_to(
        self, bucket: Bucket, slot: int, segments: list[Segment], peers: list[Peer]
    ) -> None:
        if not peers:
            return
        header = self.links.frame(FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes)
        frame = [memoryview(header.pack()), *map(byte_view, segments)]
        await self.links.each(self.links.send_frame, frame, f"bucket {bucket.index}", among=peers)
