"""GPU checks of issue 33's findings 1-7 (round two of the GPU readiness review).

Each check is `check_<name>(ctx) -> dict`: it measures on the GPU what
`tests/test_gpu_paths_2.py` can only prove with recording fakes, and returns its
figures with `"pass"` (True or False) and, when it fails, `"why"`. `ctx` is the
runner's context: a mapping that may name the `"device"` to use (default: the
current CUDA device); nothing else is read from it. Each takes well under 20 s
on an H200 and needs one GPU. `CHECKS` lists them as `(name, function)` for the
runner (`scripts/gpu-check`) to register.

Run them on their own (from the repository root, with `scripts/` importable):

    PYTHONPATH=.:scripts python3 -c "import gpu_checks_cuda_a as g; \\
        [print(n, f({})) for n, f in g.CHECKS]"
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

Figures = dict[str, Any]

__all__ = ["CHECKS"]


def _device(ctx: object) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available here")
    named = ctx.get("device") if isinstance(ctx, Mapping) else None
    device = torch.device(named or "cuda")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def _sleep_cycles(device: torch.device, seconds: float) -> int:
    """`torch.cuda._sleep` cycles that last about `seconds` on this GPU."""
    probe = 50_000_000
    rate = 0.0
    for _ in range(2):  # the second runs at the clock a busy GPU holds
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
        rate = probe / (start.elapsed_time(end) / 1e3)
    return int(rate * seconds)


def _verdict(figures: Figures, failures: list[str]) -> Figures:
    figures["pass"] = not failures
    if failures:
        figures["why"] = "; ".join(failures)
    return figures


def _store(prefix: str) -> Any:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    return dist.PrefixStore(prefix, store)


# -- 1 and 2: the NCCL group ------------------------------------------------------------------


def check_nccl_group_probe(ctx: object) -> Figures:
    """Findings 1 and 2: a world-1 NCCL group forms through its probe broadcast with
    no `TORCH_NCCL_*` variable set, torch's timeout `WATCHDOG_MARGIN_S` past ours;
    a world-2 group whose peer never comes fails within its timeout (before: a
    blocking init held the caller for ever)."""
    from asyncwt._core.errors import TransferTimeoutError
    from asyncwt._transports import torch_dist

    device = _device(ctx)
    figures: Figures = {}
    failures: list[str] = []
    names = ("TORCH_NCCL_BLOCKING_WAIT", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
    before = {name: os.environ.get(name) for name in names}
    timeout = 9.0
    started = time.perf_counter()
    group = torch_dist._new_group("nccl", _store("probe/"), 0, 1, timeout, device)
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

    # A peer that never joins: rank 0 of two, alone.
    limit = 2.0
    saved = torch_dist.FORM_GRACE_S
    torch_dist.FORM_GRACE_S = 0.5
    try:
        store = _store("alone/")
        create = lambda: torch_dist._new_group("nccl", store, 0, 2, limit, device)
        started = time.perf_counter()
        try:
            torch_dist._form_within(create, limit)
        except (TransferTimeoutError, RuntimeError) as exc:  # given up, or the probe timed out
            figures["alone_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
        else:
            failures.append("a group whose peer never came formed")
        figures["alone_failed_after_s"] = round(time.perf_counter() - started, 2)
        if figures["alone_failed_after_s"] > limit + 3.0:
            failures.append(f"the lone rank waited {figures['alone_failed_after_s']}s")
    finally:
        torch_dist.FORM_GRACE_S = saved
    return _verdict(figures, failures)


# -- 3: broadcasts launch on the side stream -------------------------------------------------


def check_broadcast_skips_training_queue(ctx: object) -> Figures:
    """Finding 3: with ~1.5 s of kernels queued on the default stream (training),
    a broadcast launched by `_start_all` on the side stream is over long before
    them; launched from a thread's default stream (as before) it waits for them."""
    from asyncwt._transports import torch_dist

    device = _device(ctx)
    figures: Figures = {}
    failures: list[str] = []
    cycles = _sleep_cycles(device, 1.5)
    group = torch_dist._new_group("nccl", _store("side/"), 0, 1, 30.0, device)
    side = torch_dist._side_stream(device)
    tensor = torch.ones(1 << 20, device=device)
    try:

        def timed(stream: torch.cuda.Stream | None) -> float:
            out: list[float] = []

            def launch() -> None:  # an anyio worker thread's view: the default stream
                torch.cuda.set_device(device)
                works = torch_dist._start_all(group, [tensor], stream)
                start = time.perf_counter()
                torch_dist._wait_all(works, stream or torch_dist._side_stream(device), 30.0)
                out.append(time.perf_counter() - start)

            torch.cuda.synchronize(device)
            torch.cuda._sleep(cycles)  # training kernels on the default stream
            thread = threading.Thread(target=launch)
            thread.start()
            thread.join(20)
            busy = not torch.cuda.default_stream(device).query()
            torch.cuda.synchronize(device)
            if not out:
                raise RuntimeError("the broadcast did not end within 20 s")
            figures[f"{'side' if stream else 'default'}_training_still_busy"] = busy
            return out[0]

        figures["side_s"] = round(timed(side), 3)
        figures["default_s"] = round(timed(None), 3)
    finally:
        torch_dist._release_group(group)
    if figures["side_s"] > 0.5:
        failures.append(f"the side-stream broadcast took {figures['side_s']}s behind training")
    if figures["default_s"] < 1.0:
        figures["note"] = "a default-stream launch did not wait for training (not reproduced)"
    return _verdict(figures, failures)


# -- 4: reassembly on the device ---------------------------------------------------------------


def check_reassembly_stays_on_device(ctx: object) -> Figures:
    """Finding 4: a 64 MiB parameter chunked over 4 MiB device receive buffers,
    with a whole-tensor transform, is reassembled on the GPU (before: in pageable
    host memory, device -> host -> device every round); bit-exact."""
    from asyncwt._core.plan import TransferPlan
    from asyncwt._core.source import ModuleSource
    from asyncwt._worker.applier import DeferredApplier, ModelTarget

    device = _device(ctx)
    figures: Figures = {}
    failures: list[str] = []
    model = torch.nn.Embedding(32768, 1024, device=device, dtype=torch.bfloat16)
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=4 << 20)
    source = torch.randn(32768, 1024, device=device).to(torch.bfloat16)
    raw = source.view(-1).view(torch.uint8)
    devices: list[str] = []

    def whole(name: str, tensor: torch.Tensor) -> torch.Tensor:
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
            applier.drain(timeout=30)
            torch.cuda.synchronize(device)
            figures[f"round{round_id}_s"] = round(time.perf_counter() - start, 3)
        figures["buckets"] = len(plan.buckets)
        figures["reassembled_on"] = sorted(set(devices))
        figures["spare_devices"] = sorted({str(d) for _, d in applier._spare})
    finally:
        applier.shutdown()
    if set(devices) != {"cuda"}:
        failures.append(f"the parameter was reassembled on {sorted(set(devices))}")
    if not torch.equal(model.weight.data, source):
        failures.append("the reassembled parameter differs from what was sent")
    return _verdict(figures, failures)


# -- 5: vLLM's own copy --------------------------------------------------------------------------


def check_vllm_own_copy(ctx: object) -> Figures:
    """Finding 5: `_own_copy` of a device tensor is pinned host memory (no GPU memory
    outside vLLM's budget) and is complete when it returns; of a host tensor,
    pinned; and the apply stream waits for the default stream (vLLM's) first."""
    from asyncwt._vllm.worker import _own_copy

    device = _device(ctx)
    figures: Figures = {}
    failures: list[str] = []
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
    cycles = _sleep_cycles(device, 1.0)
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
    return _verdict(figures, failures)


# -- 6: a staged commit is over when it returns ---------------------------------------------------


def check_staged_commit_settles(ctx: object) -> Figures:
    """Finding 6: with ~0.5 s of work queued on the caller's stream, a staged commit
    returns only once its copies are done: a reader on another stream, right
    after, sees every new weight (before: the copies queued behind that work and
    the round was published at once)."""
    from asyncwt._core.plan import TransferPlan
    from asyncwt._core.source import ModuleSource
    from asyncwt._worker.applier import ModelTarget

    device = _device(ctx)
    figures: Figures = {}
    failures: list[str] = []
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(8))).to(device)
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=16 << 20)
    target = ModelTarget.resolve(model, plan, None, staged=True)
    assert target.commit is not None
    with torch.no_grad():
        for shadow in target.params.values():
            shadow.fill_(3.0)
    cycles = _sleep_cycles(device, 0.5)
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
    if stale:
        failures.append(f"a reader right after the commit saw {stale} old elements")
    return _verdict(figures, failures)


# -- 7: a Shard(1) block lands in strided copies -------------------------------------------------


def check_shard1_block_copies(ctx: object) -> Figures:
    """Finding 7: an owner-sent vocab x hidden weight, `Shard(1)` over two ranks
    (151,936 rows per rank), lands on the GPU in a few strided copies per share
    bucket (before: one copy per row, 303,872 copies); bit-exact; seconds."""
    from asyncwt._core.meta import ParamMeta, Shard
    from asyncwt._core.owners import OwnersLayout
    from asyncwt._core.plan import TransferPlan
    from asyncwt._transports.base import ReceivedBucket
    from asyncwt._worker.applier import DeferredApplier, ModelTarget
    from asyncwt._worker.owners import OwnersReceiver

    device = _device(ctx)
    figures: Figures = {}
    failures: list[str] = []
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
            received.append(receiver._translate(rank, ReceivedBucket(bucket, buffer, _noop)))
    torch.cuda.synchronize(device)  # filled: the apply stream may read them
    figures["row_slices"] = sum(len(r.bucket.slices) for r in received)
    copies = [0]
    real = torch.Tensor.copy_

    def counting(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        copies[0] += 1
        return real(self, src, non_blocking)

    applier = DeferredApplier(1)
    torch.Tensor.copy_ = counting  # type: ignore[method-assign]
    try:
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for r in received:
            applier.submit(target, 1, r.bucket, r.buffer, r.release)
        applier.drain(timeout=60)
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        torch.Tensor.copy_ = real  # type: ignore[method-assign]
        applier.shutdown()
    figures["copies"] = copies[0]
    figures["apply_s"] = round(seconds, 3)
    figures["gbps"] = round(full.nbytes / seconds / 1e9, 2)
    if copies[0] > 3 * len(received):
        failures.append(f"{copies[0]} copies for {len(received)} share buckets")
    if not torch.equal(model.w.data, full):
        failures.append("the landed weight differs from what was sent")
    return _verdict(figures, failures)


def _noop() -> None:
    return None


CHECKS: list[tuple[str, Callable[[object], Figures]]] = [
    ("nccl-group-probe", check_nccl_group_probe),
    ("broadcast-skips-training-queue", check_broadcast_skips_training_queue),
    ("reassembly-stays-on-device", check_reassembly_stays_on_device),
    ("vllm-own-copy", check_vllm_own_copy),
    ("staged-commit-settles", check_staged_commit_settles),
    ("shard1-block-copies", check_shard1_block_copies),
]
"""The checks, in the order to run them, by the name the runner reports."""
