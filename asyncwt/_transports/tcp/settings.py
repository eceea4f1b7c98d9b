"""Init infos of the `"tcp"` backend, both sides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..._core.settings import RoundUpdateInfo
from ..._trainer.base import TrainerInitInfo
from ..link_settings import LinkedTrainerInfo, LinkedWorkerInfo

__all__ = ["TcpTrainerInitInfo", "TcpUpdateInfo", "TcpWorkerInitInfo"]

TcpUpdateInfo = RoundUpdateInfo


@dataclass
class TcpTrainerInitInfo(LinkedTrainerInfo, TrainerInitInfo):
    """Trainer-side settings of the `"tcp"` backend: rank 0 listens, workers connect,
    and every bucket streams over each worker's connection."""

    backend: ClassVar[str] = "tcp"


@dataclass
class TcpWorkerInitInfo(LinkedWorkerInfo):
    """What a `"tcp"` worker receives at init: where to connect, the token, the plan."""
