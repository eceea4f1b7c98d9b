"""The `"cuda_ipc"` backend. Without CUDA only its absence is checked; the transfer tests
are marked `cuda` and run on the lent GPU machine."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import _models
import pytest
import torch

from asyncwt import (
    CudaIpcTrainerInitInfo,
    HttpClient,
    ModuleSource,
    WeightTransferConfig,
    create_worker_engine,
    model_checksum,
    trainer_init,
)
from asyncwt._worker.launch import worker_process

TESTS = Path(__file__).resolve().parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_cuda_ipc_is_absent_without_cuda_and_says_why() -> None:
    with pytest.raises(
        ValueError,
        match=r"^worker backend 'cuda_ipc' is not available: it needs a CUDA GPU and "
        r"torch\.cuda\.is_available\(\) is False here; registered backends: ",
    ):
        create_worker_engine(WeightTransferConfig(backend="cuda_ipc"), model=torch.nn.Linear(2, 2))


@pytest.mark.cuda
@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.parametrize("workers", [1, 2])
async def test_cuda_ipc_rounds_are_bit_exact(workers: int) -> None:
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    urls = []
    stack = []
    try:
        for _ in range(workers):
            cm = worker_process("_models:mixed_cuda", "--backend", "cuda_ipc", env=env)
            urls.append(cm.__enter__())
            stack.append(cm)
        model = _models.mixed_cuda()
        async with HttpClient(urls) as client:
            info = CudaIpcTrainerInitInfo(rank=0, bucket_bytes=_models.BUCKET_BYTES)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                for r in range(1, 4):
                    _models.randomize(model, seed=r)
                    stats = await engine.send_weights(weight_version=f"ipc-{r}")
                    assert stats.workers == workers
                    expected = model_checksum(model)
                    for status in await client.weights_status(checksum=True):
                        assert (status["weight_version"], status["checksum"]) == (
                            f"ipc-{r}",
                            expected,
                        )
    finally:
        for cm in reversed(stack):
            cm.__exit__(None, None, None)


@pytest.mark.cuda
@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_cuda_ipc_workers_with_an_in_place_transform_each_apply_it_once() -> None:
    """Three workers on the ring whose transform doubles what it is given in place:
    each holds exactly twice the trainer's weights (it was given its own copy of each
    bucket on its GPU, never the ring slot the others read)."""
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    args = ("--backend", "cuda_ipc", "--transform", "_models:doubling_transform")
    with contextlib.ExitStack() as stack:
        urls = [
            stack.enter_context(worker_process("_models:mixed_cuda", *args, env=env))
            for _ in range(3)
        ]
        model = _models.mixed_cuda()
        async with HttpClient(urls) as client:
            info = CudaIpcTrainerInitInfo(rank=0, bucket_bytes=_models.BUCKET_BYTES)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                for r in range(1, 4):
                    _models.randomize(model, seed=r)
                    await engine.send_weights(weight_version=f"ipc-{r}")
                    expected = model_checksum(_models.scaled(model, 2))
                    for status in await client.weights_status(checksum=True):
                        assert (status["weight_version"], status["checksum"]) == (
                            f"ipc-{r}",
                            expected,
                        )
