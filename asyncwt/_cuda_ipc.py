"""The `"cuda_ipc"` backend: the bucket ring (see `_ring`) in GPU memory, one node.

The trainer allocates `num_buffers` bucket buffers on its GPU once and exports
their CUDA IPC handles at init; each worker maps them once (no per-bucket
re-import). Buckets are packed on the pack lane's stream; the send stage waits
for that stream's event before announcing a slot, and a worker releases a slot
only after its own stream finished reading it, so a slot is reused only after
every reader is done. Registered only where CUDA is available.

Limitation: a worker maps the buffers on its own device index, so trainer and
workers must see that GPU under the same index (or the worker's device must be
the trainer's physical GPU).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
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
    "CudaIpcTrainerEngine",
    "CudaIpcTrainerInitInfo",
    "CudaIpcWorkerEngine",
    "CudaIpcWorkerInitInfo",
]

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


@dataclass
class CudaIpcTrainerInitInfo(LinkedTrainerInfo, TrainerInitInfo):
    """Trainer-side settings of the `"cuda_ipc"` backend (GPU, one node)."""

    backend: ClassVar[str] = "cuda_ipc"


@dataclass
class CudaIpcWorkerInitInfo(TcpWorkerInitInfo):
    """What a `"cuda_ipc"` worker receives: the link, and one IPC handle per ring slot."""

    ipc_buffers: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
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

    def __init__(self, info: CudaIpcTrainerInitInfo, plan: TransferPlan) -> None:
        super().__init__(info, plan)
        device = torch.device(info.device or "cuda")
        if device.type != "cuda":
            raise ValueError(f"device should be a CUDA device for cuda_ipc, got {device}")
        self.set_buffers(
            [
                torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
                for _ in range(info.num_buffers)
            ]
        )

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
        return {"ipc_buffers": handles}


class CudaIpcReceiver(RingReceiver):
    """Maps each exported GPU buffer once, on the worker's device."""

    def __init__(self, info: CudaIpcWorkerInitInfo, plan: TransferPlan, device: torch.device) -> None:
        super().__init__(info, plan)
        self.handles = info.ipc_buffers
        self.device = device

    def map_ring(self) -> list[torch.Tensor]:
        torch.cuda._lazy_init()
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
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
            typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=torch.uint8, _internal=True)
            buffers.append(
                torch._utils._rebuild_tensor(typed, 0, (self.plan.bucket_bytes,), (1,))  # type: ignore[attr-defined]
            )
        return buffers


class CudaIpcTrainerEngine(PipelinedTrainerEngine[CudaIpcTrainerInitInfo]):
    """Trainer engine of the `"cuda_ipc"` backend (see the module docstring)."""

    init_info_cls = CudaIpcTrainerInitInfo

    @classmethod
    def make_transport(cls, info: CudaIpcTrainerInitInfo, plan: TransferPlan) -> SenderTransport:
        return CudaIpcSender(info, plan)


class CudaIpcWorkerEngine(DeferredWorkerEngine):
    """Worker engine of the `"cuda_ipc"` backend: applies straight from the mapped ring."""

    init_info_cls = CudaIpcWorkerInitInfo

    def make_receiver(self, info: Any, plan: TransferPlan) -> ReceiverTransport:
        return CudaIpcReceiver(info, plan, self.device)
