"""The `"tcp"` backend, trainer side: every bucket streams over each worker's connection."""

from __future__ import annotations

from typing import Any

from ._link import TrainerLinks
from ._plan import Bucket, TransferPlan
from ._tcp_info import TcpTrainerInitInfo
from ._trainer_engine import PipelinedTrainerEngine
from ._transport import InitWorkers, SenderTransport
from ._wire import FrameKind

__all__ = ["TcpSender", "TcpTrainerEngine"]


class TcpSender(SenderTransport):
    """Sends each bucket (header, then its segments, scatter-gather) to every worker."""

    accepts_views = True

    def __init__(self, info: TcpTrainerInitInfo, plan: TransferPlan) -> None:
        self.links = TrainerLinks(info.link_settings(), plan)

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        await self.links.rendezvous(worker_fields, init_workers)

    @property
    def num_workers(self) -> int:
        return len(self.links.peers)

    def check_usable(self) -> None:
        self.links.check_usable()

    async def begin_round(self, round_id: int) -> None:
        await self.links.wait_ready(round_id)

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[memoryview]) -> None:
        header = self.links.frame(FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes)
        frame = [memoryview(header.pack()), *segments]
        await self.links.each(self.links.send_frame, frame, f"bucket {bucket.index}")

    async def end_round(self) -> None:
        await self.links.end_round()

    async def abort_round(self, reason: str) -> None:
        await self.links.abort_round(reason)

    def close(self) -> None:
        self.links.close()


class TcpTrainerEngine(PipelinedTrainerEngine[TcpTrainerInitInfo]):
    """Trainer engine of the `"tcp"` backend.

    Rank 0 listens during `trainer_init` only; each worker connects and proves the
    token while its `init_weight_transfer_engine` call runs. Each round, every worker
    receives every bucket over its own connection, all concurrently.
    """

    init_info_cls = TcpTrainerInitInfo

    @classmethod
    def make_transport(cls, info: TcpTrainerInitInfo, plan: TransferPlan) -> SenderTransport:
        return TcpSender(info, plan)
