"""gpu-check's checks of issue 33, findings 1-7 (round two of the GPU readiness review).

Each measures on the GPU what `tests/test_gpu_paths_2.py` can only prove with
recording fakes; each needs one GPU and takes well under 20 s on an H200.

- 1, 2 `nccl-group-probe`: the NCCL group forms through its probe broadcast, sets
  no `TORCH_NCCL_*` variable, carries our timeout plus `WATCHDOG_MARGIN_S`; a lone
  rank whose peer never comes gives up within its timeout (in a child: its
  formation thread may stay stuck in NCCL's init).
- 3 `broadcast-skips-training-queue`, 4 `reassembly-stays-on-device`, 5
  `vllm-own-copy`, 6 `staged-commit-settles`, 7 `shard1-block-copies`.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

from _gpu_check_core import Figures, check, check_timeout, expect, sleep_cycles, tail


def cuda0() -> Any:
    """GPU 0, made current."""
    import torch

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


def prefix_store(prefix: str) -> Any:
    """A one-process TCP store of its own, under `prefix`."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    return dist.PrefixStore(prefix, store)


# -- 1 and 2: the NCCL group ------------------------------------------------------------------

LONE_RANK_LIMIT_S = 2.0
"""The lone rank's timeout: it must give up within this, `FORM_GRACE_S` and a margin."""

LONE_RANK = """
import datetime, json, os, sys, time
import torch
import torch.distributed as dist
from asyncwt._core.errors import TransferTimeoutError
from asyncwt._backends import torch_dist

device = torch.device("cuda", 0)
torch.cuda.set_device(device)
limit = float(sys.argv[1])
torch_dist.FORM_GRACE_S = 0.5
tcp = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
store = dist.PrefixStore("alone/", tcp)
started = time.perf_counter()
try:  # rank 0 of two; rank 1 never comes
    torch_dist._form_within(
        lambda: torch_dist._new_group("nccl", store, 0, 2, limit, device), limit
    )
    result = {"formed": True}
except (TransferTimeoutError, RuntimeError) as exc:  # given up, or the probe timed out
    result = {"formed": False, "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
result["failed_after_s"] = round(time.perf_counter() - started, 2)
print(json.dumps(result), flush=True)
os._exit(0)  # the formation's thread may be stuck in NCCL's init: leave it behind
"""


@check(
    "nccl-group-probe",
    "findings 1-2: a world-1 NCCL group forms through its probe broadcast with no "
    "TORCH_NCCL_* set and torch's timeout WATCHDOG_MARGIN_S past ours; a lone rank of "
    "two gives up within its timeout",
    timeout_s=30,
)
def nccl_group_probe(figures: Figures) -> None:
    import torch

    from asyncwt._backends import torch_dist

    device = cuda0()
    failures: list[str] = []
    names = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    before = {name: os.environ.get(name) for name in names}
    timeout = 9.0
    started = time.perf_counter()
    group = torch_dist._new_group("nccl", prefix_store("probe/"), 0, 1, timeout, device)
    try:
        figures["formed_s"] = round(time.perf_counter() - started, 3)
        after = {name: os.environ.get(name) for name in names}
        figures["env_after"] = after
        if after != before:
            failures.append(f"the environment changed: {before} -> {after}")
        carried = group.options._timeout.total_seconds()
        figures["group_timeout_s"] = carried
        if carried != timeout + torch_dist.WATCHDOG_MARGIN_S:
            failures.append(f"torch's group timeout is {carried}s, not {timeout} + margin")
        blocking = getattr(getattr(group.options, "config", None), "blocking", None)
        figures["config_blocking"] = blocking
        side = torch_dist._side_stream(device)
        sent = torch.arange(1 << 20, dtype=torch.float32, device=device)
        buffer = sent.clone()
        torch_dist._wait_all(torch_dist._start_all(group, [buffer], side), side, timeout)
        if not torch.equal(buffer, sent):
            failures.append("a broadcast on the formed group changed the tensor")
    finally:
        torch_dist._release_group(group)

    waited = max(check_timeout() - (time.perf_counter() - started) - 5, 5)
    cmd = [sys.executable, "-c", LONE_RANK, str(LONE_RANK_LIMIT_S)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=waited, check=False)
    except subprocess.TimeoutExpired:
        failures.append(f"a lone rank of two was still forming its group after {waited:.0f}s")
    else:
        if done.returncode != 0 or not done.stdout.strip():
            raise RuntimeError(
                f"the lone rank's probe exited {done.returncode}:\n{tail(done.stderr)}"
            )
        alone = json.loads(done.stdout.strip().splitlines()[-1])
        figures["alone_failed_after_s"] = alone["failed_after_s"]
        figures["alone_error"] = alone.get("error")
        if alone["formed"]:
            failures.append("a group whose peer never came formed")
        elif alone["failed_after_s"] > LONE_RANK_LIMIT_S + 3.0:
            failures.append(
                f"the lone rank waited {alone['failed_after_s']}s with a timeout of "
                f"{LONE_RANK_LIMIT_S}s"
            )
    expect(not failures, "; ".join(failures))


# -- 3: broadcasts launch on the side stream -------------------------------------------------


@check(
    "broadcast-skips-training-queue",
    "finding 3: with ~1.5 s of training kernels queued on the default stream, a broadcast "
    "launched by _start_all on the side stream is over long before them",
    timeout_s=25,
)
def broadcast_skips_training_queue(figures: Figures) -> None:
    import torch

    from asyncwt._backends import torch_dist

    device = cuda0()
    cycles = sleep_cycles(1.5)
    group = torch_dist._new_group("nccl", prefix_store("side/"), 0, 1, 30.0, device)
    side = torch_dist._side_stream(device)
    tensor = torch.ones(1 << 20, device=device)

    def timed(stream: Any) -> float:
        out: list[float] = []

        def launch() -> None:  # an anyio worker thread's view: the default stream
            torch.cuda.set_device(device)
            works = torch_dist._start_all(group, [tensor], stream)
            start = time.perf_counter()
            torch_dist._wait_all(works, stream or torch_dist._side_stream(device), 30.0)
            out.append(time.perf_counter() - start)

        torch.cuda.synchronize(device)
        torch.cuda._sleep(cycles)  # training kernels on the default stream
        thread = threading.Thread(target=launch, daemon=True)
        thread.start()
        thread.join(6)
        busy = not torch.cuda.default_stream(device).query()
        torch.cuda.synchronize(device)
        if not out:
            raise RuntimeError("the broadcast did not end within 6 s")
        figures[f"{'side' if stream else 'default'}_training_still_busy"] = busy
        return out[0]

    try:
        figures["side_s"] = round(timed(side), 3)
        figures["default_s"] = round(timed(None), 3)
    finally:
        torch_dist._release_group(group)
    if figures["default_s"] < 1.0:
        figures["note"] = "a default-stream launch did not wait for training (not reproduced)"
    expect(
        figures["side_s"] <= 0.5,
        f"the side-stream broadcast took {figures['side_s']}s behind 1.5 s of training",
    )


# -- 4: reassembly on the device ---------------------------------------------------------------


@check(
    "reassembly-stays-on-device",
    "finding 4: a 64 MiB parameter chunked over 4 MiB device receive buffers, with a "
    "whole-tensor transform, is reassembled on the GPU, bit-exact",
    timeout_s=25,
)
def reassembly_stays_on_device(figures: Figures) -> None:
    import torch

    from asyncwt._core.plan import TransferPlan
    from asyncwt._core.source import ModuleSource
    from asyncwt._worker.applier import DeferredApplier, ModelTarget

    device = cuda0()
    model = torch.nn.Embedding(32768, 1024, device=device, dtype=torch.bfloat16)
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=4 << 20)
    source = torch.randn(32768, 1024, device=device).to(torch.bfloat16)
    raw = source.view(-1).view(torch.uint8)
    devices: list[str] = []

    def whole(name: str, tensor: Any) -> Any:
        devices.append(tensor.device.type)
        return tensor

    target = ModelTarget.resolve(model, plan, whole, in_place=False)
    applier = DeferredApplier(2)
    try:
        for round_id in (1, 2):
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for bucket in plan.buckets:
                buffer = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
                for s in bucket.slices:
                    buffer[s.offset : s.offset + s.nbytes] = raw[s.start : s.end]
                torch.cuda.synchronize(device)  # filled: the apply streams may read it
                applier.submit(target, round_id, bucket, buffer, lambda: None)
            applier.drain(timeout=10)
            torch.cuda.synchronize(device)
            figures[f"round{round_id}_s"] = round(time.perf_counter() - start, 3)
        figures["buckets"] = len(plan.buckets)
        figures["reassembled_on"] = sorted(set(devices))
        figures["spare_devices"] = sorted({str(d) for _, d in applier._spare})
    finally:
        applier.shutdown()
    failures = []
    if set(devices) != {"cuda"}:
        failures.append(f"the parameter was reassembled on {sorted(set(devices))}")
    if not torch.equal(model.weight.data, source):
        failures.append("the reassembled parameter differs from what was sent")
    expect(not failures, "; ".join(failures))


# -- 5: vLLM's own copy --------------------------------------------------------------------------


@check(
    "vllm-own-copy",
    "finding 5: vLLM's _own_copy of a device tensor is pinned host memory, complete on "
    "return; of a host tensor, pinned; the apply stream waits for vLLM's default stream",
    timeout_s=20,
)
def vllm_own_copy(figures: Figures) -> None:
    import torch

    from asyncwt._vllm.worker import _own_copy

    device = cuda0()
    failures = []
    received = torch.randn(4096, 4096, device=device)  # 64 MiB
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    apply_stream = torch.cuda.Stream(device)
    with torch.cuda.stream(apply_stream):
        copy = _own_copy("w", received)
    figures["device_copy_on"] = str(copy.device)
    figures["device_copy_pinned"] = copy.is_pinned()
    figures["gpu_bytes_held_by_copy"] = torch.cuda.memory_allocated(device) - held
    if copy.device.type != "cpu" or not copy.is_pinned():
        failures.append(f"a device tensor's copy is on {copy.device}, pinned={copy.is_pinned()}")
    if not torch.equal(copy, received.cpu()):
        failures.append("the copy of a device tensor is not complete when _own_copy returns")
    host = torch.randn(1024, 1024)
    with torch.cuda.stream(apply_stream):
        host_copy = _own_copy("w", host)
    figures["host_copy_pinned"] = host_copy.is_pinned()
    if not host_copy.is_pinned() or not torch.equal(host_copy, host):
        failures.append("a host tensor's copy is not a pinned copy")
    # vLLM's stream busy for ~1 s: what the apply stream queues after _own_copy waits.
    cycles = sleep_cycles(1.0)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(cycles)
    with torch.cuda.stream(apply_stream):
        _own_copy("w", host)
        after = torch.cuda.Event()
        after.record(apply_stream)
    figures["apply_waited_for_vllm"] = not after.query()
    torch.cuda.synchronize(device)
    if not figures["apply_waited_for_vllm"]:
        failures.append("the apply stream did not wait for the default stream")
    expect(not failures, "; ".join(failures))


# -- 6: a staged commit is over when it returns ---------------------------------------------------


@check(
    "staged-commit-settles",
    "finding 6: with ~0.5 s of work queued on the caller's stream, a staged commit returns "
    "once its copies are done: a reader on another stream right after sees every new weight",
    timeout_s=20,
)
def staged_commit_settles(figures: Figures) -> None:
    import torch

    from asyncwt._core.plan import TransferPlan
    from asyncwt._core.source import ModuleSource
    from asyncwt._worker.applier import ModelTarget

    device = cuda0()
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(8))).to(device)
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=16 << 20)
    target = ModelTarget.resolve(model, plan, None, staged=True)
    if target.commit is None:
        raise RuntimeError("a staged ModelTarget has no commit")
    with torch.no_grad():
        for shadow in target.params.values():
            shadow.fill_(3.0)
    cycles = sleep_cycles(0.5)
    torch.cuda.synchronize(device)
    torch.cuda._sleep(cycles)  # work the caller queued before finishing the round
    start = time.perf_counter()
    target.commit()
    figures["commit_s"] = round(time.perf_counter() - start, 3)
    reader = torch.cuda.Stream(device)
    with torch.cuda.stream(reader):
        stale = sum(int((p != 3.0).sum()) for p in model.parameters())
    figures["stale_elements_seen_by_a_reader"] = stale
    torch.cuda.synchronize(device)
    expect(not stale, f"a reader right after the commit saw {stale} old elements")


# -- 7: a Shard(1) block lands in strided copies -------------------------------------------------


@check(
    "shard1-block-copies",
    "finding 7: an owner-sent vocab x hidden weight, Shard(1) over two ranks, lands on the "
    "GPU in a few strided copies per share bucket (not one per row), bit-exact",
    timeout_s=30,
)
def shard1_block_copies(figures: Figures) -> None:
    import torch

    from asyncwt._core.meta import ParamMeta, Shard
    from asyncwt._core.owners import OwnersLayout
    from asyncwt._core.plan import TransferPlan
    from asyncwt._transports.base import ReceivedBucket
    from asyncwt._worker.applier import DeferredApplier, ModelTarget
    from asyncwt._worker.owners import OwnersReceiver

    device = cuda0()
    rows, cols = 151936, 512
    full = torch.randn(rows, cols, device=device).to(torch.bfloat16)
    meta = ParamMeta("w", torch.bfloat16, (rows, cols), owners=(0, 1), placements=(Shard(1),))
    plan = TransferPlan.build([meta], bucket_bytes=32 << 20)
    layout = OwnersLayout.build(plan, 2)
    receiver = OwnersReceiver(layout, [])
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(rows, cols, dtype=torch.bfloat16, device=device))
    target = ModelTarget.resolve(model, plan, None, in_place=False)
    received = []
    for rank in (0, 1):
        (piece,) = layout.pieces[rank]
        box = tuple(slice(s, s + n) for s, n in zip(piece.box.start, piece.box.size))
        raw = full[box].contiguous().view(-1).view(torch.uint8)
        for bucket in layout.share_plans[rank].buckets:
            buffer = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
            for s in bucket.slices:
                buffer[s.offset : s.offset + s.nbytes] = raw[s.start : s.end]
            bucket_in = ReceivedBucket(bucket, buffer, lambda: None)
            received.append(receiver._translate(rank, bucket_in))
    torch.cuda.synchronize(device)  # filled: the apply stream may read them
    figures["row_slices"] = sum(len(r.bucket.slices) for r in received)
    copies = [0]
    real = torch.Tensor.copy_

    def counting(self: Any, src: Any, non_blocking: bool = False) -> Any:
        copies[0] += 1
        return real(self, src, non_blocking)

    applier = DeferredApplier(1)
    torch.Tensor.copy_ = counting
    try:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for r in received:
            applier.submit(target, 1, r.bucket, r.buffer, r.release)
        applier.drain(timeout=15)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        torch.Tensor.copy_ = real
        applier.shutdown()
    figures["share_buckets"] = len(received)
    figures["copies"] = copies[0]
    figures["apply_s"] = round(seconds, 3)
    figures["gbps"] = round(full.nbytes / seconds / 1e9, 2)
    failures = []
    if copies[0] > 3 * len(received):
        failures.append(f"{copies[0]} copies for {len(received)} share buckets")
    if not torch.equal(model.w.data, full):
        failures.append("the landed weight differs from what was sent")
    expect(not failures, "; ".join(failures))
