"""gpu-check's checks of issue 33, findings 8-14: what `tests/test_gpu_paths_b.py`
proves on the CPU with a fake of `torch.cuda`, measured on a real GPU.

Each takes GPU 0 (or 0 and 1) itself and cleans up after itself; each takes well
under 20 s on an H200, its child processes included. `ipc-map-on-own-gpu` needs a
second GPU (`not-run` with one).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _gpu_check_core import (
    MAX_LAG_S,
    Figures,
    NotRun,
    check,
    check_timeout,
    expect,
    run_async,
    sleep_cycles,
    tail,
    with_lag_probe,
)

SCRIPTS = Path(__file__).resolve().parent.parent
ROOT = SCRIPTS.parent

MAX_CPU_PER_WAIT_S = 0.3
"""CPU seconds per second of waiting above which a wait spins."""


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with the repository root and `scripts/` on PYTHONPATH."""
    paths = [str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), **(extra or {})}


def child(code: str, env: dict[str, str] | None = None, stdin: str = "") -> Figures:
    """Run `code` in a fresh Python (its own CUDA context and allocator settings),
    within what is left of the check's time; the JSON object it prints last."""
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=max(check_timeout() - 10, 5),
        env=child_env(env),
        check=False,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"a child exited {done.returncode}:\n{tail(done.stderr)}")
    result: Figures = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def cpu_meter() -> Iterator[Figures]:
    """Wall and process CPU seconds of the enclosed block (every thread's CPU)."""
    figures: Figures = {}
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield figures
    finally:
        figures["wall_s"] = round(time.perf_counter() - wall, 3)
        figures["cpu_s"] = round(time.process_time() - cpu, 3)
        figures["cpu_per_s"] = round(figures["cpu_s"] / max(figures["wall_s"], 1e-9), 3)


class AcceptAll:
    """A control plane that accepts everything."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class NullTransport:
    """A sender transport that sends nothing (the engine's staging is under test)."""

    own_staging = False
    min_view_bytes = None
    in_flight_buckets = 1
    num_workers = 1

    def prepare(self) -> None: ...

    def staging(self, slot: int) -> Any:
        return None

    async def reclaim(self, slot: int) -> None: ...

    async def rendezvous(self, worker_fields: Any, init_workers: Any) -> None: ...

    def check_usable(self) -> None: ...

    async def begin_round(self, round_id: int) -> None: ...

    async def send_bucket(self, bucket: Any, slot: int, segments: Any) -> None: ...

    async def end_round(self) -> None: ...

    async def abort_round(self, reason: str) -> None: ...

    def close(self) -> None: ...


def engine_with(transport: Any) -> Any:
    """A tcp trainer engine class whose transport is `transport`."""
    import dataclasses

    from asyncwt._backends.tcp.backend import TCP
    from asyncwt._trainer.engine import trainer_engine_class

    backend = dataclasses.replace(TCP, sender=lambda info, plan, device: transport, fleet=None)
    return trainer_engine_class(backend, name="Engine", module=__name__)


def slow_source(model: Any, cycles: int) -> Any:
    """`model`'s source whose gathers take a while on the device: a sleep kernel
    first, on the stream current in the iterate thread (the iterate lane's);
    `lane_done` is an event recorded there after the gathers."""
    import torch

    from asyncwt import ModuleSource

    class SlowSource(ModuleSource):
        lane_done: Any = None

        def iter_full(self) -> Iterator[tuple[str, Any]]:
            torch.cuda._sleep(cycles)
            yield from super().iter_full()
            self.lane_done = torch.cuda.Event()
            self.lane_done.record()

    return SlowSource(model)


# -- 8: the ring's handles export asyncwt's own blocks only -----------------------------

RING_EXPORT = """
import json, sys, torch
from asyncwt._backends import cuda_ipc
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
sys.stdin.read()  # keep the ring alive until the worker has read it
"""

RING_IMPORT = """
import json, sys, torch
from asyncwt._backends import cuda_ipc
info = json.loads(sys.stdin.read())
receiver = cuda_ipc.CudaIpcReceiver.__new__(cuda_ipc.CudaIpcReceiver)
receiver.handles, receiver.gpu = info["ipc_buffers"], info["ipc_gpu"]
receiver.device = torch.device("cuda", 0)
receiver.plan = type("P", (), {"bucket_bytes": 48 << 20})()
buffers = receiver.map_ring()
print(json.dumps({"first_bytes": [int(b[0]) for b in buffers],
                  "last_bytes": [int(b[-1]) for b in buffers]}))
"""


@check(
    "ipc-ring-own-allocations",
    "finding 8: under expandable_segments:True each cuda_ipc ring block is a whole "
    "non-expandable segment of its own, and another process maps it",
    timeout_s=30,
)
def ipc_ring_own_allocations(figures: Figures) -> None:
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    exporter = subprocess.Popen(
        [sys.executable, "-c", RING_EXPORT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(env),
    )
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        line = exporter.stdout.readline()
        if not line:
            exporter.kill()
            _, err = exporter.communicate()
            raise RuntimeError(f"the exporter exited {exporter.returncode}:\n{tail(err)}")
        exported = json.loads(line)
        worker = child(RING_IMPORT, env, stdin=json.dumps(exported["exported"]))
        exporter.stdin.close()
        exporter.wait(timeout=5)
    finally:
        if exporter.poll() is None:
            exporter.kill()
            exporter.wait()
    ring = exported["ring_segments"]
    figures["ring_segments"] = ring
    figures["block_bytes"] = exported["block_bytes"]
    figures["trainer_segment"] = exported["trainer_segment"]
    figures["worker_read"] = worker
    figures["ring_handle_sizes"] = [e["size"] for e in exported["exported"]["ipc_buffers"]]
    own = [
        s is not None
        and s["blocks"] == 1
        and not s["expandable"]
        and s["size"] == exported["block_bytes"]
        for s in ring
    ]
    expect(all(own), f"ring blocks are not whole non-expandable segments of their own: {ring}")
    expect(
        worker["first_bytes"] == [7, 8] and worker["last_bytes"] == [7, 8],
        f"the worker read {worker} from the ring, not blocks of 7 and 8",
    )


# -- 9: a worker on another GPU maps the ring on its own GPU -----------------------------


def primary_context_active(ordinal: int) -> bool:
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


MAP_ON_OWN = """
import json, sys, torch
from _gpu_checks.findings_8_14 import primary_context_active
from asyncwt._backends import cuda_ipc
info = json.loads(sys.stdin.read())
torch.cuda.set_device(1)
receiver = cuda_ipc.CudaIpcReceiver.__new__(cuda_ipc.CudaIpcReceiver)
receiver.handles, receiver.gpu = info["ipc_buffers"], info["ipc_gpu"]
receiver.device = torch.device("cuda", 1)
receiver.plan = type("P", (), {"bucket_bytes": 48 << 20})()
buffers = receiver.map_ring()
local = buffers[0].to("cuda:1", copy=True)
torch.cuda.synchronize(1)
print(json.dumps({"mapped_on": [b.device.index for b in buffers], "value": int(local[0]),
                  "context_on_trainer_gpu": primary_context_active(0)}))
"""


@check(
    "ipc-map-on-own-gpu",
    "finding 9: a cuda_ipc worker on GPU 1 maps a ring of GPU 0 on GPU 1 and creates no "
    "CUDA context on GPU 0 (needs two GPUs)",
    timeout_s=25,
)
def ipc_map_on_own_gpu(figures: Figures) -> None:
    import torch

    from asyncwt._backends import cuda_ipc

    gpus = torch.cuda.device_count()
    if gpus < 2:
        raise NotRun(f"{gpus} GPU: the worker needs a second one")
    device = torch.device("cuda", 0)
    ring = cuda_ipc.take_ring(device, 48 << 20, 1)
    try:
        ring[0].fill_(42)
        torch.cuda.synchronize()
        sender = cuda_ipc.CudaIpcSender.__new__(cuda_ipc.CudaIpcSender)
        sender.buffers, sender.device = ring, device
        worker = child(MAP_ON_OWN, stdin=json.dumps(sender.exported()))
    finally:
        cuda_ipc.shelve_ring(ring)
    figures["worker"] = worker
    figures["peer_access"] = torch.cuda.can_device_access_peer(1, 0)
    expect(
        worker["mapped_on"] == [1] and worker["value"] == 42,
        f"the worker on GPU 1 mapped the ring on {worker['mapped_on']} and read {worker['value']}",
    )
    expect(
        not worker["context_on_trainer_gpu"],
        "the worker on GPU 1 created a CUDA context on the trainer's GPU 0",
    )


# -- 10: delta buckets scattered on the GPU ----------------------------------------------


@check(
    "delta-scatters-on-gpu",
    "finding 10: a GPU worker applies delta buckets (1 byte in 400 changed) into its "
    "parameters with no host shadow, bit-exact, and only the changes cross the bus",
    timeout_s=25,
)
def delta_scatters_on_gpu(figures: Figures) -> None:
    import torch

    from asyncwt import ModuleSource
    from asyncwt._core.plan import TransferPlan
    from asyncwt._delta.codec import encode, unit_of
    from asyncwt._transports.base import ReceivedBucket
    from asyncwt._worker.applier import ModelTarget
    from asyncwt._worker.delta import WorkerDelta

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4))).to(
        device="cuda:0", dtype=torch.bfloat16
    )
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=64 << 20)
    params = dict(model.named_parameters())
    target = ModelTarget.resolve(model, plan, None, in_place=False)
    delta = WorkerDelta(plan)
    applied = delta.applied(delta.adapt(target))

    def segments(bucket: Any) -> list[Any]:
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
    with cpu_meter() as timing:
        for bucket in plan.buckets:
            old = segments(bucket)
            new = [part.clone() for part in old]
            for part in new:
                part[::400] += 1
            coded = encode(new, torch.cat(old), unit_of(bucket))
            if not isinstance(coded.body, bytes):
                raise RuntimeError(f"encode gave a {type(coded.body).__name__} body, not bytes")
            body = torch.frombuffer(bytearray(coded.body), dtype=torch.uint8)
            run = delta.prepare(
                applied, ReceivedBucket(bucket, body, lambda: None, coded=coded.header)
            )
            if run is None:
                raise RuntimeError("a coded delta bucket was not prepared for applying")
            run()
            exact &= all(torch.equal(a, b) for a, b in zip(segments(bucket), new))
            body_bytes += len(coded.body)
            payload += bucket.payload_bytes
    figures.update(
        buckets=len(plan.buckets),
        payload_bytes=payload,
        uploaded_body_bytes=body_bytes,
        host_shadow_bytes=delta.shadow_bytes,
        all_on_device=all(applied.direct),
        bit_exact=exact,
        **timing,
    )
    expect(exact, "the parameters after the delta differ from what was sent")
    expect(delta.shadow_bytes == 0, f"the worker holds a {delta.shadow_bytes}-byte host shadow")
    expect(all(applied.direct), f"not every parameter is applied on the device: {applied.direct}")
    expect(
        body_bytes < payload // 10,
        f"the delta bodies are {body_bytes} bytes for a {payload}-byte payload (>= 1/10)",
    )


# -- 11: staging allocated at init, in a thread --------------------------------------------


@check(
    "staging-at-init-off-the-loop",
    "finding 11: a GPU trainer with 2 x 1 GiB buckets allocates both pinned staging buffers "
    f"at init in a thread (loop lag <= {MAX_LAG_S * 1e3:.0f} ms), and its first round none",
    timeout_s=25,
)
def staging_at_init_off_the_loop(figures: Figures) -> None:
    import torch

    from asyncwt import ModuleSource, TcpTrainerInitInfo
    from asyncwt._core.lanes import staging_buffer

    model = torch.nn.Linear(4096, 4096, device="cuda:0")
    engine_cls = engine_with(NullTransport())
    info = TcpTrainerInitInfo(rank=0, device="cuda:0", bucket_bytes=1 << 30, num_buffers=2)

    async def init() -> Any:
        return await engine_cls.trainer_init(info, client=AcceptAll(), source=ModuleSource(model))

    async def lagged(fn: Any) -> tuple[Any, float]:
        return await with_lag_probe(fn)

    engine, init_lag = run_async(lagged, init)
    try:
        pool = engine._pool
        pinned = all(pool.buffer(slot).is_pinned() for slot in range(pool.count))
        allocated = pool.allocated_bytes
        _, round_lag = run_async(lagged, engine.send_weights)
    finally:
        run_async(engine.shutdown)
    start = time.perf_counter()
    staging_buffer(1 << 30, torch.device("cuda", 0))  # what round 1 used to do on the loop
    figures.update(
        init_max_lag_ms=round(init_lag * 1e3, 1),
        round_max_lag_ms=round(round_lag * 1e3, 1),
        allocated_at_init_bytes=allocated,
        pinned=pinned,
        one_slot_allocation_s=round(time.perf_counter() - start, 3),
    )
    expect(allocated == 2 << 30, f"init allocated {allocated} bytes of staging, not 2 GiB")
    expect(pinned, "a staging buffer allocated at init is not pinned")
    expect(init_lag <= MAX_LAG_S, f"the event loop stalled {init_lag * 1e3:.0f} ms during init")
    expect(round_lag <= MAX_LAG_S, f"the event loop stalled {round_lag * 1e3:.0f} ms in round 1")


# -- 12: gloo staging pinned, the shm ring registered ---------------------------------------


@check(
    "pinned-gloo-and-shm-ring",
    "finding 12: a GPU trainer's gloo staging is pinned and its shm ring registered: a "
    "256 MiB bucket's copy into either is bit-exact (queue time and GB/s reported)",
    timeout_s=25,
)
def pinned_gloo_and_shm_ring(figures: Figures) -> None:
    import torch

    from asyncwt import ModuleSource, ShmTrainerInitInfo, TorchDistTrainerInitInfo
    from asyncwt._backends.shm.backend import ShmSender
    from asyncwt._backends.torch_dist import TorchDistSender
    from asyncwt._core.plan import TransferPlan

    nbytes = 256 << 20
    device = torch.device("cuda", 0)
    model = torch.nn.Linear(8, 8)
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=nbytes)
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    gloo = TorchDistSender(
        TorchDistTrainerInitInfo(rank=0, group_backend="gloo", num_buffers=1), plan, device
    )
    shm = ShmSender(ShmTrainerInitInfo(rank=0, bucket_bytes=nbytes, num_buffers=1), plan, device)
    pageable = torch.zeros(nbytes, dtype=torch.uint8)

    def copy_rate(dst: Any) -> tuple[float, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(source, non_blocking=True)
        queued = time.perf_counter() - start
        torch.cuda.synchronize()
        return queued, nbytes / (time.perf_counter() - start) / 1e9

    exact = {}
    try:
        gloo.prepare()
        shm.prepare()
        gloo_buf, ring = gloo.staging(0), shm.buffers[0]
        copy_rate(gloo_buf)  # warm up
        figures["gloo_pinned"] = gloo_buf.is_pinned()
        figures["ring_pinned"] = ring.is_pinned()
        for name, dst in (("gloo", gloo_buf), ("ring", ring), ("pageable", pageable)):
            queued, rate = copy_rate(dst)
            figures[f"{name}_queue_s"] = round(queued, 4)
            figures[f"{name}_gbps"] = round(rate, 1)
            if name != "pageable":
                exact[name] = bool(torch.equal(dst, source.cpu()))
    finally:
        gloo.close()
        shm.close()
    expect(figures["gloo_pinned"], "the gloo sender's staging buffer is not pinned")
    expect(figures["ring_pinned"], "the shm ring is not registered with CUDA (not pinned)")
    bad = [name for name, ok in exact.items() if not ok]
    expect(not bad, f"the copy into {', '.join(bad)} differs from the source")


# -- 13: a non-sender rank's stream waits for its lanes ---------------------------------


@check(
    "non-sender-rank-joins-lanes",
    "finding 13: a non-sender rank (rank 1) returns from send_weights with its stream "
    "ordered after its iterate lane's 0.5 s kernel",
    timeout_s=25,
)
def non_sender_rank_joins_lanes(figures: Figures) -> None:
    import torch

    from asyncwt import TcpTrainerInitInfo, trainer_init

    model = torch.nn.Linear(256, 256, device="cuda:0")
    source = slow_source(model, sleep_cycles(0.5))

    async def round_() -> None:
        engine: Any = await trainer_init(
            TcpTrainerInitInfo(rank=1, device="cuda:0"), client=AcceptAll(), source=source
        )
        try:
            await engine.send_weights()
            returned = time.perf_counter()
            after = torch.cuda.Event()
            after.record()  # what the next training step would queue
            after.synchronize()
            figures["lane_over_first"] = bool(source.lane_done.query())
            figures["caller_waited_s"] = round(time.perf_counter() - returned, 3)
        finally:
            await engine.shutdown()

    run_async(round_)
    expect(
        figures["lane_over_first"],
        "work queued on rank 1's stream after send_weights ran before its iterate lane's "
        "kernel was over",
    )


# -- 14: no spinning host waits, no device-wide sync on close -------------------------------


@check(
    "no-spin-waits",
    "finding 14: packing behind a 1 s gather and to_host behind a 1 s kernel sleep (<= "
    f"{MAX_CPU_PER_WAIT_S} CPU s/s); shutdown and a cuda_ipc close return during a 2 s "
    "training kernel",
    timeout_s=25,
)
def no_spin_waits(figures: Figures) -> None:
    import torch

    from asyncwt import CudaIpcTrainerInitInfo, ModuleSource, TcpTrainerInitInfo
    from asyncwt._backends.cuda_ipc import CudaIpcSender
    from asyncwt._core.cuda_sync import to_host
    from asyncwt._core.lanes import DeviceLane
    from asyncwt._core.plan import TransferPlan
    from asyncwt._trainer.pipeline import PipelineConfig, StagingPool, run_pipeline

    device = torch.device("cuda", 0)
    second = sleep_cycles(1.0)
    model = torch.nn.Linear(1024, 1024, device=device)

    class PageableSink(NullTransport):
        def __init__(self, plan: Any) -> None:
            self.buffer = torch.zeros(plan.bucket_bytes, dtype=torch.uint8)  # pageable

        def staging(self, slot: int) -> Any:
            return self.buffer

    source = slow_source(model, second)
    plan = TransferPlan.build(source.metadata, bucket_bytes=16 << 20)
    lanes = [DeviceLane(device) for _ in range(2)]

    async def pack() -> None:
        await run_pipeline(
            plan,
            source,
            PageableSink(plan),
            pool=StagingPool(2, plan.bucket_bytes, device),
            iterate_lane=lanes[0],
            pack_lane=lanes[1],
            config=PipelineConfig(num_buffers=2),
            fence=lanes[0].record_caller(),
        )

    with cpu_meter() as packing:
        run_async(pack)
    torch.cuda._sleep(second)
    with cpu_meter() as checksum:
        to_host(model.weight)
    init = functools.partial(
        engine_with(NullTransport()).trainer_init,
        TcpTrainerInitInfo(rank=0, device="cuda:0", bucket_bytes=1 << 20),
        client=AcceptAll(),
        source=ModuleSource(model),
    )
    engine: Any = run_async(init)
    small = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=1 << 20)
    sender = CudaIpcSender(CudaIpcTrainerInitInfo(rank=0, bucket_bytes=1 << 20), small, device)
    torch.cuda._sleep(2 * second)  # a training kernel on the default stream
    with cpu_meter() as closing:
        run_async(engine.shutdown)
        sender.close()
    training_over_at_close = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    figures.update(
        pack_behind_1s_gather=packing,
        to_host_behind_1s_kernel=checksum,
        close_during_2s_training_kernel=closing,
        training_kernel_over_when_close_returned=training_over_at_close,
    )
    failures = []
    for what, meter in (("packing behind a 1 s gather", packing), ("to_host", checksum)):
        if meter["cpu_per_s"] > MAX_CPU_PER_WAIT_S:
            failures.append(f"{what} took {meter['cpu_per_s']} CPU s per s: the wait spins")
    if checksum["wall_s"] < 0.5:
        failures.append(f"to_host returned after {checksum['wall_s']}s, before the 1 s kernel")
    if training_over_at_close:
        failures.append("shutdown and close waited for the training kernel (a device-wide sync)")
    expect(not failures, "; ".join(failures))
