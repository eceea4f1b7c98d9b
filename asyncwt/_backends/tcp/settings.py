"""Init infos of the `"tcp"` backend, both sides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from ..._core.config import Chain, Star, check_group
from ..._core.modes import Mode
from ..._core.round_plan import ReceiversKind, RoundChoices
from ..._core.settings import RoundUpdateInfo
from ..._core.trainer_api import TrainerInitInfo
from ..._transports.link_settings import LinkedWorkerInfo, SendersAndDelta

__all__ = ["TcpTrainerInitInfo", "TcpUpdateInfo", "TcpWorkerInitInfo"]

TcpUpdateInfo = RoundUpdateInfo

TOPOLOGIES = ("star", "chain")
FAILURE_POLICIES = ("fail", "drop")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} should be one of {list(choices)}, got {value!r}")


@dataclass(kw_only=True)
class TcpTrainerInitInfo(SendersAndDelta, TrainerInitInfo):
    """Trainer-side settings of the `"tcp"` backend: rank 0 listens, workers connect,
    and every bucket streams to the workers over their connections.

    Usage:

        asyncwt.TcpTrainerInitInfo(
            rank=0, listen=asyncwt.Listen(host="0.0.0.0"), fanout=asyncwt.Chain()
        )
    """

    backend: ClassVar[str] = "tcp"

    fanout: Star | Chain = field(default_factory=Star)
    """How the bytes reach the workers: `Star()` (the trainer sends to each worker)
    or `Chain()` (each worker forwards to the next)."""
    on_worker_failure: str = "fail"
    """What a worker that dies mid-round does to the round. `"fail"`: the round fails
    everywhere and no worker publishes. `"drop"`: the worker is cut out, the round
    runs again on the survivors, who publish; `RoundStats.dropped` names it."""

    def __post_init__(self) -> None:
        # Own fields first: the base's mode check (`modes()`) reads them.
        check_group("fanout", self.fanout, (Star, Chain))
        _check_choice("on_worker_failure", self.on_worker_failure, FAILURE_POLICIES)
        super().__post_init__()

    def modes(self) -> dict[str, Mode]:
        return {
            **super().modes(),
            "fanout": Mode(self.fanout.name, repr(self.fanout)),
            "on_worker_failure": Mode(self.on_worker_failure, repr(self.on_worker_failure)),
            "receivers": Mode(self._receivers, repr(self.fanout), setting="fanout"),
        }

    @property
    def _receivers(self) -> ReceiversKind:
        return "sliced" if isinstance(self.fanout, Star) and self.fanout.slices else "whole"

    def round_choices(self) -> RoundChoices:
        return dataclasses.replace(
            super().round_choices(),
            route="chain" if isinstance(self.fanout, Chain) else "star",
            on_worker_failure="drop" if self.on_worker_failure == "drop" else "fail",
            receivers=self._receivers,
        )

    @property
    def tracks_members(self) -> bool:
        """Whether each worker is addressed on its own (its control calls and its data
        connection paired): a chain routes by member, and dropping needs the pairing."""
        return isinstance(self.fanout, Chain) or self.on_worker_failure == "drop"


@dataclass
class TcpWorkerInitInfo(LinkedWorkerInfo):
    """What a `"tcp"` worker receives at init: where to connect, the token, the plan."""

    topology: str = "star"
    """`"chain"`: receive from a predecessor and forward to a successor (see the
    trainer's `topology`)."""
    member: int = -1
    """This worker's number among the trainer's members, sent back after the
    handshake so the trainer pairs the connection with its control client; -1 (the
    default): not tracked, nothing is sent."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("topology", self.topology, TOPOLOGIES)
        if not isinstance(self.member, int) or isinstance(self.member, bool) or self.member < -1:
            raise ValueError(f"member should be an int >= -1, got {self.member!r}")
