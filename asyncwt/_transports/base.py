"""The transport interface: what every backend's data plane provides to the engines.

A backend is a pair: a `SenderTransport` driven by the trainer's pipeline and
round protocol (`PipelinedTrainerEngine`), and a `ReceiverTransport` driven by the
worker's deferred engine (`DeferredWorkerEngine`). Everything else (plan, pipeline,
validation, deferred apply, versions) is shared, so a new transport gets the whole
behaviour and test suite for free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .._core.plan import Bucket
from .._trainer.pipeline import Segment, Settle
from .._worker.applier import ModelTarget

__all__ = ["ReceivedBucket", "ReceiverTransport", "SenderTransport"]

InitWorkers = Callable[[dict[str, Any]], Awaitable[None]]


class SenderTransport(ABC):
    """Trainer side of a data plane (rank 0 only): delivers every bucket to every worker."""

    min_view_bytes: int | None = None
    """Slices at least this long may reach `send_bucket` as segments that point into
    the source's own (CPU) tensors; shorter ones, and all with `None`, are packed."""

    in_flight_buckets: int = 1
    """Buckets that may be in flight at once: above 1, `send_bucket` may return a
    `Settle` instead of waiting until the bucket's segments are no longer read."""

    def staging(self, slot: int) -> torch.Tensor | None:
        """The transport's own buffer for pipeline slot `slot`, or `None` for the pool's."""
        return None

    async def reclaim(self, slot: int) -> None:
        """Wait until every worker released what `slot` held; a no-op by default."""

    @abstractmethod
    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        """Open the endpoint; call `init_workers(init_info)` (the control-plane RPC)
        with `worker_fields` plus the transport's own; admit the workers it brings."""

    @property
    @abstractmethod
    def num_workers(self) -> int:
        """Workers admitted at rendezvous."""

    def check_usable(self) -> None:
        """Raise `TransferError` if a connection is known to be broken."""

    @abstractmethod
    async def begin_round(self, round_id: int) -> None:
        """Return once every worker is receiving round `round_id`."""

    @abstractmethod
    async def send_bucket(
        self, bucket: Bucket, slot: int, segments: list[Segment]
    ) -> Settle | None:
        """Deliver `bucket` (its payload is `segments`, packed in `slot` if staged;
        device segments when `staging(slot)` is device memory).

        Returns `None` once the segments may be reused, or (with `in_flight_buckets`
        above 1) a `Settle` the pipeline awaits before it reuses them.
        """

    @abstractmethod
    async def end_round(self) -> None:
        """Tell every worker the round's last bucket was sent."""

    @abstractmethod
    async def abort_round(self, reason: str) -> None:
        """Tell every worker the round is off. Never raises."""

    @abstractmethod
    def close(self) -> None:
        """Release every connection and buffer. Idempotent."""


@dataclass
class ReceivedBucket:
    """One bucket on the worker: where its bytes are, and how to give them back."""

    bucket: Bucket
    buffer: torch.Tensor | None
    """Bytes of the slices not received in place, at their plan offsets."""
    release: Callable[[], None]
    """Call when the last reader of `buffer` is done."""


class ReceiverTransport(ABC):
    """Worker side of a data plane (synchronous: vLLM calls from a worker thread)."""

    lands_in_place: bool = True
    """Whether it may write a parameter's bytes straight into the model (where the
    model takes them as they are); else every bucket arrives in a buffer it owns
    and the applier copies out of it. Known once the receiver is made."""

    @abstractmethod
    def connect(self) -> None:
        """Join the trainer (during `init_transfer_engine`)."""

    @abstractmethod
    def receive_round(self, round_id: int, target: ModelTarget) -> Iterator[ReceivedBucket]:
        """Yield every bucket of `round_id` in order, as it arrives.

        Raises `TransferAbortedError` when the trainer aborts, `TransferTimeoutError`
        when it goes quiet, other `TransferError`s when the connection fails (after
        which `usable` is false and a new init is needed).
        """

    @property
    def usable(self) -> bool:
        """Whether another round can be received without a new init."""
        return True

    @abstractmethod
    def close(self) -> None:
        """Disconnect and release every resource; wakes a blocked receive. Idempotent."""
