"""Models for `scripts/gpu-check`: the trainer's, and the factories its workers import.

`asyncwt worker --model _gpu_check_models:staging` imports this module by name (gpu-check
puts `scripts/` on the workers' PYTHONPATH), so every factory takes no argument and
returns a model whose weights differ from what the trainer will send.
"""

from __future__ import annotations

import os

import torch
from torch import nn

BUCKET_BYTES = 16 << 20
"""Buckets of the checks' rounds: `Staging.big` spans six of them."""


class Staging(nn.Module):
    """What the pack path must handle, about 140 MiB: fp32, bf16 and fp16 parameters,
    one larger than a bucket (chunked), a non-contiguous one (column-major), a 0-d
    one and an empty one."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()

        def zeros(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.big = nn.Parameter(zeros(24 << 20))  # 96 MiB: six buckets
        self.wbf = nn.Parameter(zeros(4096, 4096, dtype=torch.bfloat16))  # 32 MiB
        self.w16 = nn.Parameter(zeros(1000, 999, dtype=torch.float16))
        self.noncontig = nn.Parameter(zeros(3000, 1024).t())  # 12 MiB, strides (1, 1024)
        self.scalar = nn.Parameter(zeros())
        self.empty = nn.Parameter(zeros(0, 5))
        self.tail = nn.Parameter(zeros(7, dtype=torch.bfloat16))


def staging() -> nn.Module:
    """`Staging` on the CPU: the worker of a CUDA trainer over tcp, shm and gloo."""
    return Staging()


def staging_cuda() -> nn.Module:
    """`Staging` on the worker's current GPU: the worker of `cuda_ipc` (and NCCL)."""
    return Staging(device="cuda")


def fsdp_mlp(seed: int = 1, device: torch.device | str = "cpu") -> nn.Sequential:
    """The MLP the FSDP2 check shards; the worker's copy (seed 1) differs from the
    trainer's (seed 0) before the first round."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.LayerNorm(1024)
    )
    return model.to(device)


def randomize(model: nn.Module, seed: int) -> None:
    """Fill every parameter, on its own device, with values that depend on `seed`; the
    first element of each is -0.0, so that a sign bit lost on the way shows."""
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            generator = torch.Generator(device=param.device).manual_seed(seed * 1000 + index)
            values = torch.randn(
                param.shape, generator=generator, dtype=torch.float32, device=param.device
            )
            if values.numel():
                values.view(-1)[0] = -0.0
            param.copy_(values.to(param.dtype))


def negate(model: nn.Module) -> None:
    """Flip the sign bit of every element in place (on the current stream): every
    parameter's bytes change, zeros included, and the result is exact."""
    with torch.no_grad():
        for param in model.parameters():
            param.neg_()


PERF_PARAM_BYTES = 256 << 20
"""The perf model's parameters: bf16, 256 MiB each (a 4096 x 32768 matrix)."""


def perf_model(device: torch.device | str = "cpu", seed: int | None = None) -> nn.Module:
    """A bf16 model of `GPU_CHECK_PERF_GIB` GiB (default 8) in 256 MiB parameters (one
    parameter below that): zeros, or normal values from `seed` (the trainer's)."""
    total = int(float(os.environ.get("GPU_CHECK_PERF_GIB", "8")) * 2**30)
    each = max(1 << 20, min(PERF_PARAM_BYTES, total))  # a smaller model: one smaller parameter
    params = nn.ParameterList()
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    for _ in range(max(1, round(total / each))):
        shape = (4096, each // 2 // 4096)
        if generator is None:
            value = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        else:
            value = torch.randn(shape, generator=generator, dtype=torch.bfloat16, device=device)
        params.append(nn.Parameter(value, requires_grad=False))
    model = nn.Module()
    model.params = params
    return model


def perf_cpu() -> nn.Module:
    """The perf model on the CPU: the worker of a CUDA trainer over tcp, shm and gloo."""
    return perf_model()


def perf_cuda() -> nn.Module:
    """The perf model on the worker's current GPU: the worker of `cuda_ipc`."""
    return perf_model(device="cuda")


class Flat(nn.Module):
    """One uint8 parameter of `nbytes` bytes (what the memcpy limit copies)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.data = nn.Parameter(torch.ones(nbytes, dtype=torch.uint8), requires_grad=False)
