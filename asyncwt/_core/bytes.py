"""Zero-copy byte views of CPU tensors, for sockets and hashing (no numpy needed)."""

from __future__ import annotations

import ctypes

import torch

__all__ = ["byte_view", "empty_bytes"]


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable `memoryview` of a contiguous CPU tensor's bytes, without copying.

    The view does not keep `tensor` alive: the caller must hold a reference to the
    tensor for as long as it uses the view.
    """
    if tensor.device.type != "cpu":
        raise ValueError(f"tensor should be on the CPU, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"tensor should be contiguous, got strides {tensor.stride()}")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    return memoryview(array).cast("B")


def empty_bytes(nbytes: int) -> torch.Tensor:
    """A touched (page-faulted-in) uint8 CPU buffer of `nbytes` for reuse as staging.

    Fresh pages cost a fault on first write; touching them once up front keeps the
    first round as fast as the next ones.
    """
    buffer = torch.empty(nbytes, dtype=torch.uint8)
    buffer.zero_()
    return buffer
