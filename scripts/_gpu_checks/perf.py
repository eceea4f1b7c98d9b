"""gpu-check's measurements: the machine's limits, then each backend against them.

`limits` measures, in the same run, what each backend is judged against: a
device-to-device copy, pinned D2H and H2D, pageable D2H (CUDA events, 1 GiB), one
core's memcpy and raw loopback TCP (`asyncwt._bench._limits`, as `asyncwt bench`
measures them). Each `perf-*` check sends a bf16 model of `GPU_CHECK_PERF_GIB` GiB
(8 unless set; `gpu-check --perf-gib`) from the GPU to one worker at each bucket
size of `BUCKETS_MIB`: one untimed round, then `TIMED` timed ones, with a 1 ms
sleeper measuring the event loop's lag and the trainer's extra device memory
(`max_memory_allocated` above what it held before `trainer_init`). `perf-cuda-ipc`
also runs a GEMM loop on a stream of its own beside two rounds and compares its
rate with the loop's alone. The parent turns the figures into ratios and judges
them against the targets (`_gpu_check_report.TARGETS`).
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _gpu_check_core import Figures, check, run_async, verify, with_lag_probe, workers

PERF_GIB_ENV = "GPU_CHECK_PERF_GIB"
"""The perf model's size in GiB (read by `_gpu_check_models.perf_model`; default 8)."""
BUCKETS_MIB = (64, 256)
TIMED = 2
"""Timed rounds per bucket size (after one untimed); the figure is their median."""
LIMIT_BYTES = 1 << 30
"""Bytes each limit moves per measurement."""
GEMM_SIZE = 8192
GEMM_SOLO_S = 1.5


def cuda_copy_gbps(dst: Any, src: Any, repeats: int = 3) -> float:
    """GB/s of `dst.copy_(src)` (bytes copied per second), the median of `repeats`
    after one warm-up, timed with CUDA events on the current stream."""
    import torch

    dst.copy_(src, non_blocking=True)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return round(src.nbytes / statistics.median(times) / 1e9, 2)


@check(
    "limits",
    "the limits each backend is judged against: device copy, pinned D2H/H2D, pageable D2H, "
    "one core's memcpy, raw loopback TCP",
    timeout_s=60,
    group="perf",
)
def limits(figures: Figures) -> None:
    import torch
    from _gpu_check_models import Flat

    from asyncwt._backends.shm.cma import default_streams
    from asyncwt._bench._limits import measure_memcpy, measure_raw_loopback
    from asyncwt._bench._util import Rounds

    device = torch.device("cuda", 0)
    src = torch.ones(LIMIT_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    figures["d2d_gbps"] = cuda_copy_gbps(dst, src)
    pinned = torch.zeros(LIMIT_BYTES, dtype=torch.uint8, pin_memory=True)
    figures["pinned_d2h_gbps"] = cuda_copy_gbps(pinned, src)
    figures["pinned_h2d_gbps"] = cuda_copy_gbps(dst, pinned)
    pageable = torch.zeros(LIMIT_BYTES, dtype=torch.uint8)
    figures["pageable_d2h_gbps"] = cuda_copy_gbps(pageable, src)
    del src, dst, pinned, pageable
    rounds = Rounds(rounds=3, warmup=1)
    figures["memcpy_gbps"] = round(measure_memcpy(Flat(LIMIT_BYTES), rounds)["gbps"], 2)
    figures["shm_streams"] = default_streams()
    with tempfile.TemporaryDirectory(prefix="gpu-check-raw-") as log_dir:
        raw = measure_raw_loopback(LIMIT_BYTES, rounds, Path(log_dir))
    figures["tcp_raw_gbps"] = round(raw["gbps"], 2)


class GemmLoop:
    """bf16 GEMMs back to back on a stream of their own, in a thread; their rate."""

    def __init__(self) -> None:
        import torch

        n = GEMM_SIZE
        self.a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        self.b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
        self.c = torch.empty_like(self.a)
        self.stream = torch.cuda.Stream()
        self.flops = 2 * n**3
        torch.mm(self.a, self.b, out=self.c)  # cuBLAS's handle and workspace, not timed
        torch.cuda.synchronize()

    def run(self, stop: Callable[[], bool]) -> float:
        """GEMMs until `stop()`; TFLOP/s."""
        import torch

        count, start = 0, time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not stop() or count == 0:
                for _ in range(8):
                    torch.mm(self.a, self.b, out=self.c)
                self.stream.synchronize()
                count += 8
        return round(count * self.flops / (time.perf_counter() - start) / 1e12, 1)

    def solo(self, seconds: float) -> float:
        end = time.perf_counter() + seconds
        return self.run(lambda: time.perf_counter() >= end)


async def rounds_beside(engine: Any, gemm: GemmLoop, version: str) -> float:
    """`TIMED` rounds of `engine`, the last one `version`, while `gemm` runs in a
    thread; its TFLOP/s meanwhile."""
    import anyio
    import anyio.to_thread

    done = threading.Event()
    rate: list[float] = []

    async def loop() -> None:
        rate.append(await anyio.to_thread.run_sync(gemm.run, done.is_set))

    async with anyio.create_task_group() as tg:
        tg.start_soon(loop)
        try:
            for r in range(TIMED):  # the last one is sent as `version`
                await engine.send_weights(
                    weight_version=version if r == TIMED - 1 else f"{version}-{r}"
                )
        finally:
            done.set()
    return rate[0]


def perf_rounds(
    figures: Figures,
    label: str,
    url: str,
    make_info: Callable[[int], Any],
    device_pool: bool,
    gemm: GemmLoop | None = None,
    device: str = "cuda",
    inspect: Callable[[Any], Figures] | None = None,
) -> None:
    """Rounds of the perf model, made on `device`, over `make_info(bucket_bytes)`'s
    backend at each size of `BUCKETS_MIB`; the last round verified bit-exact.
    `device_pool`: the backend stages on the device (its pool, `num_buffers x
    bucket`, is expected there). On the CPU (the unit test) no memory is measured.
    `inspect(engine)`: figures read off the engine after each size's rounds."""
    import gc

    import torch
    from _gpu_check_models import perf_model

    from asyncwt import HttpClient, ModuleSource, trainer_init

    cuda = torch.device(device).type == "cuda"
    model = perf_model(device=device, seed=0)
    figures["model_gib"] = round(sum(p.nbytes for p in model.parameters()) / 2**30, 2)
    if gemm is not None:
        figures["gemm_solo_tflops"] = gemm.solo(GEMM_SOLO_S)

    async def rounds() -> None:
        version = ""
        async with HttpClient(url) as client:
            for mib in BUCKETS_MIB:
                info = make_info(mib << 20)
                held = 0
                if cuda:
                    gc.collect()
                    torch.cuda.synchronize()
                    held = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                engine = await trainer_init(info, client=client, source=ModuleSource(model))
                rates, lag = [], 0.0
                async with engine:
                    for r in range(1 + TIMED):
                        version = f"{label}-{mib}-{r}"
                        send = functools.partial(engine.send_weights, weight_version=version)
                        stats, worst = await with_lag_probe(send)
                        lag = max(lag, worst)
                        if r:
                            rates.append(stats.throughput_gbps)
                    if gemm is not None and mib == max(BUCKETS_MIB):
                        version = f"{label}-{mib}-gemm"
                        figures["gemm_beside_tflops"] = await rounds_beside(engine, gemm, version)
                    peak = torch.cuda.max_memory_allocated() - held if cuda else 0
                    if inspect is not None:
                        figures.update((f"{mib}mib_{k}", v) for k, v in inspect(engine).items())
                figures[f"{mib}mib_gbps"] = round(statistics.median(rates), 2)
                figures[f"{mib}mib_lag_ms"] = round(lag * 1e3, 1)
                figures[f"{mib}mib_extra_device_mib"] = round(peak / 2**20)
                pool = info.num_buffers * (mib << 20) if device_pool else 0
                figures[f"{mib}mib_device_pool_mib"] = round(pool / 2**20)
            await verify(client, model, version, label)

    run_async(rounds)
    if gemm is not None and "gemm_beside_tflops" in figures:
        figures["gemm_ratio"] = round(
            figures["gemm_beside_tflops"] / figures["gemm_solo_tflops"], 3
        )


def describe(how: str) -> str:
    return (
        f"a bf16 model ({PERF_GIB_ENV}, default 8 GiB) from the GPU over {how} at 64 and 256 "
        "MiB buckets: GB/s, event-loop lag, extra device memory"
    )


@check("perf-tcp", describe("tcp"), timeout_s=75, group="perf")
def perf_tcp(figures: Figures) -> None:
    from asyncwt import TcpTrainerInitInfo

    def info(bucket: int) -> Any:
        return TcpTrainerInitInfo(rank=0, device="cuda", bucket_bytes=bucket)

    with workers(("perf_cpu", "tcp")) as (url,):
        perf_rounds(figures, "tcp", url, info, device_pool=False)


@check("perf-shm", describe("shm (direct reads)"), timeout_s=75, group="perf")
def perf_shm(figures: Figures) -> None:
    from asyncwt import ShmTrainerInitInfo

    def info(bucket: int) -> Any:
        return ShmTrainerInitInfo(rank=0, device="cuda", bucket_bytes=bucket)

    def direct(engine: Any) -> Figures:  # whether the worker read the trainer's memory
        return {"direct": engine.transport.direct}

    with workers(("perf_cpu", "shm")) as (url,):
        perf_rounds(figures, "shm", url, info, device_pool=False, inspect=direct)


@check("perf-gloo", describe("torch_dist on gloo"), timeout_s=90, group="perf")
def perf_gloo(figures: Figures) -> None:
    from asyncwt import TorchDistTrainerInitInfo

    def info(bucket: int) -> Any:
        return TorchDistTrainerInitInfo(
            rank=0, device="cuda", bucket_bytes=bucket, group_backend="gloo"
        )

    with workers(("perf_cpu", "torch_dist")) as (url,):
        perf_rounds(figures, "gloo", url, info, device_pool=False)


@check(
    "perf-cuda-ipc",
    describe("cuda_ipc") + "; a GEMM loop's rate beside its rounds against alone",
    timeout_s=75,
    group="perf",
)
def perf_cuda_ipc(figures: Figures) -> None:
    from asyncwt._backends.cuda_ipc import CudaIpcTrainerInitInfo

    def info(bucket: int) -> Any:
        return CudaIpcTrainerInitInfo(rank=0, device="cuda", bucket_bytes=bucket)

    gemm = GemmLoop()
    with workers(("perf_cuda", "cuda_ipc")) as (url,):
        perf_rounds(figures, "cuda_ipc", url, info, device_pool=True, gemm=gemm)
