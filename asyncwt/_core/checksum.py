"""A stable checksum of a model's weights, to prove two ends hold the same bytes."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from .bytes import byte_view
from .cuda_sync import to_host
from .source import materialize_full_tensor

__all__ = ["model_checksum", "tensors_checksum"]


def tensors_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over each `(name, dtype, shape, raw bytes)` in the order given.

    Bit-exact: equal values with different bytes (0.0 and -0.0) differ. DTensors are
    gathered (a collective), others moved to the CPU and made contiguous to be read
    (a GPU tensor through pinned memory, the thread sleeping meanwhile: `to_host`).
    """
    digest = hashlib.sha256()
    for name, tensor in named:
        full = to_host(materialize_full_tensor(tensor.detach())).contiguous()
        digest.update(f"{name}|{full.dtype}|{tuple(full.shape)}|".encode())
        digest.update(byte_view(full))
    return digest.hexdigest()


def model_checksum(model: torch.nn.Module) -> str:
    """`tensors_checksum` of `model.named_parameters()`, in their order."""
    return tensors_checksum(model.named_parameters())
