"""Host-side waits on CUDA work that sleep instead of spinning, and pinned host memory.

A host thread that waits for the GPU the default way (`torch.cuda.synchronize`,
`.cpu()`, a device-to-host copy into pageable memory) spins a core in the driver
for as long as the device is busy, and `torch.cuda.synchronize` also waits for
every other stream of the device (the trainer's own kernels). Everything here
waits for one stream only, on an event made with `blocking=True`: the thread
sleeps until that stream reaches the event.

`HostRegistration` pins memory asyncwt did not allocate through torch (a shared
ring, say) so that copies between it and a GPU run on the device's copy engines
without a host thread, as they do for `pin_memory=True` buffers.

Nothing here touches CUDA at import.
"""

from __future__ import annotations

import torch

__all__ = ["HostRegistration", "blocking_event", "to_host", "wait_for_stream"]


def blocking_event() -> torch.cuda.Event:
    """A CUDA event whose `synchronize()` sleeps instead of spinning a core."""
    return torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]


def wait_for_stream(stream: torch.cuda.Stream) -> None:
    """Block this thread, without spinning, until `stream`'s queued work is done."""
    event = blocking_event()
    event.record(stream)
    event.synchronize()


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU; a GPU tensor is copied into pinned memory on the calling
    thread's current stream, and the thread sleeps until that stream is past the copy
    (`.cpu()` would spin a core until then)."""
    if tensor.device.type != "cuda":
        return tensor.cpu()
    out = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(tensor.device)
    out.copy_(tensor, non_blocking=True)
    wait_for_stream(stream)
    return out


_REGISTERED_PORTABLE = 1
"""`cudaHostRegisterPortable`: pinned for every CUDA context of the process."""


class HostRegistration:
    """`buffers` (contiguous CPU tensors) page-locked for CUDA until `close()`.

    The memory must stay mapped until `close()` returns: unregister before the
    mapping goes (a ring's `close` calls this first). Idempotent close.
    """

    def __init__(self, buffers: list[torch.Tensor]) -> None:
        self._pointers: list[int] = []
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        try:
            for buffer in buffers:
                if not buffer.is_contiguous() or buffer.device.type != "cpu":
                    raise ValueError(
                        f"buffers should be contiguous CPU tensors to pin, got one on "
                        f"{buffer.device} with strides {buffer.stride()}"
                    )
                nbytes = buffer.numel() * buffer.element_size()
                if nbytes == 0:
                    continue
                code = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, _REGISTERED_PORTABLE)
                if int(code) != 0:
                    raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: error {code}")
                self._pointers.append(buffer.data_ptr())
        except BaseException:
            self.close()
            raise

    @property
    def count(self) -> int:
        """How many buffers are registered now."""
        return len(self._pointers)

    def close(self) -> None:
        """Unregister every buffer (the memory itself is the caller's)."""
        pointers, self._pointers = self._pointers, []
        if pointers:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
            for pointer in pointers:
                cudart.cudaHostUnregister(pointer)
