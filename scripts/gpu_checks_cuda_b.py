"""GPU checks of issue 33, findings 8-14: what `tests/test_gpu_paths_b.py` proves on
the CPU with a fake of `torch.cuda`, measured on a real GPU.

Each check is `check_<name>(ctx) -> dict`: the figures it measured and `"pass"`
(True, False, or None with `"not_run"` saying why: a check that needs two GPUs on
a one-GPU machine). `ctx` is the runner's and is not read: every check takes GPU 0
(or 0 and 1) itself and cleans up after itself. `CHECKS` lists them in order; each
takes well under 20 s on an H200 (child processes included).

Run alone (from the repository root): `PYTHONPATH=. python3 scripts/gpu_checks_cuda_b.py`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncwt import ModuleSource

ROOT = Path(__file__).resolve().parent.parent

MAX_CPU_PER_WAIT_S = 0.3
"""CPU seconds per second of waiting above which a wait spins."""
MAX_LAG_S = 0.1
"""An event-loop stall longer than this means something blocked the loop."""

Figures = dict[str, Any]


def _child(code: str, env: dict[str, str] | None = None, stdin: str = "") -> Figures:
    """Run `code` in a fresh Python (its own CUDA context and allocator settings);
    it prints one JSON object last, which is returned."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        env=full_env,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"child failed ({out.returncode}): {out.stderr[-2000:]}")
    result: Figures = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def _sleep_cycles(seconds: float) -> int:
    """`torch.cuda._sleep` cycles lasting about `seconds` on this GPU (measured twice:
    the second time at the clock a busy GPU holds)."""
    import torch

    probe = 50_000_000
    rate = 0.0
    for _ in range(2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        rate = probe / (start.elapsed_time(end) / 1e3)
    return int(rate * seconds)


@contextlib.contextmanager
def _cpu_meter() -> Iterator[Figures]:
    """Wall and process CPU seconds of the enclosed block (every thread's CPU)."""
    figures: Figures = {}
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield figures
    finally:
        figures["wall_s"] = round(time.perf_counter() - wall, 3)
        figures["cpu_s"] = round(time.process_time() - cpu, 3)
        figures["cpu_per_s"] = round(figures["cpu_s"] / max(figures["wall_s"], 1e-9), 3)


class _Client:
    """A control plane that accepts everything."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


# -- 8: the ring's handles export asyncwt's own blocks only -----------------------------

_RING_EXPORT = """
import base64, json, torch
from asyncwt._transports import cuda_ipc
device = torch.device("cuda", 0)
trainer = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # the trainer's tensors
ring = cuda_ipc.take_ring(device, 48 << 20, 2)
for i, block in enumerate(ring):
    block.fill_(i + 7)
torch.cuda.synchronize()
sender = cuda_ipc.CudaIpcSender.__new__(cuda_ipc.CudaIpcSender)
sender.buffers, sender.device = ring, device
exported = sender.exported()
segments = torch.cuda.memory_snapshot()
def segment_of(tensor):
    ptr = tensor.data_ptr()
    for s in segments:
        if s["address"] <= ptr < s["address"] + s["total_size"]:
            return {"size": s["total_size"], "blocks": len(s["blocks"]),
                    "expandable": bool(s.get("is_expandable", False))}
try:  # the caching allocator's own export of a trainer tensor, for contrast
    plain = f"{len(trainer.untyped_storage()._share_cuda_()[1])} bytes"
except Exception as exc:
    plain = f"{type(exc).__name__}: {exc}"
print(json.dumps({
    "exported": exported,
    "ring_segments": [segment_of(b) for b in ring],
    "block_bytes": cuda_ipc.block_bytes(48 << 20),
    "trainer_segment": segment_of(trainer),
    "trainer_tensor_handle": plain,
}), flush=True)
import sys; sys.stdin.read()  # keep the ring alive until the worker has read it
"""

_RING_IMPORT = """
import json, sys, torch
from asyncwt._transports import cuda_ipc
info = json.loads(sys.stdin.read())
receiver = cuda_ipc.CudaIpcReceiver.__new__(cuda_ipc.CudaIpcReceiver)
receiver.handles, receiver.gpu = info["ipc_buffers"], info["ipc_gpu"]
receiver.device = torch.device("cuda", 0)
receiver.plan = type("P", (), {"bucket_bytes": 48 << 20})()
buffers = receiver.map_ring()
print(json.dumps({"first_bytes": [int(b[0]) for b in buffers],
                  "last_bytes": [int(b[-1]) for b in buffers]}))
"""


def check_ipc_ring_own_allocations(ctx: object) -> Figures:
    """Under `expandable_segments:True`, each ring block is a whole non-expandable
    segment of its own, and another process maps it without ptrace rights."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    exporter = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_RING_EXPORT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        line = exporter.stdout.readline()
        if not line:
            raise RuntimeError(f"exporter failed: {exporter.stderr.read()[-2000:]}")  # type: ignore[union-attr]
        exported = json.loads(line)
        worker = _child(_RING_IMPORT, env, stdin=json.dumps(exported["exported"]))
        exporter.stdin.close()
        exporter.wait(timeout=30)
    finally:
        if exporter.poll() is None:
            exporter.kill()
    ring = exported["ring_segments"]
    own = all(
        s is not None
        and s["blocks"] == 1
        and not s["expandable"]
        and s["size"] == exported["block_bytes"]
        for s in ring
    )
    figures: Figures = {
        "ring_segments": ring,
        "trainer_segment": exported["trainer_segment"],
        "worker_read": worker,
        "ring_handle_sizes": [e["size"] for e in exported["exported"]["ipc_buffers"]],
    }
    figures["pass"] = own and worker["first_bytes"] == [7, 8] and worker["last_bytes"] == [7, 8]
    return figures


# -- 9: a worker on another GPU maps the ring on its own GPU -----------------------------


def _primary_context_active(ordinal: int) -> bool:
    """Whether this process holds a primary CUDA context on device `ordinal` (driver API)."""
    cuda = ctypes.CDLL("libcuda.so.1")
    if cuda.cuInit(0) != 0:
        raise RuntimeError("cuInit failed")
    device = ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
        raise RuntimeError(f"cuDeviceGet({ordinal}) failed")
    flags, active = ctypes.c_uint(), ctypes.c_int()
    if cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) != 0:
        raise RuntimeError("cuDevicePrimaryCtxGetState failed")
    return bool(active.value)


_MAP_ON_OWN = """
import json, sys, torch
sys.path.insert(0, {scripts!r})
from gpu_checks_cuda_b import _primary_context_active
from asyncwt._transports import cuda_ipc
info = json.loads(sys.stdin.read())
torch.cuda.set_device(1)
receiver = cuda_ipc.CudaIpcReceiver.__new__(cuda_ipc.CudaIpcReceiver)
receiver.handles, receiver.gpu = info["ipc_buffers"], info["ipc_gpu"]
receiver.device = torch.device("cuda", 1)
receiver.plan = type("P", (), {{"bucket_bytes": 48 << 20}})()
buffers = receiver.map_ring()
local = buffers[0].to("cuda:1", copy=True)
torch.cuda.synchronize(1)
print(json.dumps({{"mapped_on": [b.device.index for b in buffers], "value": int(local[0]),
                  "context_on_trainer_gpu": _primary_context_active(0)}}))
"""


def check_ipc_map_on_own_gpu(ctx: object) -> Figures:
    """A worker on GPU 1 maps a ring of GPU 0 on GPU 1 (peer access), and creates no
    CUDA context on GPU 0."""
    import torch

    if torch.cuda.device_count() < 2:
        return {"pass": None, "not_run": "needs two GPUs", "gpus": torch.cuda.device_count()}
    from asyncwt._transports import cuda_ipc

    device = torch.device("cuda", 0)
    ring = cuda_ipc.take_ring(device, 48 << 20, 1)
    ring[0].fill_(42)
    torch.cuda.synchronize()
    sender = cuda_ipc.CudaIpcSender.__new__(cuda_ipc.CudaIpcSender)
    sender.buffers, sender.device = ring, device
    code = _MAP_ON_OWN.format(scripts=str(ROOT / "scripts"))
    worker = _child(code, stdin=json.dumps(sender.exported()))
    cuda_ipc.shelve_ring(ring)
    figures: Figures = {
        "worker": worker,
        "peer_access": torch.cuda.can_device_access_peer(1, 0),
    }
    figures["pass"] = (
        worker["mapped_on"] == [1]
        and worker["value"] == 42
        and not worker["context_on_trainer_gpu"]
    )
    return figures


# -- 10: delta buckets scattered on the GPU ----------------------------------------------


def check_delta_scatters_on_gpu(ctx: object) -> Figures:
    """A GPU worker applies a delta bucket (1 byte in 400 changed) into its
    parameters: no host shadow, bit-exact, and only the changes cross the bus (counted from the body)."""
    import torch

    from asyncwt._core.plan import TransferPlan
    from asyncwt._delta.codec import encode, unit_of
    from asyncwt._delta.receiver import WorkerDelta
    from asyncwt._transports.base import ReceivedBucket
    from asyncwt._worker.applier import ModelTarget

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4))).to(
        device="cuda:0", dtype=torch.bfloat16
    )
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=64 << 20)
    params = dict(model.named_parameters())
    target = ModelTarget.resolve(model, plan, None, in_place=False)
    delta = WorkerDelta(plan)
    applied = delta.applied(delta.adapt(target))

    def segments(bucket: Any) -> list[torch.Tensor]:
        return [
            params[plan.params[s.param].name]
            .detach()
            .reshape(-1)
            .view(torch.uint8)[s.start : s.start + s.nbytes]
            .cpu()
            for s in bucket.slices
        ]

    body_bytes = payload = 0
    exact = True
    with _cpu_meter() as timing:
        for bucket in plan.buckets:
            old = segments(bucket)
            new = [part.clone() for part in old]
            for part in new:
                part[::400] += 1
            coded = encode(new, torch.cat(old), unit_of(bucket))
            assert isinstance(coded.body, bytes)
            body = torch.frombuffer(bytearray(coded.body), dtype=torch.uint8)
            run = delta.prepare(
                applied, ReceivedBucket(bucket, body, lambda: None, coded=coded.header)
            )
            assert run is not None
            run()
            exact &= all(torch.equal(a, b) for a, b in zip(segments(bucket), new))
            body_bytes += len(coded.body)
            payload += bucket.payload_bytes
    figures: Figures = {
        "buckets": len(plan.buckets),
        "payload_bytes": payload,
        "uploaded_body_bytes": body_bytes,
        "host_shadow_bytes": delta.shadow_bytes,
        "all_on_device": all(applied.direct),
        "bit_exact": exact,
        **timing,
    }
    figures["pass"] = (
        exact and delta.shadow_bytes == 0 and all(applied.direct) and body_bytes < payload // 10
    )
    return figures


# -- 11: staging allocated at init, in a thread --------------------------------------------


async def _lag_while(fn: Callable[[], Any]) -> tuple[Any, float]:
    """Run `fn()` (a coroutine function) while a ticker measures the loop's worst stall."""
    import anyio

    worst = 0.0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(0.005)
            now = time.perf_counter()
            worst = max(worst, now - last - 0.005)
            last = now

    result: Any = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        try:
            result = await fn()
        finally:
            done.set()
    return result, worst


def _engine_with(transport: Any) -> Any:
    from asyncwt import TcpTrainerInitInfo
    from asyncwt._trainer.engine import PipelinedTrainerEngine

    class Engine(PipelinedTrainerEngine[Any]):
        init_info_cls = TcpTrainerInitInfo

        @classmethod
        def make_transport(cls, info: Any, plan: Any, device: Any) -> Any:
            return transport

    return Engine


class _NullTransport:
    """A sender transport that sends nothing (the engine's staging is under test)."""

    own_staging = False
    min_view_bytes = None
    in_flight_buckets = 1
    num_workers = 1

    def prepare(self) -> None: ...

    def staging(self, slot: int) -> None:
        return None

    async def reclaim(self, slot: int) -> None: ...

    async def rendezvous(self, worker_fields: Any, init_workers: Any) -> None: ...

    def check_usable(self) -> None: ...

    async def begin_round(self, round_id: int) -> None: ...

    async def send_bucket(self, bucket: Any, slot: int, segments: Any) -> None: ...

    async def end_round(self) -> None: ...

    async def abort_round(self, reason: str) -> None: ...

    def close(self) -> None: ...


def check_staging_at_init_off_the_loop(ctx: object) -> Figures:
    """A GPU trainer with 2 x 1 GiB buckets: init allocates both pinned staging
    buffers in a thread (the loop never stalls), and the first round allocates none."""
    import anyio
    import torch

    from asyncwt import TcpTrainerInitInfo
    from asyncwt._trainer.lanes import staging_buffer

    model = torch.nn.Linear(4096, 4096, device="cuda:0")
    engine_cls = _engine_with(_NullTransport())
    info = TcpTrainerInitInfo(rank=0, device="cuda:0", bucket_bytes=1 << 30, num_buffers=2)

    async def init() -> Any:
        return await engine_cls.trainer_init(info, client=_Client(), source=ModuleSource(model))

    engine, init_lag = anyio.run(_lag_while, init)
    pool = engine._pool
    pinned = all(pool.buffer(slot).is_pinned() for slot in range(pool.count))
    allocated = pool.allocated_bytes

    async def round_() -> Any:
        return await engine.send_weights()

    _, round_lag = anyio.run(_lag_while, round_)
    start = time.perf_counter()
    staging_buffer(1 << 30, torch.device("cuda", 0))  # what round 1 used to do on the loop
    on_loop_s = time.perf_counter() - start
    anyio.run(engine.shutdown)
    figures: Figures = {
        "init_max_lag_s": round(init_lag, 3),
        "round_max_lag_s": round(round_lag, 3),
        "allocated_at_init_bytes": allocated,
        "pinned": pinned,
        "one_slot_allocation_s": round(on_loop_s, 3),
    }
    figures["pass"] = (
        allocated == 2 << 30 and pinned and init_lag < MAX_LAG_S and round_lag < MAX_LAG_S
    )
    return figures


# -- 12: gloo staging pinned, the shm ring registered ---------------------------------------


def check_pinned_gloo_and_shm_ring(ctx: object) -> Figures:
    """A GPU trainer's gloo staging is pinned and its shm ring registered: a copy of a
    256 MiB bucket into either is queued (returns at once) and runs at pinned speed."""
    import torch

    from asyncwt import ShmTrainerInitInfo, TorchDistTrainerInitInfo
    from asyncwt._core.plan import TransferPlan
    from asyncwt._transports.shm.backend import ShmSender
    from asyncwt._transports.torch_dist import TorchDistSender

    nbytes = 256 << 20
    device = torch.device("cuda", 0)
    model = torch.nn.Linear(8, 8)
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=nbytes)
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    gloo = TorchDistSender(
        TorchDistTrainerInitInfo(rank=0, group_backend="gloo", num_buffers=1), plan, device
    )
    shm = ShmSender(ShmTrainerInitInfo(rank=0, bucket_bytes=nbytes, num_buffers=1), plan, device)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pageable.zero_()

    def copy_rate(dst: torch.Tensor) -> tuple[float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(source, non_blocking=True)
        queued = time.perf_counter() - start
        torch.cuda.synchronize()
        return queued, nbytes / (time.perf_counter() - start) / 1e9

    try:
        gloo.prepare()
        shm.prepare()
        gloo_buf, ring = gloo.staging(0), shm.buffers[0]
        copy_rate(gloo_buf)  # warm up
        figures: Figures = {
            "gloo_pinned": gloo_buf.is_pinned(),
            "ring_pinned": ring.is_pinned(),
        }
        for name, dst in (("gloo", gloo_buf), ("ring", ring), ("pageable", pageable)):
            queued, rate = copy_rate(dst)
            figures[f"{name}_queue_s"] = round(queued, 4)
            figures[f"{name}_GBps"] = round(rate, 1)
            if name != "pageable":
                figures[f"{name}_bit_exact"] = bool(torch.equal(dst, source.cpu()))
    finally:
        gloo.close()
        shm.close()
    figures["pass"] = (
        figures["gloo_pinned"]
        and figures["ring_pinned"]
        and figures["gloo_bit_exact"]
        and figures["ring_bit_exact"]
    )
    return figures


# -- 13: a non-sender rank's stream waits for its lanes ---------------------------------


class _SlowSource(ModuleSource):
    """A model's source whose gathers take a while on the device: a sleep kernel
    first, on the stream current in the iterate thread (the iterate lane's)."""

    def __init__(self, model: Any, cycles: int) -> None:
        super().__init__(model)
        self.cycles = cycles
        self.lane_done: Any = None

    def iter_full(self) -> Iterator[tuple[str, Any]]:
        import torch

        torch.cuda._sleep(self.cycles)
        yield from super().iter_full()
        self.lane_done = torch.cuda.Event()
        self.lane_done.record()


def check_non_sender_rank_joins_lanes(ctx: object) -> Figures:
    """Rank 1 returns from `send_weights` while its iterate lane still runs a 0.5 s
    kernel; work queued next on its stream runs only after that kernel."""
    import anyio
    import torch

    from asyncwt import TcpTrainerInitInfo, trainer_init

    model = torch.nn.Linear(256, 256, device="cuda:0")
    source = _SlowSource(model, _sleep_cycles(0.5))

    async def round_() -> dict[str, Any]:
        engine: Any = await trainer_init(
            TcpTrainerInitInfo(rank=1, device="cuda:0"), client=_Client(), source=source
        )
        await engine.send_weights()
        returned = time.perf_counter()
        after = torch.cuda.Event()
        after.record()  # what the next training step would queue
        after.synchronize()
        lane_over_first = source.lane_done.query()
        await engine.shutdown()
        return {
            "caller_waited_s": round(time.perf_counter() - returned, 3),
            "lane_over_first": lane_over_first,
        }

    figures = anyio.run(round_)
    figures["pass"] = bool(figures["lane_over_first"])
    return figures


# -- 14: no spinning host waits, no device-wide sync on close -------------------------------


def check_no_spin_waits(ctx: object) -> Figures:
    """(a) packing a GPU tensor into pageable staging behind a 1 s gather sleeps; (b)
    `to_host` (checksums) behind a 1 s kernel sleeps; (c) `shutdown` and a cuda_ipc
    sender's close return while a 2 s training kernel runs on the default stream."""
    import anyio
    import torch

    from asyncwt import CudaIpcTrainerInitInfo, TcpTrainerInitInfo
    from asyncwt._core.cuda_sync import to_host
    from asyncwt._core.plan import TransferPlan
    from asyncwt._trainer.lanes import DeviceLane
    from asyncwt._trainer.pipeline import PipelineConfig, StagingPool, run_pipeline
    from asyncwt._transports.cuda_ipc import CudaIpcSender

    device = torch.device("cuda", 0)
    second = _sleep_cycles(1.0)
    model = torch.nn.Linear(1024, 1024, device=device)

    class PageableSink(_NullTransport):
        def __init__(self, plan: TransferPlan) -> None:
            self.buffer = torch.zeros(plan.bucket_bytes, dtype=torch.uint8)  # pageable

        def staging(self, slot: int) -> Any:
            return self.buffer

    source = _SlowSource(model, second)
    plan = TransferPlan.build(source.metadata, bucket_bytes=16 << 20)
    lanes = [DeviceLane(device) for _ in range(2)]

    async def pack() -> None:
        await run_pipeline(
            plan,
            source,  # type: ignore[arg-type]
            PageableSink(plan),  # type: ignore[arg-type]
            pool=StagingPool(2, plan.bucket_bytes, device),
            iterate_lane=lanes[0],
            pack_lane=lanes[1],
            config=PipelineConfig(num_buffers=2),
            fence=lanes[0].record_caller(),
        )

    with _cpu_meter() as packing:
        anyio.run(pack)
    torch.cuda._sleep(second)
    with _cpu_meter() as checksum:
        to_host(model.weight)
    engine: Any = anyio.run(
        functools.partial(
            _engine_with(_NullTransport()).trainer_init,
            TcpTrainerInitInfo(rank=0, device="cuda:0", bucket_bytes=1 << 20),
            client=_Client(),
            source=ModuleSource(model),
        )
    )
    sender = CudaIpcSender(
        CudaIpcTrainerInitInfo(rank=0, bucket_bytes=1 << 20), _small_plan(model), device
    )
    torch.cuda._sleep(2 * second)  # a training kernel on the default stream
    with _cpu_meter() as closing:
        anyio.run(engine.shutdown)
        sender.close()
    training_over_at_close = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    figures: Figures = {
        "pack_behind_1s_gather": packing,
        "to_host_behind_1s_kernel": checksum,
        "close_during_2s_training_kernel": closing,
        "training_kernel_over_when_close_returned": training_over_at_close,
    }
    figures["pass"] = (
        packing["cpu_per_s"] <= MAX_CPU_PER_WAIT_S
        and checksum["cpu_per_s"] <= MAX_CPU_PER_WAIT_S
        and checksum["wall_s"] >= 0.5
        and not training_over_at_close
    )
    return figures


def _small_plan(model: Any) -> Any:
    from asyncwt._core.plan import TransferPlan

    return TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=1 << 20)


CHECKS: list[tuple[str, Callable[[Any], Figures]]] = [
    ("ipc-ring-own-allocations", check_ipc_ring_own_allocations),
    ("ipc-map-on-own-gpu", check_ipc_map_on_own_gpu),
    ("delta-scatters-on-gpu", check_delta_scatters_on_gpu),
    ("staging-at-init-off-the-loop", check_staging_at_init_off_the_loop),
    ("pinned-gloo-and-shm-ring", check_pinned_gloo_and_shm_ring),
    ("non-sender-rank-joins-lanes", check_non_sender_rank_joins_lanes),
    ("no-spin-waits", check_no_spin_waits),
]
"""Findings 8-14 of issue 33, in order."""


def main() -> int:
    """Run every check in this process, print one JSON line each; 0 if none failed."""
    failed = 0
    for name, fn in CHECKS:
        start = time.perf_counter()
        try:
            figures = fn(None)
        except Exception as exc:  # noqa: BLE001 - reported, the next check runs
            figures = {"pass": False, "error": f"{type(exc).__name__}: {exc}"}
        figures["seconds"] = round(time.perf_counter() - start, 2)
        failed += figures.get("pass") is False
        print(json.dumps({"check": name, **figures}, default=str), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
