"""The transport interface: what every backend's data plane provides to the engines.

A backend is a pair: a `SenderTransport` driven by the trainer's pipeline and
round protocol (`PipelinedTrainerEngine`), and a `ReceiverTransport` driven by the
worker's deferred engine (`DeferredWorkerEngine`). Everything else (plan, pipeline,
validation, deferred apply, versions) is shared, so a new transport gets the whole
behaviour and test suite for free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._core.plan import Bucket
from .._core.receiver_layout import ReceiverLayout

__all__ = [
    "InitWorkers",
    "LandingTarget",
    "ReceiveBuffers",
    "ReceivedBucket",
    "ReceiverTransport",
    "Segment",
    "SenderTransport",
    "Settle",
]

Segment = torch.Tensor
"""A byte range of a bucket's payload: a 1-D uint8 view of a source tensor or of a
staging buffer, on the host or on a device. Senders that write to sockets take
`byte_view(segment)` (host segments only); device senders use the tensor itself."""

Settle = Callable[[], Awaitable[None]]
"""What `send_bucket` returns for a bucket it left in flight: awaiting it returns
once nothing reads the bucket's segments any more, and raises if delivery failed."""

InitWorkers = Callable[[dict[str, Any]], Awaitable[None]]
"""The control-plane call that inits every worker with the given init info."""


class LandingTarget(Protocol):
    """What a receiver may write into: the model's parameters, by plan index.

    The worker's applier provides it (`ModelTarget`); a receiver uses nothing else
    of the model.
    """

    @property
    def direct(self) -> Sequence[bool]:
        """Per plan parameter: whether its bytes may be received straight into the
        model (at `landing_view`), rather than into a buffer for the applier."""
        ...

    @property
    def hands_out_buffers(self) -> bool:
        """Whether applying gives user code (a transform, `load_weights`) views of the
        receive buffer: then a receiver whose buffers other processes map (a shared
        ring slot) copies each bucket into memory of this worker first."""
        ...

    def landing_view(self, index: int) -> memoryview:
        """The writable bytes of plan parameter `index` in the model (where `direct`)."""
        ...


class SenderTransport(ABC):
    """Trainer side of a data plane (rank 0 only): delivers every bucket to every worker."""

    min_view_bytes: int | None = None
    """Slices at least this long may reach `send_bucket` as segments that point into
    the source's own CPU tensors (scatter-gather sends); shorter ones, and every
    slice when `None`, are packed into `staging(slot)` or the pipeline's pool. Read
    once the round is open (`begin_round` may set it)."""

    in_flight_buckets: int = 1
    """Buckets that may be in flight at once (see `send_bucket`); 1 for a transport
    whose `send_bucket` always returns `None`."""

    own_staging: bool = False
    """Whether every slot is packed into `staging(slot)` (never `None`): the
    pipeline's pool then stays unallocated."""

    round_wire_bytes: int | None = None
    """Bytes the last round put on the wire to each worker where a codec made them
    differ from the plan's payload (delta rounds); None: the payload as planned."""

    def staging(self, slot: int) -> torch.Tensor | None:
        """The transport's own buffer for pipeline slot `slot` (shared memory, say),
        or `None` to pack into the pipeline's pool."""
        return None

    def receiver_layouts(self) -> Sequence[ReceiverLayout] | None:
        """What each worker declared it holds at `rendezvous`, in the order of its
        links, where workers hold slices (sliced receivers); None where each holds
        the plan whole. The engine records them in its round plan."""
        return None

    def prepare(self) -> None:
        """Allocate, pin or register what the rounds will pack into, once, at init
        (called in a worker thread before `rendezvous`: it may take a while, and
        must not stall the event loop). Nothing by default."""

    async def reclaim(self, slot: int) -> None:
        """Wait until `staging(slot)` may be overwritten (every worker released what
        it held); the pipeline calls it before it packs into `slot`. A no-op by default."""

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
        """Deliver `bucket`'s payload, one segment per slice (packed in `slot` if
        staged; device segments when `staging(slot)` is device memory).

        Returns `None` once the segments may be reused. Or, with `in_flight_buckets`
        above 1, a `Settle`: the segments stay valid (their slot held, their tensors
        alive) until it returns, and the pipeline awaits it before more than
        `in_flight_buckets` buckets are out.
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
    header: object | None = None
    """Opaque to the transport: what a codec layer read with a bucket it coded
    (`asyncwt._transports.link.FrameCodec`), for the same layer's apply step;
    `buffer` then holds what the codec says. None for a plain bucket."""


class ReceiveBuffers(Protocol):
    """The worker's receive buffers, as a receiver (or a codec layer) uses them."""

    def take(self) -> tuple[torch.Tensor, Callable[[], None]]:
        """A free bucket-sized buffer and the function that releases it."""
        ...

    def landing(
        self, bucket: Bucket, target: LandingTarget
    ) -> tuple[torch.Tensor | None, Callable[[], None], list[memoryview]]:
        """Where each slice of `bucket` is received (in place where `target` allows),
        the buffer taken for the rest (or None), and its release."""
        ...


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
    def receive_round(self, round_id: int, target: LandingTarget) -> Iterator[ReceivedBucket]:
        """Yield every bucket of `round_id` in order, as it arrives, each slice
        straight into `target` where `target.direct` says so (with `lands_in_place`).

        Raises `TransferAbortedError` when the trainer aborts, `TransferTimeoutError`
        when it goes quiet, other `TransferError`s when the connection fails (after
        which `usable` is false and a new init is needed).
        """

    @property
    def usable(self) -> bool:
        """Whether another round can be received without a new init."""
        return True

    def abandon(self) -> None:
        """A new round starts: wake a receive still blocked on an older one (it then
        fails) without breaking what the next round needs. A no-op by default."""

    @abstractmethod
    def close(self) -> None:
        """Disconnect and release every resource; wakes a blocked receive. Idempotent."""
