"""Init and update infos shared by every pipelined backend (all the built-in ones)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .adapter import AdapterConfig, parse_adapter_config
from .config import MAX_NUM_BUFFERS, Timeouts, Tuning, check_group, refuse_moved
from .modes import Mode, check_modes
from .plan import DEFAULT_BUCKET_BYTES, TransferPlan
from .round_plan import Codec, RoundChoices
from .validate import (
    check_at_most,
    check_bool,
    check_int_in,
    check_positive,
    check_str,
    check_timeout,
)
from .worker_api import WeightTransferInitInfo, WeightTransferUpdateInfo

__all__ = [
    "API_KEY_ENV",
    "MAX_NUM_BUFFERS",
    "MAX_ROUND_ID",
    "MAX_TRAINER_ID_CHARS",
    "PipelineSettings",
    "RoundUpdateInfo",
    "WorkerPlanInfo",
    "check_trainer_id",
]

API_KEY_ENV = "ASYNCWT_API_KEY"
"""The environment variable holding the workers' API key: `asyncwt worker` reads it
(as `--api-key`), and so does `HttpClient` when given no `api_key`."""

MAX_ROUND_ID = 2**64 - 1
"""Round ids travel in frame headers as unsigned 64-bit integers."""


MAX_TRAINER_ID_CHARS = 128


def check_trainer_id(value: object) -> None:
    """`value` is a trainer id: a str of at most `MAX_TRAINER_ID_CHARS` characters."""
    check_str("trainer_id", value, max_chars=MAX_TRAINER_ID_CHARS)


@dataclass(kw_only=True)
class PipelineSettings:
    """Wire and pipeline settings every pipelined backend's trainer init info carries.

    A mixin: each backend's `TrainerInitInfo` subclass inherits these fields. The
    rarely-set ones come grouped (`Timeouts`, `Tuning`); a 0.1 flat name fails with
    a `TypeError` saying where it moved (`asyncwt._core.config.MOVED`).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        refuse_moved(cls.__name__, kwargs)
        return super().__new__(cls)

    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Size of one bucket: the unit of transfer and of staging memory."""
    num_buffers: int = 2
    """Buckets in flight on each side; staging memory is at most num_buffers × bucket_bytes."""
    device: str | None = None
    """Device for lanes and staging. `None` follows the source's tensors (a CPU model
    stays on the CPU, and a torch_dist trainer on gloo, even on a GPU host); a bare
    `"cuda"` is the current CUDA device of the thread that calls `trainer_init`."""
    partial: bool = False
    """Opt in to updating only part of the workers' models: the parameters the
    source yields are sent, and a worker keeps its own values of the others (its
    `weights_status` names them in `untouched_params`). Without it, a worker whose
    model has parameters the trainer never sends refuses the init, naming them:
    a version published with some weights stale is otherwise silent."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Every deadline of init and of a round (`Timeouts`)."""
    tuning: Tuning = field(default_factory=Tuning)
    """Rarely-set pipeline knobs: alignment, zero-copy sends, read-ahead (`Tuning`)."""

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if parent is not None:
            parent()
        check_bool("partial", self.partial)
        for name in ("bucket_bytes", "num_buffers"):
            check_positive(name, getattr(self, name))
        check_at_most("num_buffers", self.num_buffers, MAX_NUM_BUFFERS)
        check_group("timeouts", self.timeouts, Timeouts)
        check_group("tuning", self.tuning, Tuning)
        check_modes(self.modes(), built=True)

    def modes(self) -> dict[str, Mode]:
        """The fleet modes these settings choose, by setting (`asyncwt._core.modes`):
        each backend adds the ones it has."""
        return {}

    def round_choices(self) -> RoundChoices:
        """What a round plan is built from: who sends, by which route, with which codec
        (rank 0, star, raw here; a backend's settings that offer more say so)."""
        return RoundChoices()

    def worker_fields(self) -> dict[str, Any]:
        """The settings every worker receives at init (besides the plan)."""
        return {
            "num_buffers": self.num_buffers,
            "connect_timeout": self.timeouts.connect,
            "recv_timeout": self.timeouts.recv,
            "drain_timeout": self.timeouts.drain,
            "partial": self.partial,
        }


@dataclass
class WorkerPlanInfo(WeightTransferInitInfo):
    """What every pipelined worker receives at init: the plan and its limits."""

    plan: dict[str, Any]
    """`TransferPlan.to_wire()` of the trainer."""
    num_buffers: int = 2
    connect_timeout: float = 60.0
    recv_timeout: float = 300.0
    drain_timeout: float = 300.0
    trainer_id: str = ""
    """The trainer's id for this init (random, per `trainer_init`): every round's
    update info must name it. Empty from a trainer that sends none: then unchecked."""
    owners: dict[str, Any] | None = None
    """With `senders="owners"`: the ownership layout and every trainer rank's endpoint
    (see `asyncwt._worker.owners`); `None` when rank 0 sends everything."""
    partial: bool = False
    """The trainer sends only part of the model (`PipelineSettings.partial`): the
    worker's parameters outside the plan are left as they are, and reported. Else
    such parameters fail the init."""
    adapter: dict[str, Any] | None = None
    """The LoRA adapter the plan's tensors are (`AdapterConfig.to_wire()`): the worker
    installs them as that adapter instead of loading them into its model."""
    slices: bool = False
    """The trainer sends each worker only the boxes it holds: the worker declares
    them (its model's `asyncwt_layout`, see `asyncwt._worker.slices`) after the
    handshake, on every sending rank's link. A worker that holds everything whole
    declares that."""

    adapter_config: AdapterConfig | None = field(init=False, repr=False, compare=False)
    """`adapter` parsed (and checked) while parsing; None for model weights."""
    transfer_plan: TransferPlan = field(init=False, repr=False, compare=False)
    """The plan rebuilt from `plan` (and checked against its digest) while parsing, so
    that a malformed plan is the caller's error before any engine state changes."""

    def __post_init__(self) -> None:
        if not isinstance(self.plan, dict):
            raise ValueError(f"plan should be a dict, got {type(self.plan).__name__}")
        self.transfer_plan = TransferPlan.from_wire(self.plan)
        check_positive("num_buffers", self.num_buffers)
        check_at_most("num_buffers", self.num_buffers, MAX_NUM_BUFFERS)
        for name in ("connect_timeout", "recv_timeout", "drain_timeout"):
            check_timeout(name, getattr(self, name))
        check_trainer_id(self.trainer_id)
        check_bool("partial", self.partial)
        check_bool("slices", self.slices)
        if self.slices and self.adapter is not None:
            raise ValueError(
                "slices are sent only for model weights: adapter should be None with slices=True"
            )
        if self.owners is not None and not isinstance(self.owners, dict):
            raise ValueError(f"owners should be a dict or None, got {type(self.owners).__name__}")
        self.adapter_config = None if self.adapter is None else parse_adapter_config(self.adapter)
        if self.adapter_config is not None and self.owners is not None:
            raise ValueError("adapter rounds are sent by rank 0: owners should be None")

    @property
    def codec(self) -> Codec:
        """How the trainer codes rounds: raw, unless a backend's info says delta."""
        return "raw"


@dataclass
class RoundUpdateInfo(WeightTransferUpdateInfo):
    """One round, announced to a worker: its number and the plan it follows."""

    round_id: int
    plan_digest: str
    trainer_id: str = ""
    """The id of the trainer sending the round (see `WorkerPlanInfo.trainer_id`)."""

    def __post_init__(self) -> None:
        check_trainer_id(self.trainer_id)
        check_int_in("round_id", self.round_id, 1, MAX_ROUND_ID)
        check_str("plan_digest", self.plan_digest, min_chars=64, max_chars=64)
