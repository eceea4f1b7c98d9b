"""The `"shm"` backend: a ring of shared-memory buckets on one host.

The trainer packs each bucket straight into one of `num_buffers` shared-memory
segments; the link (the same authenticated connection as `"tcp"`, on loopback)
carries only frame headers naming the slot, and each worker's RELEASE of a slot
once its applier is done with it. Workers read the bytes in place. A slot is
rewritten only after every worker released it.

Segments are created with owner-only permissions and unlinked as soon as every
worker has mapped them, so nothing is left in `/dev/shm` even if both sides are
killed; the mappings live until each side closes them.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any, ClassVar

import torch

from ._applier import ModelTarget
from ._exceptions import ProtocolError
from ._link import Peer, TrainerLinks, WorkerLink, connect_link
from ._plan import Bucket, TransferPlan
from ._tcp_info import LinkedTrainerInfo, TcpWorkerInitInfo
from ._trainer import TrainerInitInfo
from ._trainer_engine import PipelinedTrainerEngine
from ._transport import InitWorkers, ReceivedBucket, ReceiverTransport, SenderTransport
from ._wire import Frame, FrameKind
from ._worker_engine import DeferredWorkerEngine

__all__ = [
    "ShmReceiver",
    "ShmSender",
    "ShmTrainerEngine",
    "ShmTrainerInitInfo",
    "ShmWorkerEngine",
    "ShmWorkerInitInfo",
]

_SEGMENT_NAME = re.compile(r"^asyncwt_[0-9a-f]{16}_\d{1,4}$")
_CREATED_HERE: set[str] = set()
"""Segments this process created (and its resource tracker rightly tracks)."""


@dataclass
class ShmTrainerInitInfo(LinkedTrainerInfo, TrainerInitInfo):
    """Trainer-side settings of the `"shm"` backend (trainer and workers on one host)."""

    backend: ClassVar[str] = "shm"


@dataclass
class ShmWorkerInitInfo(TcpWorkerInitInfo):
    """What a `"shm"` worker receives: the link's address and token, and the segments."""

    segments: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.segments, list) or len(self.segments) != self.num_buffers:
            raise ValueError(
                f"segments should list num_buffers ({self.num_buffers}) names, got {self.segments!r}"
            )
        for name in self.segments:
            if not isinstance(name, str) or not _SEGMENT_NAME.match(name):
                raise ValueError(f"segments should be asyncwt segment names, got {name!r}")


def _view(segment: shared_memory.SharedMemory, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)


def _attach(name: str, nbytes: int) -> shared_memory.SharedMemory:
    """Map an existing segment without adopting it (its creator owns its lifetime)."""
    segment = shared_memory.SharedMemory(name=name)
    # Before Python 3.13 attaching registers the segment with this process's resource
    # tracker, which would unlink it when this process exits: undo that (unless this
    # process is the creator, e.g. a trainer with in-process workers).
    if name not in _CREATED_HERE:
        with contextlib.suppress(Exception):
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    if segment.size < nbytes:
        segment.close()
        raise ValueError(f"shared segment {name!r} has {segment.size} bytes, the plan needs {nbytes}")
    return segment


class ShmSender(SenderTransport):
    """Packs buckets into the shared ring and announces each slot over the link."""

    accepts_views = False

    def __init__(self, info: ShmTrainerInitInfo, plan: TransferPlan) -> None:
        self.links = TrainerLinks(info.link_settings(), plan)
        self.bucket_bytes = plan.bucket_bytes
        self.release_timeout = info.send_timeout
        prefix = f"asyncwt_{secrets.token_hex(8)}"
        self.segments: list[shared_memory.SharedMemory] = []
        self.buffers: list[torch.Tensor] = []
        try:
            for slot in range(info.num_buffers):
                segment = shared_memory.SharedMemory(
                    name=f"{prefix}_{slot}", create=True, size=plan.bucket_bytes
                )
                _CREATED_HERE.add(segment.name.lstrip("/"))
                self.segments.append(segment)
                self.buffers.append(_view(segment, plan.bucket_bytes))
        except BaseException:
            self.close()
            raise
        self.pending: list[set[Peer]] = [set() for _ in self.segments]
        """Per ring slot, the workers that still read what it holds."""
        self.bound: dict[int, int] = {}
        """Pipeline slot → the ring slot it is packing into (until sent)."""

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        fields = {**worker_fields, "segments": [s.name.lstrip("/") for s in self.segments]}
        await self.links.rendezvous(fields, init_workers)
        for segment in self.segments:  # every worker has mapped them: drop the names
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()

    @property
    def num_workers(self) -> int:
        return len(self.links.peers)

    def check_usable(self) -> None:
        self.links.check_usable()

    def staging(self, slot: int) -> torch.Tensor | None:
        return self.buffers[self.bound[slot]]

    def _on_release(self, peer: Peer, frame: Frame) -> None:
        if 0 <= frame.slot < len(self.pending):
            self.pending[frame.slot].discard(peer)

    async def reclaim(self, slot: int) -> None:
        """Bind pipeline slot `slot` to a ring slot that no worker reads any more.

        Any free ring slot will do, so one worker slow to apply one bucket does not
        stall the ring while other slots are free. Waits (reading RELEASE frames)
        while every ring slot is still being read.
        """
        self.bound.pop(slot, None)
        taken = set(self.bound.values())
        while True:
            for ring in range(len(self.buffers)):
                if ring not in taken and not self.pending[ring]:
                    self.bound[slot] = ring
                    return
            peer = next(p for ring in range(len(self.pending)) for p in self.pending[ring])
            frame = await self.links.read_frame(peer, self.release_timeout, "a shared-slot release")
            if frame.kind != FrameKind.RELEASE:
                peer.close(f"sent {frame.kind.name} instead of RELEASE")
                raise self.links.protocol_error(peer, f"sent {frame.kind.name} instead of RELEASE")
            self._on_release(peer, frame)

    async def begin_round(self, round_id: int) -> None:
        self.bound.clear()  # bindings of an aborted round are void
        await self.links.wait_ready(round_id, self._on_release)

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[memoryview]) -> None:
        ring = self.bound.pop(slot)  # from now on `pending` guards the ring slot
        header = self.links.frame(
            FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes, slot=ring
        )
        self.pending[ring] = set(self.links.peers)
        await self.links.each(self.links.send_header, header, f"bucket {bucket.index}")

    async def end_round(self) -> None:
        await self.links.end_round()

    async def abort_round(self, reason: str) -> None:
        await self.links.abort_round(reason)

    def close(self) -> None:
        self.links.close()
        self.buffers = []
        for segment in self.segments:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
            with contextlib.suppress(BufferError):
                segment.close()
        self.segments = []


class ShmReceiver(ReceiverTransport):
    """Maps the ring; yields each announced slot as the bucket's buffer, in place."""

    def __init__(self, info: ShmWorkerInitInfo, plan: TransferPlan) -> None:
        self.info = info
        self.plan = plan
        self.link: WorkerLink | None = None
        self.segments: list[shared_memory.SharedMemory] = []
        self.buffers: list[torch.Tensor] = []

    def connect(self) -> None:
        info, plan = self.info, self.plan
        try:
            for name in info.segments:
                segment = _attach(name, plan.bucket_bytes)
                self.segments.append(segment)
                self.buffers.append(_view(segment, plan.bucket_bytes))
            sock = connect_link(info.host, info.port, info.token, plan, info.connect_timeout)
        except BaseException:
            self.close()
            raise
        self.link = WorkerLink(sock, plan, info.recv_timeout)

    @property
    def usable(self) -> bool:
        return self.link is not None and not self.link.broken

    def receive_round(self, round_id: int, target: ModelTarget) -> Iterator[ReceivedBucket]:
        link = self.link
        assert link is not None
        with link.guard(round_id):
            for frame in link.frames(round_id):
                if not 0 <= frame.slot < len(self.buffers):
                    raise ProtocolError(
                        f"round {round_id}: bucket {frame.index} names shared slot {frame.slot}, "
                        f"there are {len(self.buffers)}"
                    )
                bucket = self.plan.buckets[frame.index]
                yield ReceivedBucket(bucket, self.buffers[frame.slot], self._releaser(link, frame))

    @staticmethod
    def _releaser(link: WorkerLink, frame: Frame) -> Any:
        release = Frame(FrameKind.RELEASE, frame.round_id, frame.index, frame.digest, 0, frame.slot)

        def release_slot() -> None:
            with contextlib.suppress(OSError):  # a broken link fails the round anyway
                link.send(release)

        return release_slot

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self.buffers = []
        for segment in self.segments:
            with contextlib.suppress(BufferError):
                segment.close()
        self.segments = []


class ShmTrainerEngine(PipelinedTrainerEngine[ShmTrainerInitInfo]):
    """Trainer engine of the `"shm"` backend (see the module docstring)."""

    init_info_cls = ShmTrainerInitInfo

    @classmethod
    def make_transport(cls, info: ShmTrainerInitInfo, plan: TransferPlan) -> SenderTransport:
        return ShmSender(info, plan)


class ShmWorkerEngine(DeferredWorkerEngine):
    """Worker engine of the `"shm"` backend: applies straight from shared memory."""

    init_info_cls = ShmWorkerInitInfo
    receives_in_place = False

    def make_receiver(self, info: Any, plan: TransferPlan) -> ReceiverTransport:
        return ShmReceiver(info, plan)
