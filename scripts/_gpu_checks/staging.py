"""gpu-check's staging checks: a CUDA model through one backend's pack path each.

One check per backend, so that one backend's failure or hang costs its own timeout
and names itself. Each sends `Staging` (fp32, bf16, fp16; a tensor over one bucket;
a non-contiguous one) twice, bit-exact, and reports the round's GB/s and the pack
stage's staging copies' GB/s, timed with CUDA events on the pack stream.
"""

from __future__ import annotations

import os
from typing import Any

from _gpu_check_core import (
    Figures,
    NotRun,
    StagingTimer,
    check,
    expect,
    run_async,
    send_and_verify,
    workers,
)

ROUNDS = (1, 2)


def staging_rounds(figures: Figures, url: str, info: Any, label: str) -> None:
    """Two rounds of a CUDA `Staging` model over `info`'s backend to the worker at
    `url`, each verified bit-exact; its GB/s and the staging copies' GB/s."""
    from _gpu_check_models import Staging, randomize

    model = Staging(device="cuda")
    expect(not model.noncontig.is_contiguous(), "the model's non-contiguous parameter is not")
    figures["model_mib"] = round(sum(p.nbytes for p in model.parameters()) / 2**20)
    timer = StagingTimer()

    async def rounds() -> Any:
        from asyncwt import HttpClient, ModuleSource, trainer_init

        async with HttpClient(url) as client:
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                for r in ROUNDS:
                    randomize(model, seed=r)
                    stats = await send_and_verify(engine, client, model, f"{label}-{r}", label)
        return stats

    with timer.active():
        stats = run_async(rounds)
    figures["round_gbps"] = round(stats.throughput_gbps, 2)
    for kind, gbps in timer.take().items():
        figures[f"{kind}_gbps"] = gbps


def common() -> dict[str, Any]:
    from _gpu_check_models import BUCKET_BYTES

    return {"rank": 0, "device": "cuda", "bucket_bytes": BUCKET_BYTES}


DESCRIPTION = "a CUDA model (fp32/bf16/fp16, a tensor over a bucket, a non-contiguous one) "


@check("staging-tcp", DESCRIPTION + "over tcp (pinned D2H staging), bit-exact", timeout_s=40)
def staging_tcp(figures: Figures) -> None:
    from asyncwt import TcpTrainerInitInfo

    with workers(("staging", "tcp")) as (url,):
        staging_rounds(figures, url, TcpTrainerInitInfo(**common()), "tcp")


@check("staging-shm", DESCRIPTION + "over shm (host staging read by the worker)", timeout_s=40)
def staging_shm(figures: Figures) -> None:
    from asyncwt import ShmTrainerInitInfo

    with workers(("staging", "shm")) as (url,):
        staging_rounds(figures, url, ShmTrainerInitInfo(**common()), "shm")


@check("staging-gloo", DESCRIPTION + "over torch_dist on gloo, bit-exact", timeout_s=40)
def staging_gloo(figures: Figures) -> None:
    from asyncwt import TorchDistTrainerInitInfo

    info = TorchDistTrainerInitInfo(**common(), group_backend="gloo")
    with workers(("staging", "torch_dist")) as (url,):
        staging_rounds(figures, url, info, "gloo")


@check("staging-cuda-ipc", DESCRIPTION + "over cuda_ipc (device staging ring)", timeout_s=40)
def staging_cuda_ipc(figures: Figures) -> None:
    from asyncwt._backends.cuda_ipc import CudaIpcTrainerInitInfo

    with workers(("staging_cuda", "cuda_ipc")) as (url,):
        staging_rounds(figures, url, CudaIpcTrainerInitInfo(**common()), "cuda_ipc")


@check(
    "staging-nccl",
    DESCRIPTION + "over torch_dist on NCCL to a worker on the second GPU",
    timeout_s=60,
)
def staging_nccl(figures: Figures) -> None:
    import torch

    from asyncwt import TorchDistTrainerInitInfo

    if torch.cuda.device_count() < 2:  # NCCL refuses two ranks on one GPU
        raise NotRun(f"{torch.cuda.device_count()} GPU: NCCL needs the worker on another")
    info = TorchDistTrainerInitInfo(**common(), group_backend="nccl")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="1")
    with workers(("staging_cuda", "torch_dist", env)) as (url,):
        staging_rounds(figures, url, info, "nccl")
