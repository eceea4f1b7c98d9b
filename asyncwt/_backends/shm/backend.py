"""The `"shm"` backend, one host: workers read each bucket from the trainer's memory.

Where the kernel lets a worker read the trainer's memory (`asyncwt._backends.shm.cma`: same
user, no ptrace restriction in the way), the trainer packs nothing: each bucket
goes out as the addresses of its slices, in the trainer's own tensors, and the
worker copies them with `process_vm_readv` straight to where they land (the model
itself, where it takes the bytes as they are), then acknowledges the bucket. One
copy per byte, where a ring costs two on the same cores. The worker splits each
bucket's reads across its cores (`read_streams` concurrent calls over disjoint
ranges, `asyncwt._backends.shm.cma.SplitReader`), and the trainer lends the next
bucket before the last one is acknowledged (up to `num_buffers` in flight), so the
worker never waits on a round trip between two buckets.

Every other worker, or every worker when the trainer sets `direct_reads=False`,
uses the bucket ring (see `asyncwt._backends.shm.ring`) in shared memory. On
Linux the ring has no name at all (`asyncwt._backends.shm.memfd`): anonymous
memory whose descriptors the trainer hands to workers of its user over an abstract
Unix socket during init, and which the kernel frees with its last holder, so
nothing can be left in `/dev/shm` however both sides die (a SIGKILL of the
trainer's whole process group included). Elsewhere the segments are named,
owner-only, and unlinked as soon as every worker has mapped them. If one worker of
a round reads from the ring, every bucket is packed into it (a worker that reads
directly then reads the ring slot).

With `delta=True` (a layer around this sender, see `asyncwt._delta.links`), a
bucket coded smaller than its payload goes to each worker that gets a delta as a
DELTA frame inline on its link: no addresses lent, no ring slot announced
(`send_bucket_to` gets the other workers). A bucket that codes raw, and every
bucket of a full round, goes the way above. The rate `delta_policy="auto"` weighs
the encoder against is a direct read's (lent until read back); a ring bucket is
packed before it is sent either way and its announce costs next to nothing, so
over the ring auto sends full rounds once it has measured the encoder.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import re
import secrets
import struct
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any, ClassVar

import anyio
import torch

from ..._core.concurrency import single_error
from ..._core.cuda_sync import HostRegistration
from ..._core.errors import TransferError
from ..._core.plan import Bucket, TransferPlan
from ..._core.round_plan import BackendFeatures
from ..._core.trainer_api import TrainerInitInfo
from ..._core.validate import check_bool, check_int_in, check_u64
from ..._trainer.engine import trainer_engine_class
from ..._transports.backend import ReceiveContext, TransportBackend
from ..._transports.base import (
    InitWorkers,
    LandingTarget,
    ReceivedBucket,
    ReceiverTransport,
    Segment,
    Settle,
)
from ..._transports.link import Peer, WorkerLink
from ..._transports.link_settings import LinkedWorkerInfo, SendersAndDelta
from ..._transports.pool import ReceivePool
from ..._transports.sockio import recv_exact
from ..._transports.wire import Frame, FrameKind
from ..._worker.engine import worker_engine_class
from . import cma as _cma
from . import memfd as _memfd
from .ring import RingReceiver, RingSender

__all__ = [
    "ShmReceiver",
    "ShmSender",
    "ShmTrainerEngine",
    "ShmTrainerInitInfo",
    "ShmWorkerEngine",
    "ShmWorkerInitInfo",
]

logger = logging.getLogger("asyncwt")

_SEGMENT_NAME = re.compile(r"^asyncwt_[0-9a-f]{16}_\d{1,4}$")
_CREATED_HERE: set[str] = set()
"""Segments this process created (and its resource tracker rightly tracks)."""


@dataclass(kw_only=True)
class ShmTrainerInitInfo(SendersAndDelta, TrainerInitInfo):
    """Trainer-side settings of the `"shm"` backend (trainer and workers on one host)."""

    backend: ClassVar[str] = "shm"

    direct_reads: bool = True
    """Let workers read buckets straight from this process's memory where the
    kernel allows it (one copy instead of two). False keeps every worker on the
    shared ring."""

    read_streams: int = 0
    """Concurrent reads each direct-reading worker splits a bucket into (disjoint
    byte ranges, one thread each), at most `asyncwt._backends.shm.cma.MAX_STREAMS`;
    0 lets every worker take one per core it may run on, up to
    `asyncwt._backends.shm.cma.DEFAULT_STREAMS`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bool("direct_reads", self.direct_reads)
        check_int_in("read_streams", self.read_streams, 0, _cma.MAX_STREAMS)


@dataclass
class ShmWorkerInitInfo(LinkedWorkerInfo):
    """What a `"shm"` worker receives: the link's address and token, the segments,
    and (when the trainer offers direct reads) its pid and read probe."""

    segments: list[str] = field(default_factory=list)
    """Names of the ring's segments in `/dev/shm` (where there is no `ring_socket`)."""
    ring_socket: str = ""
    """Abstract Unix socket that hands out the ring's descriptors (Linux); then
    `segments` is empty."""
    trainer_pid: int = 0
    """The trainer's pid, or 0 when it offers no direct reads."""
    probe_address: int = 0
    """Where the trainer holds `probe_nonce`, in its own address space."""
    probe_nonce: str = ""
    """The probe's bytes, in hex."""
    read_streams: int = 0
    """Concurrent reads per bucket (0: one per core this worker may run on, up to
    `asyncwt._backends.shm.cma.DEFAULT_STREAMS`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_u64("trainer_pid", self.trainer_pid)
        check_int_in("read_streams", self.read_streams, 0, _cma.MAX_STREAMS)
        check_u64("probe_address", self.probe_address)
        nonce = self.probe_nonce
        if self.trainer_pid and (
            not isinstance(nonce, str)
            or not re.fullmatch(f"[0-9a-f]{{{2 * _cma.PROBE_BYTES}}}", nonce)
        ):
            raise ValueError(
                f"probe_nonce should be {2 * _cma.PROBE_BYTES} lowercase hex digits, got {nonce!r}"
            )
        if self.ring_socket != "" and (
            not isinstance(self.ring_socket, str) or not _memfd.SOCKET_NAME.match(self.ring_socket)
        ):
            raise ValueError(
                f"ring_socket should be an asyncwt ring socket name, got {self.ring_socket!r}"
            )
        expected = 0 if self.ring_socket else self.num_buffers
        if not isinstance(self.segments, list) or len(self.segments) != expected:
            raise ValueError(
                f"segments should list {expected} names (num_buffers={self.num_buffers}, "
                f"ring_socket={self.ring_socket!r}), got {self.segments!r}"
            )
        for name in self.segments:
            if not isinstance(name, str) or not _SEGMENT_NAME.match(name):
                raise ValueError(f"segments should be asyncwt segment names, got {name!r}")


def _view(segment: shared_memory.SharedMemory | mmap.mmap, nbytes: int) -> torch.Tensor:
    buffer = segment.buf if isinstance(segment, shared_memory.SharedMemory) else segment
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes)


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
        raise ValueError(
            f"shared segment {name!r} has {segment.size} bytes, the plan needs {nbytes}"
        )
    return segment


def _host_address(segment: Segment) -> int:
    """Where a host segment's first byte is in this process (0 if it is empty)."""
    if segment.device.type != "cpu":
        raise ValueError(
            f"a segment lent for direct reads should be host memory, got {segment.device}"
        )
    return segment.data_ptr() if segment.numel() else 0


class ShmSender(RingSender):
    """Offers direct reads to the workers, and keeps the ring (owner-only segments)
    for those that cannot take them."""

    def __init__(
        self, info: ShmTrainerInitInfo, plan: TransferPlan, device: torch.device | None = None
    ) -> None:
        super().__init__(info, plan)
        self.device = device if device is not None else torch.device("cpu")
        """The trainer's device: a GPU's buckets are copied into the ring, which is
        then registered with CUDA (`prepare`) so those copies are queued, not held."""
        self.registration: HostRegistration | None = None
        self.probe: _cma.ReadProbe | None = None
        self._probe_buffer: Any = None
        if info.direct_reads and _cma.supported():
            self.probe, self._probe_buffer = _cma.ReadProbe.create()
        self.links.direct_reads = self.probe is not None
        self.read_streams = info.read_streams
        self.in_flight_buckets = info.num_buffers
        """Direct rounds lend up to this many buckets before the oldest is read
        (`send_bucket` returns a `Settle`); ring rounds settle each at once."""
        self.direct = False
        """Whether every worker of this round reads from this process's memory: then
        nothing is packed (`min_view_bytes` 0) and the ring is unused."""
        self.segments_outlive_send = False
        self._readers: int | None = None
        """How many workers read directly, as last logged."""
        self.segments: list[shared_memory.SharedMemory] = []
        self.ring: _memfd.AnonymousRing | None = None
        self.ring_server: _memfd.RingFdServer | None = None
        try:
            if _memfd.supported():
                self.ring = _memfd.AnonymousRing(info.num_buffers, plan.bucket_bytes)
                self.ring_server = _memfd.RingFdServer(self.ring)
                buffers = [_view(m, plan.bucket_bytes) for m in self.ring.maps]
            else:
                buffers = self._named_segments(info.num_buffers, plan.bucket_bytes)
        except BaseException:
            self.close()
            raise
        self.set_buffers(buffers)

    def _named_segments(self, count: int, nbytes: int) -> list[torch.Tensor]:
        prefix = f"asyncwt_{secrets.token_hex(8)}"
        buffers = []
        for slot in range(count):
            segment = shared_memory.SharedMemory(name=f"{prefix}_{slot}", create=True, size=nbytes)
            _CREATED_HERE.add(segment.name.lstrip("/"))
            self.segments.append(segment)
            buffers.append(_view(segment, nbytes))
        return buffers

    def prepare(self) -> None:
        """Page-lock the ring for CUDA where the trainer's device is a GPU. Where the
        driver refuses, the ring stays pageable (its copies then hold a pack thread,
        sleeping until the lane gets to them): slower, not wrong, and logged."""
        if self.device.type == "cuda" and self.registration is None:
            try:
                self.registration = HostRegistration(self.buffers)
            except RuntimeError as exc:
                logger.warning(
                    "asyncwt: shm: the ring could not be registered with CUDA (%s); copies "
                    "from the GPU into it go through pageable memory",
                    exc,
                )

    def exported(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"segments": [s.name.lstrip("/") for s in self.segments]}
        if self.ring_server is not None:
            fields["ring_socket"] = self.ring_server.name
        if self.probe is not None:
            fields.update(
                trainer_pid=self.probe.pid,
                probe_address=self.probe.address,
                probe_nonce=self.probe.nonce,
                read_streams=self.read_streams,
            )
        return fields

    async def rendezvous(self, worker_fields: dict[str, Any], init_workers: InitWorkers) -> None:
        """Admit the workers; meanwhile hand the ring's descriptors to those that ask."""
        server = self.ring_server
        if server is None:
            await super().rendezvous(worker_fields, init_workers)
            return
        try:
            with single_error():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(server.serve)
                    await super().rendezvous(worker_fields, init_workers)
                    tg.cancel_scope.cancel()
        finally:
            server.close()
            self.ring_server = None

    def after_rendezvous(self) -> None:
        if self.ring is not None:
            self.ring.close_fds()  # every worker holds its own descriptors or mappings
        for segment in self.segments:  # every worker has mapped them: drop the names
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()

    async def begin_round(self, round_id: int) -> None:
        await super().begin_round(round_id)  # every READY says whether its worker reads directly
        readers = sum(peer.reads_directly for peer in self.links.peers)
        if readers != self._readers:
            logger.info(
                "asyncwt: shm: round %d: %d of %d worker(s) read this process's memory directly",
                round_id,
                readers,
                self.num_workers,
            )
            self._readers = readers
        self.direct = readers == self.num_workers
        self.min_view_bytes = 0 if self.direct else None
        # A ring slot may be packed again as soon as its readers release it: a layer
        # reads a bucket's segments before it is announced, not beside.
        self.segments_outlive_send = self.direct

    def staging(self, slot: int) -> torch.Tensor | None:
        return None if self.direct else super().staging(slot)

    async def reclaim(self, slot: int) -> None:
        if not self.direct:  # else send_bucket returned only once every worker had read
            await super().reclaim(slot)

    async def send_bucket(
        self, bucket: Bucket, slot: int, segments: list[Segment]
    ) -> Settle | None:
        return await self.send_bucket_to(bucket, slot, segments, self.links.peers)

    async def send_bucket_to(
        self, bucket: Bucket, slot: int, segments: list[Segment], peers: list[Peer]
    ) -> Settle | None:
        """Send `bucket` in full to `peers` (`_send_full`).

        Shielded from cancellation, each step bounded by `send_timeout` instead:
        `segments` may point into the source's tensors, which must stay as they are
        until read, and a slot announced to only some workers would never be
        released.
        """
        ring = self.bound.get(slot)  # bound until sent, then `pending` guards it
        with anyio.CancelScope(shield=True):
            try:
                settle = await self._send_full(bucket, ring, segments, peers)
            finally:
                self.bound.pop(slot, None)
        return settle

    async def _send_full(
        self, bucket: Bucket, ring: int | None, segments: list[Segment], peers: list[Peer]
    ) -> Settle | None:
        """Lend `bucket` to the direct readers among `peers` (its addresses), then
        announce its ring slot `ring` to the ring workers among them.

        In a direct round (every worker reads directly) return at once with a
        `Settle` that waits for every reader's acknowledgement: the next bucket is
        lent while this one is read, and the pipeline holds `segments` until then.
        Otherwise return once every direct reader has read it. The direct readers
        go first: a ring worker may release the slot as soon as it has applied it,
        and the next bucket may then be packed into it.
        """
        ring_peers = [peer for peer in peers if not peer.reads_directly]
        readers = [peer for peer in peers if peer.reads_directly]
        if ring_peers:
            assert ring is not None, "a ring worker's round packs every bucket into the ring"
            self.pending[ring] = set(ring_peers)
        if readers:
            addresses = struct.pack(f"<{len(segments)}Q", *map(_host_address, segments))
            await self.links.each(self._lend, bucket, addresses, among=readers)
            if not ring_peers and self.direct:

                async def settle() -> None:
                    await self.links.each(self._read_back, bucket, among=readers)

                return settle
            await self.links.each(self._read_back, bucket, among=readers)
        if ring_peers:
            assert ring is not None
            header = self.links.frame(
                FrameKind.BUCKET, index=bucket.index, nbytes=bucket.payload_bytes, slot=ring
            )
            await self.links.each(
                self.links.send_header, header, f"bucket {bucket.index}", among=ring_peers
            )
        return None

    async def _lend(self, peer: Peer, bucket: Bucket, addresses: bytes) -> None:
        """Send `bucket`'s addresses to `peer`."""
        header = self.links.frame(
            FrameKind.BUCKET_AT, index=bucket.index, nbytes=bucket.payload_bytes
        )
        what = f"bucket {bucket.index}"
        await self.links.send_frame(peer, [memoryview(header.pack()), memoryview(addresses)], what)

    async def _read_back(self, peer: Peer, bucket: Bucket) -> None:
        """Wait for `peer`'s acknowledgement that it read `bucket` (buckets are read,
        and acknowledged, in the order they were lent)."""
        what = f"bucket {bucket.index}"
        frame = await self.links.read_frame(peer, self.release_timeout, f"its read of {what}")
        if frame.kind != FrameKind.RELEASE or frame.index != bucket.index or frame.slot:
            error = self.links.protocol_error(
                peer,
                f"answered {what} with {frame.kind.name} of bucket {frame.index}, slot "
                f"{frame.slot}; expected RELEASE of bucket {bucket.index}, slot 0",
            )
            peer.close(str(error))
            raise error

    def close(self) -> None:
        if self.registration is not None:  # before the ring is unmapped
            self.registration.close()
            self.registration = None
        super().close()
        if self.ring_server is not None:
            self.ring_server.close()
            self.ring_server = None
        if self.ring is not None:
            self.ring.close()
            self.ring = None
        for segment in self.segments:
            with contextlib.suppress(FileNotFoundError):
                segment.unlink()
            with contextlib.suppress(BufferError):
                segment.close()
        self.segments = []


class ShmReceiver(RingReceiver):
    """Reads each bucket from the trainer's memory when the probe succeeds, else
    maps the trainer's shared-memory segments."""

    def __init__(self, info: ShmWorkerInitInfo, plan: TransferPlan, pool: ReceivePool) -> None:
        super().__init__(info, plan, lambda: pool)
        self.segment_names = info.segments
        self.ring_socket = info.ring_socket
        self.segments: list[shared_memory.SharedMemory] = []
        self.maps: list[mmap.mmap] = []
        self.pool = pool
        self.trainer_pid = info.trainer_pid
        self.reader: _cma.SplitReader | None = None
        if info.trainer_pid:
            why = _cma.probe_reads(
                _cma.ReadProbe(info.trainer_pid, info.probe_address, info.probe_nonce)
            )
        else:
            why = "the trainer offers no direct reads (direct_reads=False)"
        self.reads_directly = self.lands_in_place = why is None
        if why is not None:
            logger.info("asyncwt: shm: this worker reads from the shared ring: %s", why)
        else:
            streams = info.read_streams or _cma.default_streams()
            self.reader = _cma.SplitReader(info.trainer_pid, streams)

    def connect(self) -> None:
        super().connect()
        link = self.link
        assert link is not None
        if self.reads_directly and not _cma.holds_peer_of(self.trainer_pid, link.sock):
            self.close()
            raise TransferError(
                f"trainer_pid {self.trainer_pid} from the init info does not hold this "
                f"worker's link to the trainer at {self.info.host}:{self.info.port}: refusing "
                f"to read its memory (for a trainer in another network namespace, set "
                f"direct_reads=False on it)"
            )

    def map_ring(self) -> list[torch.Tensor]:
        if self.reads_directly:
            return []  # every bucket comes from the trainer's memory
        if self.ring_socket:
            self.maps = _memfd.receive_ring(
                self.ring_socket,
                self.info.num_buffers,
                self.plan.bucket_bytes,
                self.info.connect_timeout,
            )
            return [_view(m, self.plan.bucket_bytes) for m in self.maps]
        buffers = []
        for name in self.segment_names:
            segment = _attach(name, self.plan.bucket_bytes)
            self.segments.append(segment)
            buffers.append(_view(segment, self.plan.bucket_bytes))
        return buffers

    def received(
        self, link: WorkerLink, round_id: int, frame: Frame, target: LandingTarget
    ) -> ReceivedBucket:
        """A codec's frame inline on the link (a delta), a bucket read from the
        trainer's memory, or a ring slot."""
        coded = link.coded(frame, self.pool, target)
        if coded is not None:
            return coded
        bucket = self.plan.buckets[frame.index]
        if not self.reads_directly:
            return super().received(link, round_id, frame, target)
        count = len(bucket.slices)
        addresses = struct.unpack(f"<{count}Q", recv_exact(link.sock, 8 * count))
        buffer, release, views = self.pool.landing(bucket, target)
        try:
            assert self.reader is not None
            self.reader.read(views, addresses)
        except OSError as exc:
            release()
            raise TransferError(
                f"reading bucket {bucket.index} from the trainer's memory failed: {exc}"
            ) from exc
        except BaseException:
            release()
            raise
        link.send(Frame(FrameKind.RELEASE, round_id, bucket.index, frame.digest, 0, 0))
        return ReceivedBucket(bucket, buffer, release)

    def close(self) -> None:
        super().close()
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def unmap_ring(self) -> None:
        for segment in self.segments:
            with contextlib.suppress(BufferError):
                segment.close()
        self.segments = []
        for mapping in self.maps:
            with contextlib.suppress(BufferError):  # a tensor still views it: freed with it
                mapping.close()
        self.maps = []


def _make_receiver(
    info: ShmWorkerInitInfo, plan: TransferPlan, ctx: ReceiveContext
) -> ReceiverTransport:
    return ShmReceiver(info, plan, ctx.receive_pool(info, plan))


SHM = TransportBackend(
    name="shm",
    trainer_info=ShmTrainerInitInfo,
    worker_info=ShmWorkerInitInfo,
    sender=ShmSender,
    receiver=_make_receiver,
    features=BackendFeatures(senders=("rank0", "owners"), codecs=("raw", "delta")),
)

ShmTrainerEngine = trainer_engine_class(SHM, name="ShmTrainerEngine", module=__name__)
ShmWorkerEngine = worker_engine_class(SHM, name="ShmWorkerEngine", module=__name__)
