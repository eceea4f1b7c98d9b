"""The `"shm"` backend: the bucket ring (see `_ring`) in shared memory, on one host.

Segments are created with owner-only permissions and unlinked as soon as every
worker has mapped them, so nothing is left in `/dev/shm` even if both sides are
killed; the mappings live until each side closes them.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any, ClassVar

import torch

from ._plan import TransferPlan
from ._ring import RingReceiver, RingSender
from ._tcp_info import LinkedTrainerInfo, TcpWorkerInitInfo
from ._trainer import TrainerInitInfo
from ._trainer_engine import PipelinedTrainerEngine
from ._transport import ReceiverTransport, SenderTransport
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


class ShmSender(RingSender):
    """The ring in shared-memory segments created here, owner-only."""

    def __init__(self, info: ShmTrainerInitInfo, plan: TransferPlan) -> None:
        super().__init__(info, plan)
        prefix = f"asyncwt_{secrets.token_hex(8)}"
        self.segments: list[shared_memory.SharedMemory] = []
        buffers = []
        try:
            for slot in range(info.num_buffers):
                segment = shared_memory.SharedMemory(
                    name=f"{prefix}_{slot}", create=True, size=plan.bucket_bytes
                )
                _CREATED_HERE.add(segment.name.lstrip("/"))
                self.segments.append(segment)
                buffers.append(_view(segment, plan.bucket_bytes))
        except BaseException:
            self.close()
            raise
        self.set_buffers(buffers)

    def exported(self) -> dict[str, Any]:
        return {"segments": [s.name.lstrip("/") for s in self.segments]}

    def after_rendezvous(self) -> None:
        for segment in self.segments:  # every worker has mapped them: drop the names
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()

    def close(self) -> None:
        super().close()
        for segment in self.segments:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
            with contextlib.suppress(BufferError):
                segment.close()
        self.segments = []


class ShmReceiver(RingReceiver):
    """Maps the trainer's shared-memory segments."""

    def __init__(self, info: ShmWorkerInitInfo, plan: TransferPlan) -> None:
        super().__init__(info, plan)
        self.segment_names = info.segments
        self.segments: list[shared_memory.SharedMemory] = []

    def map_ring(self) -> list[torch.Tensor]:
        buffers = []
        for name in self.segment_names:
            segment = _attach(name, self.plan.bucket_bytes)
            self.segments.append(segment)
            buffers.append(_view(segment, self.plan.bucket_bytes))
        return buffers

    def unmap_ring(self) -> None:
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
