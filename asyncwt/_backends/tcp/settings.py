"""Init infos of the `"tcp"` backend, both sides."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..._core.round_plan import RoundChoices
from ..._core.settings import RoundUpdateInfo
from ..._core.trainer_api import TrainerInitInfo
from ..._transports.link_settings import LinkedTrainerInfo, LinkedWorkerInfo

__all__ = ["TcpTrainerInitInfo", "TcpUpdateInfo", "TcpWorkerInitInfo"]

TcpUpdateInfo = RoundUpdateInfo

TOPOLOGIES = ("star", "chain")
FAILURE_POLICIES = ("fail", "drop")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} should be one of {list(choices)}, got {value!r}")


@dataclass
class TcpTrainerInitInfo(LinkedTrainerInfo, TrainerInitInfo):
    """Trainer-side settings of the `"tcp"` backend: rank 0 listens, workers connect,
    and every bucket streams to the workers over their connections."""

    backend: ClassVar[str] = "tcp"

    topology: str = "star"
    """How the bytes reach the workers. `"star"`: the trainer sends every bucket to
    every worker over its own connection (the trainer's link carries the model once
    per worker). `"chain"`: the trainer sends each byte once, to the first worker;
    each worker forwards what it receives to the next as it arrives, while it applies
    it (the trainer's link carries the model once whatever the number of workers).
    See `asyncwt._backends.tcp.relay`."""
    on_worker_failure: str = "fail"
    """What a worker that dies mid-round does to the round. `"fail"`: the round fails
    everywhere and no worker publishes. `"drop"`: the worker is cut out, the round
    runs again on the survivors, who publish; `RoundStats.dropped` names it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("topology", self.topology, TOPOLOGIES)
        _check_choice("on_worker_failure", self.on_worker_failure, FAILURE_POLICIES)
        if self.delta and self.tracks_members:
            raise ValueError(
                f"delta should be False with topology={self.topology!r} and "
                f"on_worker_failure={self.on_worker_failure!r} (delta rounds need the "
                f"untracked star: topology='star', on_worker_failure='fail'), got True"
            )
        if self.senders == "owners" and self.on_worker_failure == "drop":
            raise ValueError(
                "on_worker_failure should be 'fail' with senders='owners' (a dropped "
                "worker's round runs again on rank 0 alone), got 'drop'"
            )

    def round_choices(self) -> RoundChoices:
        return dataclasses.replace(
            super().round_choices(),
            route="chain" if self.topology == "chain" else "star",
            on_worker_failure="drop" if self.on_worker_failure == "drop" else "fail",
        )

    @property
    def tracks_members(self) -> bool:
        """Whether each worker is addressed on its own (its control calls and its data
        connection paired): a chain routes by member, and dropping needs the pairing."""
        return self.topology == "chain" or self.on_worker_failure == "drop"


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
