"""The `"torch_dist"` backend: bucket broadcasts over a dedicated torch.distributed group.

Rank 0 of the trainer and every worker form a process group of their own (gloo on
the CPU, NCCL on CUDA), built directly from a `TCPStore` that rank 0 hosts, so the
trainer's default group (FSDP's) is never touched. The authenticated link of the
`"tcp"` backend carries the round protocol (READY, per-bucket headers, END, ABORT);
the payload of each bucket follows as broadcasts. Because every collective is
preceded by a header on the link, an aborted round never leaves the two sides out
of step. The group's timeout turns a dead peer into an error instead of a hang.

Over gloo a slice of at least `DIRECT_BROADCAST_BYTES` is broadcast on its own,
straight from the trainer's tensor and (where the worker's parameter can take the
bytes as they are) straight into the worker's parameter; the small slices between
them are packed and broadcast together. Both sides derive the same broadcasts from
the plan (`broadcast_units`). Over NCCL every bucket is packed on the device and
broadcast once.

Two buckets are on the wire at once (`IN_FLIGHT_BUCKETS`): the trainer starts a
bucket's broadcasts and returns a `Settle` to the pipeline instead of waiting for
them, and the worker, while a bucket's broadcasts run, watches the link for the
next header and starts that bucket's too, so the connection does not idle
between buckets.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import functools
import logging
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from .._core.errors import TransferAbortedError, TransferError, TransferTimeoutError
from .._core.lanes import staging_buffer, wait_for_stream
from .._core.plan import Bucket, Slice, TransferPlan
from .._core.trainer_api import TrainerInitInfo
from .._core.validate import check_int_in, check_port, check_positive, check_str
from .._trainer.engine import trainer_engine_class
from .._transports.backend import ReceiveContext, TransportBackend
from .._transports.base import (
    InitWorkers,
    LandingTarget,
    ReceivedBucket,
    ReceiverTransport,
    Segment,
    Settle,
)
from .._transports.link import LinkedSender, WorkerLink, connect_link
from .._transports.link_settings import LinkedTrainerInfo, LinkedWorkerInfo
from .._transports.pool import ReceivePool
from .._transports.sockio import readable
from .._transports.wire import Frame, FrameKind
from .._worker.engine import worker_engine_class
from .torch_dist_store import StoreClient, StoreServer, store_digest

__all__ = [
    "TorchDistReceiver",
    "TorchDistSender",
    "TorchDistTrainerEngine",
    "TorchDistTrainerInitInfo",
    "TorchDistWorkerEngine",
    "TorchDistWorkerInitInfo",
]

_PG_BACKENDS = ("gloo", "nccl")

DIRECT_BROADCAST_BYTES = 1 << 20
"""Over gloo, a slice at least this long is broadcast on its own, without a packing
copy on the trainer or an unpacking copy on the worker; shorter ones are packed
(one collective per tiny tensor would cost more than the copies)."""

IN_FLIGHT_BUCKETS = 2
"""Buckets whose broadcasts may be on the wire at once (both sides): the next
bucket's start before the last one's end, so no gap opens between buckets."""

logger = logging.getLogger("asyncwt")


class BroadcastUnit(NamedTuple):
    """One broadcast of a bucket's payload."""

    slices: tuple[Slice, ...]
    """One slice (`direct`), or a run of short slices packed together."""
    direct: bool
    """Whether it goes straight from the trainer's tensor (and, where the model takes
    the bytes as they are, straight into the worker's parameter)."""

    @property
    def packed_range(self) -> slice:
        """Where a packed run sits in a bucket-sized buffer, padding included."""
        return slice(self.slices[0].offset, self.slices[-1].offset + self.slices[-1].nbytes)


def broadcast_units(bucket: Bucket, direct_bytes: int | None) -> list[BroadcastUnit]:
    """The broadcasts that carry `bucket`, in order: each slice of at least
    `direct_bytes` on its own, each run of shorter slices between them packed.
    `None` packs the whole bucket into one broadcast. Both sides derive the same
    list from the plan."""
    units: list[BroadcastUnit] = []
    run: list[Slice] = []
    for s in bucket.slices:
        if s.nbytes == 0:
            continue
        if direct_bytes is not None and s.nbytes >= direct_bytes:
            if run:
                units.append(BroadcastUnit(tuple(run), direct=False))
                run = []
            units.append(BroadcastUnit((s,), direct=True))
        else:
            run.append(s)
    if run:
        units.append(BroadcastUnit(tuple(run), direct=False))
    return units


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of `device`'s GPU (the same in every process, whatever
    `CUDA_VISIBLE_DEVICES` numbers it), or None off CUDA or when torch cannot say."""
    if device.type != "cuda":
        return None
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError, AssertionError):
        return None


def check_gpu_uuid(name: str, value: object) -> None:
    """`value` is `None` or what `gpu_uuid` returns: a str of 1-64 characters."""
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= 64):
        raise ValueError(f"{name} should be None or a GPU UUID of 1-64 characters, got {value!r}")


def _group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


_WILDCARDS = ("", "0.0.0.0", "::")

WATCHDOG_MARGIN_S = 60.0
"""How much longer than asyncwt's own timeout torch's NCCL group timeout is.

asyncwt waits for every collective with its timeout (`_wait_all`); torch's watchdog
(the process's settings: by default it tears the process down on a timeout) uses
the group's. The margin lets asyncwt's wait time out first and abort the group,
which stops the watchdog, instead of the watchdog killing the trainer or the
worker. No environment variable is set: torch reads `TORCH_NCCL_*` with `getenv`
while NCCL's and vLLM's threads run, and setting one from a thread races them
(see `watchdog_may_tear_down` for what the process's own settings should be)."""

_TEARDOWN_WARNED = threading.Event()


def watchdog_may_tear_down(environ: Mapping[str, str]) -> bool:
    """Whether, under the process environment `environ`, torch's NCCL watchdog takes
    the process down when a collective of asyncwt's group fails (a peer died).

    Only a process started with `TORCH_NCCL_BLOCKING_WAIT=1` (no watchdog: the
    failure is raised in asyncwt's wait) or `TORCH_NCCL_ASYNC_ERROR_HANDLING` 0 or
    2 (the watchdog never kills) is safe; torch reads both when a group is made.
    """
    if environ.get("TORCH_NCCL_BLOCKING_WAIT", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    return environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3").strip() not in ("0", "2")


def _warn_if_watchdog_may_tear_down() -> None:
    """Say once, when an NCCL group is made, that a peer's failure could kill this
    process, and how to launch it so that it cannot."""
    if watchdog_may_tear_down(os.environ) and not _TEARDOWN_WARNED.is_set():
        _TEARDOWN_WARNED.set()
        logger.warning(
            "torch_dist over NCCL: this process was started without "
            "TORCH_NCCL_BLOCKING_WAIT=1 (or TORCH_NCCL_ASYNC_ERROR_HANDLING=2), so torch's "
            "NCCL watchdog would take the whole process down if a peer of asyncwt's group "
            "fails; set it in the environment the process starts with (asyncwt does not "
            "set it at run time: setting a variable races other threads reading one)"
        )


def _nccl_options(timeout: datetime.timedelta) -> Any:
    """The NCCL group's options: the watchdog's timeout `WATCHDOG_MARGIN_S` past
    asyncwt's. The communicator's own settings are torch's (a non-blocking init is
    one Python cannot wait on: the first collective fails "in progress")."""
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout + datetime.timedelta(seconds=WATCHDOG_MARGIN_S)
    return options


def _probe(group: Any, device: torch.device, side: torch.cuda.Stream, timeout: float) -> None:
    """Broadcast one element and wait for it within `timeout`: torch makes the
    communicator at a group's first collective, and its completion proves every
    rank joined (a made communicator alone proves no peer alive)."""
    with torch.cuda.stream(side):
        token = torch.zeros(1, dtype=torch.uint8, device=device)
    _wait_all(_start_all(group, [token], side), side, timeout)


def _new_nccl_group(
    store: dist.Store,
    rank: int,
    size: int,
    timeout: float,
    device: torch.device,
    side: torch.cuda.Stream,
) -> dist.ProcessGroup:
    """An NCCL group on `device` (with its index), its communicator made and proved
    now (`_probe`), not at the first bucket: a peer that died after READY fails the
    group's creation within `timeout`, and NCCL's buffers are allocated here, where
    an out-of-memory error names the group."""
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device should be a CUDA device with its index for NCCL, got {device}")
    torch.cuda.set_device(device)
    _warn_if_watchdog_may_tear_down()
    delta = datetime.timedelta(seconds=timeout)
    group = dist.ProcessGroupNCCL(store, rank, size, _nccl_options(delta))
    try:
        _probe(group, device, side, timeout)
    except BaseException:
        _release_group(group)
        raise
    return group


class _Formation:
    """A group being made on a thread of its own, which the caller may give up on."""

    def __init__(self, create: Callable[[], dist.ProcessGroup]) -> None:
        self._create = create
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        self.group: dist.ProcessGroup | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            group = self._create()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
            group = None
        with self._lock:
            abandoned = self._abandoned
            if not abandoned:
                self.group = group
        if abandoned:
            _release_group(group)  # nobody will: the caller gave up on it
        self._done.set()

    def wait(self, timeout: float) -> bool:
        """Whether the group was made (or failed) within `timeout`; if not, it is
        given up, and released whenever its thread returns."""
        if self._done.wait(timeout):
            return True
        with self._lock:
            self._abandoned = self.group is None and self.error is None
            return not self._abandoned


FORM_GRACE_S = 5.0
"""How long past its timeout a group's formation is waited for before it is given up
(its own waits time out first; only a creation that never returns hits this)."""


def _form_within(create: Callable[[], dist.ProcessGroup], timeout: float) -> dist.ProcessGroup:
    """`create()` on a thread of its own, waited for at most `timeout` (+ a grace).

    A blocking NCCL communicator init (torch makes it at the group's first
    collective) has no timeout: a peer that never joins would hold the caller for
    ever. Past the limit the group is given up (its thread releases it if it ever
    returns) and `TransferTimeoutError` raised.
    """
    formation = _Formation(create)
    thread = threading.Thread(target=formation.run, name="asyncwt-group", daemon=True)
    thread.start()
    if not formation.wait(timeout + FORM_GRACE_S):
        raise TransferTimeoutError(
            f"the torch_dist group did not form within {timeout}s (a peer did not join: "
            f"it died, or cannot reach this host)"
        )
    if formation.error is not None:
        raise formation.error
    assert formation.group is not None
    return formation.group


def _new_group(
    backend: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout: float,
    device: torch.device,
    address: str | None = None,
    side: torch.cuda.Stream | None = None,
) -> dist.ProcessGroup:
    """A process group of its own over `store` (the default group is left alone).

    A gloo group listens on `address` (the interface the link uses), not on whatever
    the host name resolves to; `None` or a wildcard leaves gloo's default. An NCCL
    group runs its collectives on `side` (`_side_stream`).
    """
    delta = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        if side is None:
            side = _side_stream(device)
        return _new_nccl_group(store, rank, size, timeout, device, side)
    if address is None or address in _WILDCARDS:
        return dist.ProcessGroupGloo(store, rank, size, delta)
    gloo_options = dist.ProcessGroupGloo._Options()
    gloo_options._timeout = delta
    gloo_options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, gloo_options)


def _store_listener(host: str, port: int) -> int:
    """A listening socket on `host` for the group's store, as a file descriptor.

    `TCPStore(is_master=True)` would listen on every interface whatever `host` says;
    handing it a socket bound here keeps it on the link's address (loopback by
    default). The store owns the descriptor from then on.
    """
    listener = socket.create_server((host, port), backlog=128)
    return listener.detach()


def _release_group(group: Any) -> None:
    """Abort `group` now, closing its connections, instead of whenever it is collected
    (a traceback that mentions it could keep it alive, and its sockets open)."""
    if group is not None:
        with contextlib.suppress(Exception):
            group.abort()


def _timed_out(exc: BaseException) -> bool:
    """Whether a collective failed by timing out (rather than by a peer leaving)."""
    return "timed out" in str(exc).lower() or "timeout" in str(exc).lower()


def _start_broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


def _wait_all(
    works: list[dist.Work], side: torch.cuda.Stream | None = None, timeout: float | None = None
) -> None:
    """Wait for every one of `works`, even after one fails (none may still be reading
    or writing a buffer once this returns), then raise the first failure.

    `timeout`: each wait holds the host until its collective is over or `timeout`
    seconds after it started, then raises (torch then aborts the communicator).
    Given explicitly, it needs no `TORCH_NCCL_BLOCKING_WAIT`; torch's own group
    timeout is later (`WATCHDOG_MARGIN_S`).

    `side`: the stream of the NCCL group's device its collectives start on (one per
    sender or receiver, not per bucket). NCCL's `wait` also orders the calling
    thread's current stream after the collective; but a trainer's staging slot is
    packed again on another stream, and a worker's receive buffer is read by apply
    threads on theirs. So the waits go to `side` (not the default stream, where
    training or inference kernels may be queued), and the host sleeps until that
    stream is done: on return the collectives are over, for every stream.

    Empties `works`: a traceback that keeps the list must not keep the group (and
    its sockets) alive.
    """
    first: RuntimeError | None = None
    limit = () if timeout is None else (datetime.timedelta(seconds=timeout),)
    try:
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for work in works:
                try:
                    work.wait(*limit)
                except RuntimeError as exc:  # DistError is a RuntimeError
                    first = first or exc
        if side is not None:
            wait_for_stream(side)
    finally:
        works.clear()
    if first is not None:
        raise first


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream an NCCL sender or receiver waits for its broadcasts on."""
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device should be a CUDA device with its index for NCCL, got {device}")
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def _start_all(
    group: dist.ProcessGroup, tensors: list[torch.Tensor], side: torch.cuda.Stream | None
) -> list[dist.Work]:
    """Start broadcasting `tensors`, in order, without waiting for any of them.

    Waiting for each collective before starting the next would leave the
    connection idle between them. Every rank starts the same broadcasts in the same
    order, so they pair up. Under NCCL they start with `side` current: NCCL's
    stream first waits for the caller's current stream, and a thread's current
    stream is otherwise the default one, where training or inference kernels queue
    (every bucket would wait for them). What the broadcasts read or write is ready
    on the host's word already (the pipeline waited for its packing; a receive
    buffer's last reader synchronized before releasing it).
    """
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        return [_start_broadcast(group, tensor) for tensor in tensors]


@dataclass(kw_only=True)
class TorchDistTrainerInitInfo(LinkedTrainerInfo, TrainerInitInfo):
    """Trainer-side settings of the `"torch_dist"` backend.

    `host`/`port` are the link's listener (as for `"tcp"`); the group's store listens
    on `host` too, on `store_port`.
    """

    backend: ClassVar[str] = "torch_dist"

    num_workers: int = 1
    """Workers that will join: a collective group has a fixed size."""
    store_port: int = 0
    """Port of the group's rendezvous store (which admits only workers that prove the
    token); 0 picks a free one."""
    group_backend: str | None = None
    """`"gloo"` or `"nccl"`; `None` picks NCCL for a CUDA device, else gloo."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("num_workers", self.num_workers)
        check_port("store_port", self.store_port, allow_zero=True)
        if self.group_backend is not None and self.group_backend not in _PG_BACKENDS:
            raise ValueError(
                f"group_backend should be one of {_PG_BACKENDS} or None, got {self.group_backend!r}"
            )


@dataclass
class TorchDistWorkerInitInfo(LinkedWorkerInfo):
    """What a `"torch_dist"` worker receives: the link, and how to join the group."""

    store_port: int = 0
    group_key: str = ""
    world_size: int = 2
    group_backend: str = "gloo"
    direct_bytes: int | None = None
    """Slices at least this long are broadcast on their own (`broadcast_units`)."""
    trainer_gpu: str | None = None
    """UUID of rank 0's GPU under NCCL (`gpu_uuid`), which refuses two ranks on one
    GPU: a worker on the same one fails its init saying so, not the first round."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_port("store_port", self.store_port)
        check_gpu_uuid("trainer_gpu", self.trainer_gpu)
        check_int_in("world_size", self.world_size, 2)
        check_str("group_key", self.group_key, min_chars=32, max_chars=32)
        if self.group_backend not in _PG_BACKENDS:
            raise ValueError(
                f"group_backend should be one of {_PG_BACKENDS}, got {self.group_backend!r}"
            )
        if self.direct_bytes is not None:
            check_positive("direct_bytes", self.direct_bytes)


class TorchDistSender(LinkedSender):
    """Headers over the link, each bucket's payload as broadcasts from rank 0."""

    def __init__(
        self, info: TorchDistTrainerInitInfo, plan: TransferPlan, device: torch.device
    ) -> None:
        super().__init__(info.link_settings(), plan)
        self.info = info
        self.plan = plan
        self.device = device
        self.group_backend = info.group_backend or _group_backend(self.device)
        if self.group_backend == "nccl" and self.device.type != "cuda":
            raise ValueError(
                f"group_backend is 'nccl' but the trainer's device is {self.device}; set "
                f"device to a CUDA device, or use gloo"
            )
        self.min_view_bytes = DIRECT_BROADCAST_BYTES if self.group_backend == "gloo" else None
        self._side = _side_stream(self.device) if self.group_backend == "nccl" else None
        """Where the host waits for the broadcasts under NCCL (`_wait_all`)."""
        self.in_flight_buckets = IN_FLIGHT_BUCKETS
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        self.store_server: StoreServer | None = None
        self.group_key = ""
        self._staging: list[torch.Tensor | None] = [None] * info.num_buffers

    own_staging = True

    def staging(self, slot: int) -> torch.Tensor:
        """The buffer a broadcast sends from: device memory for NCCL, host for gloo
        (pinned when the trainer's device is a GPU: its copies out of the device then
        run on the copy engines, queued, instead of holding a thread)."""
        buffer = self._staging[slot]
        if buffer is None:
            if self.group_backend == "nccl":
                buffer = torch.empty(self.plan.bucket_bytes, dtype=torch.uint8, device=self.device)
            else:
                buffer = staging_buffer(self.plan.bucket_bytes, self.device)
            self._staging[slot] = buffer
        return buffer

    def prepare(self) -> None:
        """Allocate every slot's staging now (see `SenderTransport.prepare`)."""
        for slot in range(len(self._staging)):
            self.staging(slot)

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        """Host the group's store and admit the workers over the link.

        The group itself forms at the first round, once every worker is READY: a
        failed init (a wrong token, say) then fails fast instead of waiting for a
        collective rendezvous that cannot complete.
        """
        info = self.info
        # The store admits only workers that prove the token (see `_store`): a
        # TCPStore would list its keys, and take writes, from anyone who reaches it.
        self.store_server = StoreServer(
            info.listen.host,
            info.store_port,
            token=info.token,
            digest=store_digest(self.plan.digest),
            timeout=info.timeouts.connect,
            handshake_timeout=min(info.timeouts.handshake, info.timeouts.connect),
            max_pending=info.listen.max_pending_handshakes,
            max_peers=info.num_workers,
        )
        await self.store_server.start()
        self.store = self.store_server.local_store()
        self.group_key = secrets.token_hex(16)
        fields = {
            **worker_fields,
            "store_port": self.store_server.port,
            "group_key": self.group_key,
            "world_size": info.num_workers + 1,
            "group_backend": self.group_backend,
            "direct_bytes": self.min_view_bytes,
            "trainer_gpu": gpu_uuid(self.device) if self.group_backend == "nccl" else None,
        }
        await super().rendezvous(fields, init_workers)
        if len(self.links.peers) != info.num_workers:
            raise TransferError(
                f"num_workers is {info.num_workers} but {len(self.links.peers)} worker(s) joined"
            )

    async def _form_group(self) -> dist.ProcessGroup:
        if self.group is None:
            assert self.store is not None
            create = functools.partial(
                _new_group,
                self.group_backend,
                dist.PrefixStore(f"asyncwt/{self.group_key}/", self.store),
                0,
                self.info.num_workers + 1,
                self.info.timeouts.send,
                self.device,
                self.info.listen.advertise_host or self.info.listen.host,
                self._side,
            )
            # Shielded (a rendezvous in flight cannot be abandoned half-way), and
            # bounded: `_form_within` gives up past the timeout.
            with anyio.CancelScope(shield=True):
                try:
                    self.group = await anyio.to_thread.run_sync(
                        _form_within, create, self.info.timeouts.send
                    )
                except BaseException:
                    self.store = None  # the group's key is spent: trainer_init again
                    raise
        return self.group

    def check_usable(self) -> None:
        super().check_usable()
        if self.store is None:
            raise TransferError("the torch_dist group is gone; call trainer_init again")

    async def begin_round(self, round_id: int) -> None:
        await super().begin_round(round_id)
        await self._form_group()

    async def abort_round(self, reason: str) -> None:
        """Send ABORT; if the round ended before the group formed, form it now.

        That happens when the first round fails while the workers' READY is awaited.
        A worker whose `update_weights` arrives sends READY and then waits in the
        group's rendezvous before it reads the ABORT: joining it lets the worker
        read the ABORT at once instead of after its `recv_timeout`. When the group
        cannot form (a worker never came), the transport is marked unusable.
        """
        await super().abort_round(reason)
        if self.group is None and self.store is not None:
            try:
                await self._form_group()
            except (RuntimeError, OSError, TransferError) as exc:  # DistError is a RuntimeError
                logger.warning("the torch_dist group did not form after the abort: %r", exc)
                self.store = None

    async def send_bucket(self, bucket: Bucket, slot: int, segments: list[Segment]) -> Settle:
        """Send the header, start the bucket's broadcasts, and return without waiting
        for them: the next bucket's broadcasts start while these are on the wire."""
        header = self.links.frame(
            FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes, slot=slot
        )
        staging = self.staging(slot)
        segment_of = dict(zip(bucket.slices, segments))
        payloads = [
            segment_of[unit.slices[0]] if unit.direct else staging[unit.packed_range]
            for unit in broadcast_units(bucket, self.min_view_bytes)
        ]
        assert self.group is not None
        # A header and its broadcasts are one unit: once the header is out, every
        # worker waits in the collectives, so a cancellation in between would strand
        # them there until their timeout. The header is bounded by send_timeout, the
        # collectives by the group's; the abort after a cancellation finds both sides
        # in step once the pipeline settled every bucket in flight.
        with anyio.CancelScope(shield=True):
            await self.links.each(self.links.send_header, header, f"bucket {bucket.index}")
            try:
                works = await anyio.to_thread.run_sync(_start_all, self.group, payloads, self._side)
            except RuntimeError as exc:
                raise self._broadcast_failed(bucket, exc) from exc.with_traceback(None)

        async def settle() -> None:
            try:
                await anyio.to_thread.run_sync(
                    _wait_all, works, self._side, self.info.timeouts.send
                )
            except RuntimeError as exc:
                raise self._broadcast_failed(bucket, exc) from exc.with_traceback(None)

        return settle

    def _broadcast_failed(self, bucket: Bucket, exc: RuntimeError) -> TransferError:
        """Mark the group unusable (a new trainer_init is needed), close its sockets
        now rather than when the engine does, and describe the failure."""
        self.store = None
        self._leave_group()
        error = TransferTimeoutError if _timed_out(exc) else TransferError
        return error(
            f"round {self.links.round_id}: broadcasting bucket {bucket.index} failed "
            f"(a worker left the group, or stalled past the group timeout of "
            f"timeouts.send={self.info.timeouts.send}s): {exc}; call trainer_init again to "
            f"reconnect"
        )

    def _leave_group(self) -> None:
        group, self.group = self.group, None
        _release_group(group)

    def close(self) -> None:
        super().close()
        self._leave_group()
        self.store = None
        if self.store_server is not None:
            self.store_server.close()
            self.store_server = None
        if self._side is not None and any(b is not None for b in self._staging):
            # A cancelled round may have left broadcasts that read the device staging
            # queued: free it only once the stream that waits for them is past them
            # (that stream only: the trainer's own kernels are not asyncwt's to wait for).
            with contextlib.suppress(RuntimeError):
                wait_for_stream(self._side)
        self._staging = [None] * len(self._staging)


_POLL_S = 0.001
"""How long the worker waits for the next header at a time while a bucket's
broadcasts are on the wire, before checking whether they completed."""


@dataclass(eq=False)
class _Incoming:
    """A bucket whose broadcasts a worker started."""

    bucket: Bucket
    buffer: torch.Tensor
    release: Callable[[], None]
    works: list[dist.Work]
    copied_out: list[Slice]
    """Short slices received into `buffer` that belong in the model as they are."""
    side: torch.cuda.Stream | None
    """The receiver's side stream under NCCL, else None (see `_wait_all`)."""
    timeout: float
    """How long each broadcast may take (the receiver's `recv_timeout`)."""

    def done(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def finish(self, target: LandingTarget) -> None:
        """Wait for the broadcasts, then copy the short direct slices into place."""
        _wait_all(self.works, self.side, self.timeout)
        for s in self.copied_out:
            landing = target.landing_view(s.param)[s.start : s.end]
            torch.frombuffer(landing, dtype=torch.uint8).copy_(
                self.buffer[s.offset : s.offset + s.nbytes]
            )

    def abandon(self) -> None:
        """After a failure: wait until nothing writes into the buffer, then release it."""
        with contextlib.suppress(RuntimeError):
            _wait_all(self.works, self.side, self.timeout)
        self.release()


class TorchDistReceiver(ReceiverTransport):
    """Joins the group at init; receives each announced bucket by broadcast."""

    def __init__(
        self,
        info: TorchDistWorkerInitInfo,
        plan: TransferPlan,
        pool: ReceivePool,
        device: torch.device,
    ) -> None:
        self.info = info
        self.plan = plan
        self.pool = pool
        self.device = device
        self.link: WorkerLink | None = None
        self.store: dist.Store | None = None
        self.store_client: StoreClient | None = None
        self.rank = 0
        self.group: dist.ProcessGroup | None = None
        self._side = _side_stream(device) if info.group_backend == "nccl" else None

    def connect(self) -> None:
        """Connect the link and take a rank in the group (which forms at the first round)."""
        info = self.info
        same_gpu = info.trainer_gpu is not None and gpu_uuid(self.device) == info.trainer_gpu
        if info.group_backend == "nccl" and same_gpu:
            raise TransferError(
                f"torch_dist over NCCL needs this worker on a GPU other than the "
                f"trainer's rank 0, but both use GPU {info.trainer_gpu} (NCCL refuses "
                f"two ranks on one GPU); move the worker to another GPU, or use the "
                f"'cuda_ipc' backend for a worker that shares the trainer's GPU"
            )
        sock = connect_link(info.host, info.port, info.token, self.plan, info.connect_timeout)
        self.link = WorkerLink(sock, self.plan, info.recv_timeout, slots=info.num_buffers)
        try:
            self.store_client = StoreClient(
                info.host,
                info.store_port,
                token=info.token,
                digest=store_digest(self.plan.digest),
                timeout=info.connect_timeout,
            )
            self.store = dist.PrefixStore(f"asyncwt/{info.group_key}/", self.store_client)
            self.rank = int(self.store.add("worker_rank", 1))
            if self.rank >= info.world_size:
                raise TransferError(
                    f"the torch_dist group is full: {info.world_size - 1} workers joined already"
                )
        except BaseException:
            self.close()
            raise

    def _form_group(self) -> dist.ProcessGroup:
        if self.group is None:
            info = self.info
            assert self.store is not None
            assert self.link is not None
            address = self.link.sock.getsockname()[0]  # the interface that reaches the trainer
            create = functools.partial(
                _new_group,
                info.group_backend,
                self.store,
                self.rank,
                info.world_size,
                info.recv_timeout,
                self.device,
                address,
                self._side,
            )
            self.group = _form_within(create, info.recv_timeout)
        return self.group

    @property
    def usable(self) -> bool:
        return self.link is not None and not self.link.broken and self.store is not None

    def receive_round(self, round_id: int, target: LandingTarget) -> Iterator[ReceivedBucket]:
        link = self.link
        assert link is not None
        try:
            with link.guard(round_id):
                yield from self._receive(link, round_id, target)
            if self.store_client is not None:
                # A round went through: every rank formed the group and used it, so
                # the rendezvous is over; leave the store (its connection on rank 0
                # ends with it).
                self.store_client.close()
        except TransferAbortedError:
            raise  # at a frame boundary: the group stays in step
        except BaseException:
            # The round broke: leave the group now, so that the trainer's broadcast in
            # flight fails at once instead of waiting for the group timeout.
            self.store = None
            self._leave_group()
            raise

    def _receive(
        self, link: WorkerLink, round_id: int, target: LandingTarget
    ) -> Iterator[ReceivedBucket]:
        """Start each bucket's broadcasts as its header arrives, up to
        `IN_FLIGHT_BUCKETS` at once (as the trainer sends them), and yield each
        bucket in order once its broadcasts completed.

        While the oldest is on the wire, the link is polled for the next header, so
        the next bucket's broadcasts start before this one's end. Every broadcast
        started has completed (or failed) before an error leaves this generator.
        """
        frames = link.frames(round_id, after_ready=self._form_group)
        in_flight: collections.deque[_Incoming] = collections.deque()
        ended = False

        def start(frame: Frame, taken: tuple[torch.Tensor, Callable[[], None]]) -> None:
            bucket = self.plan.buckets[frame.index]
            try:
                in_flight.append(self._start_bucket(bucket, *taken, target))
            except BaseException:
                taken[1]()
                raise

        try:
            while True:
                if not in_flight:
                    frame = next(frames, None)
                    if frame is None:
                        return
                    start(frame, self.pool.take())
                oldest = in_flight[0]
                while not ended and len(in_flight) < IN_FLIGHT_BUCKETS and not oldest.done():
                    if not readable(link.sock, _POLL_S):
                        continue
                    taken = self.pool.try_take()
                    if taken is None:
                        break  # every buffer is in use: the next bucket waits for one
                    try:
                        frame = next(frames, None)  # an ABORT raises here
                    except BaseException:
                        taken[1]()
                        raise
                    if frame is None:
                        taken[1]()
                        ended = True
                    else:
                        start(frame, taken)
                try:
                    oldest.finish(target)
                except RuntimeError as exc:
                    error = TransferTimeoutError if _timed_out(exc) else TransferError
                    raise error(
                        f"round {round_id}: receiving bucket {oldest.bucket.index} by broadcast "
                        f"failed (the trainer left the group, or stalled past recv_timeout="
                        f"{self.info.recv_timeout}s): {exc}"
                    ) from exc.with_traceback(None)  # its frames would keep the group alive
                in_flight.popleft()
                yield ReceivedBucket(oldest.bucket, oldest.buffer, oldest.release)
                if ended and not in_flight:
                    return
        except BaseException as exc:
            if not isinstance(exc, TransferAbortedError):
                # Leave the group first: the broadcasts still in flight then fail at
                # once instead of at the group timeout.
                self.store = None
                self._leave_group()
            for incoming in in_flight:
                incoming.abandon()
            raise
        finally:
            frames.close()

    def _start_bucket(
        self,
        bucket: Bucket,
        buffer: torch.Tensor,
        release: Callable[[], None],
        target: LandingTarget,
    ) -> _Incoming:
        """Start receiving `bucket`'s broadcasts: a parameter the model takes as it is
        gets its bytes in place (a long slice directly, a short one copied out of
        `buffer` once received), everything else lands in `buffer` at its plan offset
        for the applier."""
        assert self.group is not None
        direct_bytes = self.info.direct_bytes
        destinations: list[torch.Tensor] = []
        copied_out: list[Slice] = []  # short slices the model takes as they are
        for unit in broadcast_units(bucket, direct_bytes):
            if unit.direct:
                s = unit.slices[0]
                if target.direct[s.param]:
                    view = target.landing_view(s.param)[s.start : s.end]
                    destinations.append(torch.frombuffer(view, dtype=torch.uint8))
                else:
                    destinations.append(buffer[s.offset : s.offset + s.nbytes])
                continue
            destinations.append(buffer[unit.packed_range])
            copied_out.extend(s for s in unit.slices if target.direct[s.param])
        works = _start_all(self.group, destinations, self._side)
        timeout = self.info.recv_timeout
        return _Incoming(bucket, buffer, release, works, copied_out, self._side, timeout)

    def _leave_group(self) -> None:
        group, self.group = self.group, None
        _release_group(group)
        client, self.store_client = self.store_client, None
        if client is not None:  # the group is gone: so is the need for the store
            client.close()

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        self._leave_group()
        self.store = None


def _make_receiver(
    info: TorchDistWorkerInitInfo, plan: TransferPlan, ctx: ReceiveContext
) -> ReceiverTransport:
    """Receives by broadcast (into device buffers over NCCL), applies deferred."""
    pool = ctx.receive_pool(info, plan, on_device=info.group_backend == "nccl")
    return TorchDistReceiver(info, plan, pool, ctx.device)


TORCH_DIST = TransportBackend(
    name="torch_dist",
    trainer_info=TorchDistTrainerInitInfo,
    worker_info=TorchDistWorkerInitInfo,
    sender=TorchDistSender,
    receiver=_make_receiver,
)

TorchDistTrainerEngine = trainer_engine_class(
    TORCH_DIST, name="TorchDistTrainerEngine", module=__name__
)
TorchDistWorkerEngine = worker_engine_class(
    TORCH_DIST, name="TorchDistWorkerEngine", module=__name__
)
