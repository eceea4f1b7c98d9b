"""gpu-check's correctness checks of the CUDA paths (one GPU; NCCL on one rank)."""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _gpu_check_core import (
    MAX_LAG_S,
    CheckFailed,
    Figures,
    check,
    check_timeout,
    expect,
    free_port,
    run_async,
    send_and_verify,
    sleep_cycles,
    tail,
    verify,
    with_lag_probe,
    worker_statuses,
    workers,
)

ROOT = Path(__file__).resolve().parent.parent.parent
MAX_CPU_PER_WAIT_S = 0.3
"""CPU seconds per second of waiting on a GPU event above which the wait is busy."""


def collect_cuda_tests() -> None:
    """`cuda-tests`' preflight: pytest collects the cuda-marked tests (every test
    module imports) in this interpreter, with the carried wheels."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda"]
    cmd += ["-p", "no:cacheprovider", "tests"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"pytest --collect-only exited {done.returncode}:\n{tail(done.stdout + done.stderr)}"
        )
    expect(
        " selected" in done.stdout or "collected" in done.stdout,
        f"pytest collected nothing:\n{tail(done.stdout)}",
    )


@check(
    "cuda-tests",
    "the cuda-marked pytest tests (python -m pytest -q -m cuda tests), none skipped",
    timeout_s=150,
    preflight=collect_cuda_tests,
)
def cuda_tests(figures: Figures) -> None:
    import importlib.metadata
    import importlib.util

    for dist_name in ("pytest", "pytest-asyncio", "pytest-timeout"):
        try:
            figures[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            figures[dist_name] = "missing"
    expect(
        importlib.util.find_spec("pytest_asyncio") is not None,
        "pytest-asyncio is not installed here: run scripts/fetch-gpu-wheels where pip "
        "works and carry .whl (gpu-check installs it)",
    )
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    timeout = check_timeout() - 10
    with tempfile.TemporaryFile("w+") as output:  # kept whole, even when pytest hangs
        try:
            done = subprocess.run(
                cmd, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, timeout=timeout, check=False
            )
            returncode: int | None = done.returncode
        except subprocess.TimeoutExpired:
            returncode = None
        output.seek(0)
        text = output.read()
    print(text, flush=True)
    if returncode is None:
        raise RuntimeError(f"pytest ran past {timeout:.0f}s; it printed:\n{tail(text)}")
    lines = [line for line in text.splitlines() if line.strip()]
    summary = lines[-1] if lines else "(no output)"
    counts = {
        word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", summary)
    }
    figures.update(counts)
    figures["summary"] = summary.strip("= ")
    expect(returncode == 0, f"pytest exited {returncode}: {summary}\n{tail(text)}")
    expect(counts.get("passed", 0) > 0, f"no cuda test passed: {summary}")
    expect("skipped" not in counts, f"cuda tests were skipped on a GPU machine: {summary}")


@check(
    "caller-fence",
    "a slow kernel then an in-place update on the training stream right before "
    "send_weights: the async engine and SyncTrainerEngine both send the updated weights",
    timeout_s=60,
)
def caller_fence(figures: Figures) -> None:
    import torch
    from _gpu_check_models import BUCKET_BYTES, Staging, negate, randomize

    from asyncwt import (
        HttpClient,
        ModuleSource,
        SyncTrainerEngine,
        TcpTrainerInitInfo,
        model_checksum,
        trainer_init,
    )

    kernel_s = 0.5
    cycles = sleep_cycles(kernel_s)
    figures["kernel_s"] = kernel_s
    model = Staging(device="cuda")
    randomize(model, seed=1)
    device = torch.device("cuda", torch.cuda.current_device())

    def info() -> TcpTrainerInitInfo:
        return TcpTrainerInitInfo(rank=0, device="cuda", bucket_bytes=BUCKET_BYTES)

    def judge(who: str, status: dict[str, Any], old: str, new: str) -> None:
        if old == new:
            raise RuntimeError("negating the weights left their checksum unchanged")
        expect(status["weight_version"] == "updated", f"{who}: the worker published {status}")
        expect(
            status["checksum"] != old,
            f"{who}: the worker got the weights from before the update: send_weights did not "
            f"wait for the work queued on the caller's stream",
        )
        expect(
            status["checksum"] == new,
            f"{who}: the worker got weights neither from before nor after the update (the "
            f"round read them while the update ran on the caller's stream)",
        )

    async def async_engine(url: str) -> None:
        train = torch.cuda.Stream(device)
        async with HttpClient(url) as client:
            engine = await trainer_init(info(), client=client, source=ModuleSource(model))
            async with engine:
                await send_and_verify(engine, client, model, "before", "the async engine")
                old = model_checksum(model)
                train.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(train):
                    torch.cuda._sleep(cycles)
                    negate(model)
                    stats = await engine.send_weights(weight_version="updated")
                train.synchronize()
                figures["async_round_s"] = round(stats.wall_s, 3)
                (status,) = await client.weights_status(checksum=True)
                judge("the async engine", status, old, model_checksum(model))

    def sync_facade(url: str) -> None:
        with SyncTrainerEngine(info(), client=HttpClient(url), source=ModuleSource(model)) as eng:
            eng.send_weights(weight_version="before")
            torch.cuda.synchronize(device)
            old = model_checksum(model)
            box: dict[str, Any] = {}

            def training_thread() -> None:
                try:
                    torch.cuda.set_device(device)
                    stream = torch.cuda.Stream(device)
                    stream.wait_stream(torch.cuda.default_stream(device))
                    with torch.cuda.stream(stream):
                        torch.cuda._sleep(cycles)
                        negate(model)
                        box["stats"] = eng.send_weights(weight_version="updated")
                    stream.synchronize()
                except BaseException as exc:  # noqa: BLE001 - re-raised in the check's thread
                    box["error"] = exc

            thread = threading.Thread(target=training_thread, name="training", daemon=True)
            thread.start()
            thread.join(30)
            if thread.is_alive():
                raise RuntimeError("SyncTrainerEngine.send_weights did not return within 30 s")
            if "error" in box:
                raise box["error"]
            figures["sync_round_s"] = round(box["stats"].wall_s, 3)
            (status,) = worker_statuses([url])
            judge("SyncTrainerEngine", status, old, model_checksum(model))

    failures = []
    with workers(("staging", "tcp"), ("staging", "tcp")) as (async_url, sync_url):
        parts = (lambda: run_async(async_engine, async_url), lambda: sync_facade(sync_url))
        for part in parts:  # both are judged, whichever fails
            try:
                part()
            except CheckFailed as exc:
                failures.append(str(exc))
    expect(not failures, "; ".join(failures))


@check(
    "nccl-world1",
    "a world-size-1 NCCL group from asyncwt's _new_group: a CUDA broadcast arrives, "
    "work.wait() returns, and the group's options carry asyncwt's timeout plus the margin",
    timeout_s=30,
)
def nccl_world1(figures: Figures) -> None:
    import torch
    import torch.distributed as dist

    from asyncwt._backends.torch_dist import WATCHDOG_MARGIN_S, _new_group, _release_group

    device = torch.device("cuda", 0)
    timeout_s = 37.0  # distinctive: the group must carry this one, not a default
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    group = _new_group("nccl", dist.PrefixStore("gpu-check/", store), 0, 1, timeout_s, device)
    try:
        figures["group"] = type(group).__name__
        sent = torch.arange(1 << 20, dtype=torch.float32, device=device).to(torch.bfloat16)
        buffer = sent.clone()
        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = group.broadcast([buffer], options)
        waited: list[Any] = []
        waiter = threading.Thread(target=lambda: waited.append(work.wait()), daemon=True)
        waiter.start()
        waiter.join(20)
        expect(not waiter.is_alive(), "work.wait() did not return within 20 s")
        figures["wait_returned"] = waited[0] if waited else None
        torch.cuda.synchronize(device)  # wait() only orders the current stream after it
        expect(torch.equal(buffer, sent), "the broadcast changed the tensor's contents")
        carried = group.options._timeout
        figures["options_timeout_s"] = carried.total_seconds()
        # torch's (its watchdog's) is later than asyncwt's, which every wait passes.
        expected = datetime.timedelta(seconds=timeout_s + WATCHDOG_MARGIN_S)
        expect(
            carried == expected,
            f"the group's options carry a timeout of {carried}, not {expected} "
            f"({timeout_s} s asked, plus WATCHDOG_MARGIN_S)",
        )
    finally:
        _release_group(group)


@check(
    "lag-probe",
    "rounds of a CUDA model to a tcp and an shm worker while a 1 ms sleeper measures "
    f"the trainer's event-loop lag (fails over {MAX_LAG_S * 1e3:.0f} ms)",
    timeout_s=45,
)
def lag_probe(figures: Figures) -> None:
    from _gpu_check_models import BUCKET_BYTES, Staging, randomize

    from asyncwt import (
        HttpClient,
        ModuleSource,
        ShmTrainerInitInfo,
        TcpTrainerInitInfo,
        trainer_init,
    )

    model = Staging(device="cuda")

    async def rounds(url: str, info: Any, label: str) -> float:
        worst = 0.0
        async with HttpClient(url) as client:
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                for r in (1, 2, 3):
                    randomize(model, seed=r)
                    send = functools.partial(engine.send_weights, weight_version=f"{label}-{r}")
                    stats, lag = await with_lag_probe(send)
                    worst = max(worst, lag)
                    figures[f"{label}_gbps"] = round(stats.throughput_gbps, 2)
                    await verify(client, model, f"{label}-{r}", label)
        return worst

    common = {"rank": 0, "device": "cuda", "bucket_bytes": BUCKET_BYTES}
    with workers(("staging", "tcp"), ("staging", "shm")) as (tcp_url, shm_url):
        lags = {
            "tcp": run_async(rounds, tcp_url, TcpTrainerInitInfo(**common), "tcp"),
            "shm": run_async(rounds, shm_url, ShmTrainerInitInfo(**common), "shm"),
        }
    for label, lag in lags.items():
        figures[f"{label}_max_lag_ms"] = round(lag * 1e3, 2)
    blocked = [f"{label} {lag * 1e3:.0f} ms" for label, lag in lags.items() if lag > MAX_LAG_S]
    expect(not blocked, f"the trainer's event loop stalled during a round: {', '.join(blocked)}")


@check(
    "event-wait-idle",
    "await DeviceLane.wait(event) on a ~1 s kernel keeps no core busy "
    f"(fails over {MAX_CPU_PER_WAIT_S} CPU s per s waited)",
    timeout_s=30,
)
def event_wait_idle(figures: Figures) -> None:
    import torch

    from asyncwt._core.lanes import DeviceLane

    cycles = sleep_cycles(1.0)
    lane = DeviceLane(torch.device("cuda", 0))

    async def wait() -> tuple[float, float, bool]:
        with lane.activate():
            torch.cuda._sleep(cycles)
        event = lane.record()
        cpu, wall = time.process_time(), time.perf_counter()
        await DeviceLane.wait(event)
        return time.perf_counter() - wall, time.process_time() - cpu, event.query()

    wall, cpu, over = run_async(wait)
    figures.update(wait_s=round(wall, 3), cpu_s=round(cpu, 3), cpu_per_s=round(cpu / wall, 3))
    expect(over, "DeviceLane.wait returned before the kernel was over")
    if wall < 0.5:
        raise RuntimeError(f"the kernel lasted {wall:.2f}s, too short to measure the wait")
    expect(
        cpu / wall <= MAX_CPU_PER_WAIT_S,
        f"waiting {wall:.2f}s on the event took {cpu:.2f}s of CPU: the wait spins (a "
        f"torch.cuda.Event synchronizes by spinning unless made with blocking=True, "
        f"cudaEventBlockingSync)",
    )


@check(
    "fsdp2-nccl",
    "a 1-rank FSDP2 model (NCCL default group) trained and sent over tcp, bit-exact",
    timeout_s=60,
)
def fsdp2_nccl(figures: Figures) -> None:
    import torch
    import torch.distributed as dist
    from _gpu_check_models import fsdp_mlp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from asyncwt import HttpClient, ModuleSource, TcpTrainerInitInfo, trainer_init

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0"}
    os.environ.update(env, WORLD_SIZE="1", LOCAL_RANK="0")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=60))
    try:
        model = fsdp_mlp(seed=0, device=device)
        mesh = init_device_mesh("cuda", (1,))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = list(model.parameters())
        figures["dtensor_params"] = f"{sum(isinstance(p, DTensor) for p in params)}/{len(params)}"
        expect(all(isinstance(p, DTensor) for p in params), "fully_shard left plain tensors")

        async def train(url: str) -> None:
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
            data = torch.Generator(device=device).manual_seed(0)
            info = TcpTrainerInitInfo(rank=0, device="cuda", bucket_bytes=4 << 20)
            async with HttpClient(url) as client:
                engine = await trainer_init(info, client=client, source=ModuleSource(model))
                async with engine:
                    for step in (1, 2):
                        inputs = torch.randn(64, 1024, generator=data, device=device)
                        model(inputs).square().mean().backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        stats = await send_and_verify(
                            engine, client, model, f"step-{step}", "fsdp2"
                        )
                        figures["round_gbps"] = round(stats.throughput_gbps, 2)

        with workers(("fsdp_mlp", "tcp")) as (url,):
            run_async(train, url)
    finally:
        dist.destroy_process_group()


@check(
    "ipc-reinit",
    "two cuda_ipc workers; rounds, engine shutdown, the freed memory refilled, a new "
    "trainer_init, rounds of other weights: bit-exact on both workers throughout",
    timeout_s=60,
)
def ipc_reinit(figures: Figures) -> None:
    import gc

    import torch
    from _gpu_check_models import BUCKET_BYTES, Staging, randomize

    from asyncwt import HttpClient, ModuleSource, trainer_init
    from asyncwt._backends.cuda_ipc import CudaIpcTrainerInitInfo

    model = Staging(device="cuda")
    junk: list[torch.Tensor] = []

    async def rounds(urls: list[str]) -> None:
        async with HttpClient(urls) as client:
            for life, seeds in enumerate(((1, 2), (3, 4, 5)), start=1):
                info = CudaIpcTrainerInitInfo(rank=0, device="cuda", bucket_bytes=BUCKET_BYTES)
                engine = await trainer_init(info, client=client, source=ModuleSource(model))
                async with engine:
                    for seed in seeds:
                        randomize(model, seed=seed)
                        where = f"engine {life}, round of seed {seed}"
                        await send_and_verify(engine, client, model, f"seed-{seed}", where)
                    held = torch.cuda.memory_allocated()
                if life == 1:  # the ring is freed: take its memory and scribble on it
                    gc.collect()
                    freed = held - torch.cuda.memory_allocated()
                    figures["freed_at_shutdown_mib"] = round(freed / 2**20)
                    for _ in range(2 * info.num_buffers + 2):
                        junk.append(
                            torch.full((BUCKET_BYTES,), 0xA5, dtype=torch.uint8, device="cuda")
                        )
                    torch.cuda.synchronize()

    with workers(("staging_cuda", "cuda_ipc"), ("staging_cuda", "cuda_ipc")) as urls:
        run_async(rounds, urls)
    figures["rounds"] = 5


@check(
    "cpu-model-gloo",
    "a CPU model's torch_dist trainer with device unset uses gloo and allocates no CUDA memory",
    timeout_s=45,
)
def cpu_model_gloo(figures: Figures) -> None:
    import torch
    from _gpu_check_models import BUCKET_BYTES, Staging, randomize

    from asyncwt import HttpClient, ModuleSource, TorchDistTrainerInitInfo, trainer_init

    torch.cuda.init()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    model = Staging()

    async def rounds(url: str) -> None:
        async with HttpClient(url) as client:
            info = TorchDistTrainerInitInfo(rank=0, bucket_bytes=BUCKET_BYTES)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                figures["group_backend"] = engine.transport.group_backend
                figures["device"] = str(getattr(engine.transport, "device", "?"))
                expect(
                    engine.transport.group_backend == "gloo",
                    f"a CPU model's trainer chose {engine.transport.group_backend!r}, not gloo",
                )
                for r in (1, 2):
                    randomize(model, seed=r)
                    await send_and_verify(engine, client, model, f"gloo-{r}", "gloo")

    with workers(("staging", "torch_dist")) as (url,):
        run_async(rounds, url)
    after, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    figures.update(cuda_allocated_delta=after - before, cuda_peak_delta=peak - before)
    expect(
        after == before and peak == before,
        f"the CPU model's rounds allocated CUDA memory: {peak - before} bytes at the peak, "
        f"{after - before} still held",
    )


FORK_PROBE = """
import json, os, sys, traceback
import torch
import asyncwt, asyncwt._vllm.plugin
result = {"initialized_after_import": torch.cuda.is_initialized()}
pid = os.fork()
if pid == 0:
    try:
        x = torch.ones(1 << 20, device="cuda")
        ok = int(x.sum().item()) == 1 << 20
        torch.cuda.synchronize()
        os._exit(0 if ok else 3)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(4)
_, status = os.waitpid(pid, 0)
result["child_exit"] = os.waitstatus_to_exitcode(status)
print(json.dumps(result))
"""


@check(
    "fork-after-import",
    "import asyncwt (and its vLLM plugin) leaves CUDA uninitialised; a fork then uses CUDA",
    timeout_s=30,
)
def fork_after_import(figures: Figures) -> None:
    done = subprocess.run(
        [sys.executable, "-c", FORK_PROBE],
        capture_output=True,
        text=True,
        timeout=check_timeout() - 5,
        check=False,
    )
    print(done.stdout + done.stderr, flush=True)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"the probe exited {done.returncode}:\n{tail(done.stderr)}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    figures.update(result)
    expect(
        not result["initialized_after_import"],
        "import asyncwt initialised CUDA (torch.cuda.is_initialized() is True after it)",
    )
    last = (done.stderr.strip().splitlines() or [""])[-1]
    expect(
        result["child_exit"] == 0,
        f"a child forked after import asyncwt could not use CUDA (exit "
        f"{result['child_exit']}): {last}\n{tail(done.stderr, 12)}",
    )
