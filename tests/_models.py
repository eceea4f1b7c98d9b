"""Model factories and worker hooks shared by the end-to-end tests.

The worker server imports these by name (`--model tests._models:mixed`), so every
factory takes no argument and returns a model whose parameters differ from what a
trainer will send.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

BUCKET_BYTES = 256 << 10
"""Small buckets in tests, so that `big` spans several."""


class Mixed(nn.Module):
    """fp32, fp16 and bf16 parameters, a 0-d and an empty one, a non-contiguous one,
    and one larger than a test bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.w32 = nn.Parameter(torch.zeros(64, 32))
        self.w16 = nn.Parameter(torch.zeros(33, 7, dtype=torch.float16))
        self.wbf = nn.Parameter(torch.zeros(129, dtype=torch.bfloat16))
        self.scalar = nn.Parameter(torch.zeros((), dtype=torch.float32))
        self.empty = nn.Parameter(torch.zeros(0, 5))
        self.noncontig = nn.Parameter(torch.zeros(24, 16).t())
        self.big = nn.Parameter(torch.zeros(300_000))
        self.tail = nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))


def mixed() -> nn.Module:
    return Mixed()


LARGE_BUCKET_BYTES = 4 << 20
"""Buckets for `large_slices`: big enough that slices of 1 MiB and more occur."""


class LargeSlices(nn.Module):
    """Slices of a MiB and more between small ones, so that backends which treat long
    slices apart (torch_dist broadcasts them on their own) meet both kinds in a bucket,
    and one parameter chunked over several buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
        self.a = nn.Parameter(torch.zeros(512, 1024))  # 2 MiB
        self.tiny = nn.Parameter(torch.zeros(3, 3, dtype=torch.float16))
        self.c = nn.Parameter(torch.zeros(1024, 700, dtype=torch.float16))  # 1.4 MiB
        self.b = nn.Parameter(
            torch.zeros(3 * 1024 * 1024 + 5, dtype=torch.bfloat16)
        )  # 6 MiB: chunked
        self.tail = nn.Parameter(torch.zeros(7))


def large_slices() -> nn.Module:
    return LargeSlices()


def many_tiny() -> nn.Module:
    return nn.ParameterList([nn.Parameter(torch.zeros(3)) for _ in range(5000)])


def randomize(model: nn.Module, seed: int) -> None:
    """Fill every parameter with values that depend on `seed` (bit patterns included)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(values.to(param.dtype))


def identity_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Routes every parameter through the background applier's copy path."""
    return tensor


def doubling_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Doubles what it is given in place and returns it (elementwise, as the docs allow)."""
    return tensor.mul_(2)


def scaled(model: nn.Module, factor: int) -> nn.Module:
    """A copy of `model` with every parameter times `factor` (`doubling_transform`
    applied once is 2)."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for param in copied.parameters():
            param.mul_(factor)
    return copied


def slow_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Sleeps on `w32`, then leaves a marker file (path from ASYNCWT_TEST_MARKER)."""
    if name == "w32":
        time.sleep(1.5)
        Path(os.environ["ASYNCWT_TEST_MARKER"]).write_text(name)
    return tensor


def failing_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Fails on `w16` from the second round on (ASYNCWT_TEST_FAIL names a file that
    exists when failing is on)."""
    if name == "w16" and Path(os.environ["ASYNCWT_TEST_FAIL"]).exists():
        raise RuntimeError("quantisation of w16 failed on purpose")
    return tensor


def hanging_transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Hangs for ASYNCWT_TEST_HANG_S seconds on `w16` while the file ASYNCWT_TEST_HANG
    names exists: a transform stuck longer than the drain timeout."""
    if name == "w16" and Path(os.environ["ASYNCWT_TEST_HANG"]).exists():
        time.sleep(float(os.environ.get("ASYNCWT_TEST_HANG_S", "3")))
    return tensor


def dtensor_mlp() -> nn.Module:
    """The worker's copy of the model the two-rank trainer shards with FSDP2."""
    return nn.Sequential(nn.Linear(64, 47), nn.ReLU(), nn.Linear(47, 33), nn.LayerNorm(33))


def mixed_cuda() -> nn.Module:
    """`mixed()` on the GPU (for the CUDA backends)."""
    return Mixed().cuda()


def mixed_reading_the_ring() -> nn.Module:
    """`mixed`, in a worker process whose shm receiver never reads the trainer's
    memory: its read probe is made to fail, as a ptrace restriction would."""
    from asyncwt._backends.shm import cma as _cma

    _cma.probe_reads = lambda probe: "the test made this worker read the ring"
    return Mixed()


class AcceptingClient:
    """A control plane that accepts every call and does nothing (for engines whose
    worker side a test fakes, or ranks other than 0 that never call it)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def two_linears() -> nn.Module:
    """A small seeded model: two linear layers."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
