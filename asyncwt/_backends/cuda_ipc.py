"""The `"cuda_ipc"` backend: the bucket ring in GPU memory, one node.

The ring is `asyncwt._backends.shm.ring`'s. The trainer allocates `num_buffers`
bucket buffers on its GPU and exports their CUDA IPC handles at init; each worker
maps them once (no per-bucket re-import).
Buckets are packed on the pack lane's stream; the send stage waits for that
stream's event before announcing a slot, and a worker releases a slot only after
its own stream finished reading it, so a slot is reused only after every reader
is done.

Each ring buffer is its own `cudaMalloc` allocation, made in a memory pool of
asyncwt's (`ring_block`), never carved from the caching allocator's shared
segments: an exported handle then maps exactly that buffer (not the neighbouring
tensors of a segment), and it is a plain CUDA IPC handle even where the trainer
runs with `expandable_segments:True` (whose segments export as file descriptors a
worker can only open with ptrace rights over the trainer).

The ring's memory is never handed back to torch's allocator while the process
lives: one export is mapped by every worker, and torch's IPC reference count
(one per export, not per importer) would reach zero when the first worker
unmaps, letting the allocator reuse memory the others still map. Instead a
closed sender hands its ring back to a per-process shelf, and the next sender
of the same device and bucket size takes it from there: a re-init costs no
memory, and nothing is ever freed under a worker.

A worker maps the ring on its own GPU: the driver maps another GPU's memory
there through peer access (NVLink, PCIe P2P), so a worker on another GPU creates
no CUDA context on the trainer's (0.3-0.5 GiB each) and need not see it. Only
where that fails does it map the ring on the trainer's GPU, which it finds by UUID
(the same in every process, whatever `CUDA_VISIBLE_DEVICES` numbers it), not by
index. Nothing here touches CUDA at import: the backend is registered everywhere
and says so at init where CUDA is missing.
"""

from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .._core.errors import TransferError
from .._core.plan import TransferPlan
from .._core.trainer_api import TrainerInitInfo
from .._trainer.engine import trainer_engine_class
from .._transports.backend import ReceiveContext, TransportBackend
from .._transports.base import ReceiverTransport
from .._transports.link_settings import LinkedTrainerInfo, LinkedWorkerInfo
from .._transports.pool import ReceivePool
from .._worker.engine import worker_engine_class
from .shm.ring import RingReceiver, RingSender
from .torch_dist import check_gpu_uuid, gpu_uuid

__all__ = [
    "CudaIpcTrainerEngine",
    "CudaIpcTrainerInitInfo",
    "CudaIpcWorkerEngine",
    "CudaIpcWorkerInitInfo",
]

logger = logging.getLogger("asyncwt")

_HANDLE_KEYS = {
    "handle": str,
    "size": int,
    "offset": int,
    "ref_counter_handle": str,
    "ref_counter_offset": int,
    "event_sync_required": bool,
}


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text.encode("ascii"), validate=True)


def require_cuda(backend: str = "cuda_ipc") -> None:
    """Raise `TransferError` saying why, where CUDA is not available."""
    if not torch.cuda.is_available():
        raise TransferError(
            f"the {backend!r} backend needs a CUDA GPU, and torch.cuda.is_available() is False here"
        )


_MIN_BLOCK = 10 << 20
_BLOCK_ROUND = 2 << 20
"""torch's caching allocator gives a request of at least 10 MiB, rounded up to
2 MiB, a `cudaMalloc` of exactly that size: asking for that size leaves no
remainder in the segment for another block to share."""

_POOLS: dict[torch.device, Any] = {}
"""asyncwt's own memory pool per device, for ring buffers only (never freed)."""


def block_bytes(nbytes: int) -> int:
    """The size a ring buffer of `nbytes` is allocated with: a whole segment."""
    return max(_MIN_BLOCK, -(-nbytes // _BLOCK_ROUND) * _BLOCK_ROUND)


def ring_block(device: torch.device, nbytes: int) -> torch.Tensor:
    """`nbytes` of `device` memory in a `cudaMalloc` allocation of their own.

    Made in a private `torch.cuda.MemPool` (private pools never use expandable
    segments, and nothing but ring buffers is ever allocated there) with a request
    that fills its segment (`block_bytes`): the buffer's IPC handle exports that
    allocation, and nothing else of the trainer's.
    """
    if not hasattr(torch.cuda, "MemPool") or not hasattr(torch.cuda, "use_mem_pool"):
        raise TransferError(
            f"the 'cuda_ipc' backend needs torch.cuda.MemPool (torch 2.6 or later) to keep "
            f"its ring out of the caching allocator's shared segments; torch is "
            f"{torch.__version__}"
        )
    with _SHELF_LOCK:
        pool = _POOLS.get(device)
        if pool is None:
            pool = _POOLS[device] = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool, device):
        block = torch.empty(block_bytes(nbytes), dtype=torch.uint8, device=device)
    return block[:nbytes]


_SHELF: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
"""Ring buffers of closed senders, by (device, bytes): never freed (module docstring)."""
_SHELF_LOCK = threading.Lock()


def take_ring(device: torch.device, nbytes: int, count: int) -> list[torch.Tensor]:
    """`count` buffers of `nbytes` on `device` for one sender: from the shelf where
    it has them, newly allocated otherwise. Give them back with `shelve_ring`."""
    with _SHELF_LOCK:
        shelf = _SHELF.setdefault((device, nbytes), [])
        taken = [shelf.pop() for _ in range(min(count, len(shelf)))]
    while len(taken) < count:
        taken.append(ring_block(device, nbytes))
    return taken


def shelve_ring(buffers: list[torch.Tensor]) -> None:
    """Keep a closed sender's buffers for the next one (workers may still map them)."""
    with _SHELF_LOCK:
        for buffer in buffers:
            _SHELF.setdefault((buffer.device, buffer.numel()), []).append(buffer)


def local_index(uuid: str | None, fallback: torch.device) -> int:
    """The index, in this process, of the GPU whose UUID is `uuid`.

    `None` (a trainer that could not tell) falls back to `fallback`'s index. A GPU
    this process cannot see is an error that names it: its handles cannot be opened.
    """
    if uuid is None:
        return fallback.index if fallback.index is not None else torch.cuda.current_device()
    seen = []
    for index in range(torch.cuda.device_count()):
        here = gpu_uuid(torch.device("cuda", index))
        if here == uuid:
            return index
        seen.append(here)
    raise TransferError(
        f"the trainer's ring is on GPU {uuid}, which this worker cannot see (it sees "
        f"{seen}); run the worker where that GPU is visible (CUDA_VISIBLE_DEVICES)"
    )


@dataclass(kw_only=True)
class CudaIpcTrainerInitInfo(LinkedTrainerInfo, TrainerInitInfo):
    """Trainer-side settings of the `"cuda_ipc"` backend (GPU, one node)."""

    backend: ClassVar[str] = "cuda_ipc"


@dataclass
class CudaIpcWorkerInitInfo(LinkedWorkerInfo):
    """What a `"cuda_ipc"` worker receives: the link, and one IPC handle per ring slot."""

    ipc_buffers: list[dict[str, Any]] = field(default_factory=list)
    ipc_gpu: str | None = None
    """UUID of the trainer's GPU, where the ring lives."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_gpu_uuid("ipc_gpu", self.ipc_gpu)
        if not isinstance(self.ipc_buffers, list) or len(self.ipc_buffers) != self.num_buffers:
            raise ValueError(
                f"ipc_buffers should hold num_buffers ({self.num_buffers}) handles, "
                f"got {type(self.ipc_buffers).__name__} of {len(self.ipc_buffers or [])}"
            )
        for index, entry in enumerate(self.ipc_buffers):
            if not isinstance(entry, dict):
                raise ValueError(f"ipc_buffers[{index}] should be a dict, got {entry!r}")
            for key, kind in _HANDLE_KEYS.items():
                if not isinstance(entry.get(key), kind):
                    raise ValueError(
                        f"ipc_buffers[{index}][{key!r}] should be a {kind.__name__}, "
                        f"got {entry.get(key)!r}"
                    )


class CudaIpcSender(RingSender):
    """The ring in GPU buffers allocated once; their IPC handles go to the workers."""

    def __init__(
        self, info: CudaIpcTrainerInitInfo, plan: TransferPlan, device: torch.device
    ) -> None:
        require_cuda()
        if device.type != "cuda":
            raise ValueError(f"device should be a CUDA device for cuda_ipc, got {device}")
        super().__init__(info, plan)
        self.device = device
        self.set_buffers(take_ring(device, plan.bucket_bytes, info.num_buffers))

    def exported(self) -> dict[str, Any]:
        handles = []
        for buffer in self.buffers:
            (
                _device,
                handle,
                size,
                offset,
                ref_counter_handle,
                ref_counter_offset,
                event_handle,
                event_sync_required,
            ) = buffer.untyped_storage()._share_cuda_()
            handles.append(
                {
                    "handle": _b64(handle),
                    "size": int(size),
                    "offset": int(offset),
                    "ref_counter_handle": _b64(ref_counter_handle),
                    "ref_counter_offset": int(ref_counter_offset),
                    "event_handle": _b64(event_handle),
                    "event_sync_required": bool(event_sync_required),
                }
            )
        return {"ipc_buffers": handles, "ipc_gpu": gpu_uuid(self.device)}

    own_staging = True

    def close(self) -> None:
        """Shelve the ring. The engine drains its lanes before this (a cancelled
        round may have left pack copies into the ring queued on them): only those
        write here, so no device-wide sync is needed."""
        buffers = self.buffers
        super().close()
        shelve_ring(buffers)


class CudaIpcReceiver(RingReceiver):
    """Maps each exported GPU buffer once, on the worker's device."""

    def __init__(
        self,
        info: CudaIpcWorkerInitInfo,
        plan: TransferPlan,
        device: torch.device,
        pool: Callable[[], ReceivePool],
    ) -> None:
        super().__init__(info, plan, pool)
        self.handles = info.ipc_buffers
        self.gpu = info.ipc_gpu
        self.device = device

    def map_ring(self) -> list[torch.Tensor]:
        """Map the ring on this worker's own GPU (peer access reaches the trainer's);
        where the driver refuses, on the trainer's GPU, found by UUID."""
        require_cuda()
        torch.cuda._lazy_init()
        own = self.device.index if self.device.type == "cuda" else None
        if own is None and self.device.type == "cuda":
            own = torch.cuda.current_device()
        if own is not None:
            try:
                return self._open(own)
            except RuntimeError as exc:
                index = local_index(self.gpu, self.device)
                if index == own:
                    raise
                logger.warning(
                    "asyncwt: cuda_ipc: the ring on GPU %s cannot be mapped on this worker's "
                    "GPU cuda:%d (no peer access: %s); mapping it on cuda:%d, which costs a "
                    "CUDA context there",
                    self.gpu,
                    own,
                    exc,
                    index,
                )
                return self._open(index)
        return self._open(local_index(self.gpu, self.device))

    def _open(self, index: int) -> list[torch.Tensor]:
        """Map every exported buffer into device `index`'s address space."""
        buffers = []
        for entry in self.handles:
            if entry["size"] - entry["offset"] < self.plan.bucket_bytes:
                raise ValueError(
                    f"an IPC buffer holds {entry['size'] - entry['offset']} bytes, the plan "
                    f"needs {self.plan.bucket_bytes}"
                )
            storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
                index,
                _unb64(entry["handle"]),
                entry["size"],
                entry["offset"],
                _unb64(entry["ref_counter_handle"]),
                entry["ref_counter_offset"],
                _unb64(entry.get("event_handle")),
                entry["event_sync_required"],
            )
            typed = torch.storage.TypedStorage(
                wrap_storage=storage, dtype=torch.uint8, _internal=True
            )
            buffers.append(
                torch._utils._rebuild_tensor(typed, 0, (self.plan.bucket_bytes,), (1,))  # type: ignore[attr-defined]
            )
        return buffers


def _make_receiver(
    info: CudaIpcWorkerInitInfo, plan: TransferPlan, ctx: ReceiveContext
) -> ReceiverTransport:
    """Applies straight from the mapped ring, or, where a transform or `load_weights`
    would be given the bucket, from a copy in receive buffers on this worker's
    device (allocated on the first such bucket)."""

    def pool() -> ReceivePool:
        return ctx.receive_pool(info, plan, on_device=True)

    return CudaIpcReceiver(info, plan, ctx.device, pool)


CUDA_IPC = TransportBackend(
    name="cuda_ipc",
    trainer_info=CudaIpcTrainerInitInfo,
    worker_info=CudaIpcWorkerInitInfo,
    sender=CudaIpcSender,
    receiver=_make_receiver,
)

CudaIpcTrainerEngine = trainer_engine_class(CUDA_IPC, name="CudaIpcTrainerEngine", module=__name__)
CudaIpcWorkerEngine = worker_engine_class(CUDA_IPC, name="CudaIpcWorkerEngine", module=__name__)
