"""Where a tcp round's time goes, beside one raw loopback stream: CPU per side per round.

On loopback both ends of a stream share the machine's cores, and the sending
process keeps about one core busy: a round is as fast as the sender's CPU allows.
This runs asyncwt's tcp round (the trainer in this process, on uvloop, a real
`asyncwt worker` process) and the raw stream of `asyncwt bench` in turn, in blocks
of two rounds of which the second counts, and reports for each side the user and
system CPU seconds per round, the trainer's event-loop thread apart from its others:

    python benchmarks/tcp_cpu.py --rounds 30

The system time of the two senders is the kernel's copy and TCP work and should
match; what asyncwt adds shows as user time, and as wall time when it falls on the
sending thread. CPU figures are means (`/proc` counts in ticks of 10 ms); wall
times and their per-round ratio are medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from asyncwt import (
    HttpClient,
    ModuleSource,
    TcpTrainerInitInfo,
    TrainerWeightTransferEngine,
    trainer_init,
)
from asyncwt._bench._cpu import cpu_times
from asyncwt._bench._limits import RawLoopback
from asyncwt._bench._model import MODEL_ENV, LlamaShape, SyntheticLlama, fill_random
from asyncwt._bench._procs import start_asyncwt_worker
from asyncwt._bench._util import run_async

_RAW_CHUNK = 1 << 20


def _process(pid: int) -> tuple[float, float]:
    times = cpu_times(f"/proc/{pid}/stat")
    if times is None:
        raise RuntimeError(f"/proc/{pid}/stat cannot be read: this script needs Linux")
    return times


def _threads() -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds of each live thread of this process, by thread id."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        times = cpu_times(f"/proc/self/task/{tid}/stat")
        if times is not None:  # else the thread ended meanwhile
            out[tid] = times
    return out


def _add(
    total: dict[str, list[float]],
    name: str,
    before: tuple[float, float],
    after: tuple[float, float],
) -> None:
    row = total.setdefault(name, [0.0, 0.0])
    row[0] += after[0] - before[0]
    row[1] += after[1] - before[1]


async def _measure(
    model: torch.nn.Module, url: str, worker_pid: int, rounds: int, log_dir: Path
) -> dict[str, Any]:
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cpu: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {"asyncwt": [], "raw": []}
    async with HttpClient(url) as client:
        engine = await trainer_init(
            TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(model)
        )
        try:
            with RawLoopback(nbytes, log_dir) as raw:
                for index in range(rounds + 1):
                    await _pair(engine, raw, worker_pid, cpu, walls, keep=index > 0)
        finally:
            await engine.shutdown()
    ratios = [r / a for r, a in zip(walls["raw"], walls["asyncwt"], strict=True)]
    return {
        "bytes": nbytes,
        "rounds": rounds,
        "wall_s": {k: statistics.median(v) for k, v in walls.items()},
        "vs_raw": statistics.median(ratios),
        "vs_raw_rounds": ratios,
        "cpu_s_per_round": {
            name: {"user": user / rounds, "system": system / rounds}
            for name, (user, system) in sorted(cpu.items())
        },
    }


async def _pair(
    engine: TrainerWeightTransferEngine,
    raw: RawLoopback,
    worker_pid: int,
    cpu: dict[str, list[float]],
    walls: dict[str, list[float]],
    *,
    keep: bool,
) -> None:
    """A block of two raw rounds, then one of two asyncwt rounds; the second of each
    block is timed and, with `keep`, its seconds and CPU are added to `walls`, `cpu`."""
    me, loop_thread = os.getpid(), str(threading.get_native_id())
    raw.round_s(_RAW_CHUNK)
    sender_before, receiver_before = _process(raw.sender_pid), _process(me)
    raw_s = raw.round_s(_RAW_CHUNK)
    sender_after, receiver_after = _process(raw.sender_pid), _process(me)
    await engine.send_weights()
    threads, worker_before = _threads(), _process(worker_pid)
    start = time.perf_counter()
    await engine.send_weights()
    aw_s = time.perf_counter() - start
    worker_after = _process(worker_pid)
    if not keep:  # the warm-up block
        return
    walls["raw"].append(raw_s)
    walls["asyncwt"].append(aw_s)
    _add(cpu, "raw sender", sender_before, sender_after)
    _add(cpu, "raw receiver", receiver_before, receiver_after)
    _add(cpu, "asyncwt worker", worker_before, worker_after)
    for tid, after in _threads().items():
        name = "event loop" if tid == loop_thread else "other threads"
        _add(cpu, f"asyncwt trainer, {name}", threads.get(tid, (0.0, 0.0)), after)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-mib", type=float, default=1024, help="bf16 model size (default 1024)"
    )
    parser.add_argument(
        "--rounds", type=int, default=30, help="counted rounds of each (default 30)"
    )
    parser.add_argument("--out", type=Path, default=Path("tcp-cpu-out"), help="logs folder")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error(f"--rounds should be >= 3, got {args.rounds}")
    torch.set_num_threads(1)
    shape = LlamaShape.for_mib(args.model_mib)
    model = SyntheticLlama(shape)
    fill_random(model, 0)  # untouched pages read as the zero page: they flatter a sender
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {"OMP_NUM_THREADS": "1", MODEL_ENV: shape.to_json()}
    worker, url = start_asyncwt_worker(backend="tcp", log_dir=log_dir, env=env, role="worker-tcp")
    with worker:
        report = run_async(lambda: _measure(model, url, worker.pid, args.rounds, log_dir))
    print(f"{report['bytes'] / (1 << 20):.1f} MiB, {args.rounds} counted rounds of each")
    print(
        f"a round, median: asyncwt {report['wall_s']['asyncwt']:.3f} s, one raw stream "
        f"{report['wall_s']['raw']:.3f} s; asyncwt against the raw stream, the median of "
        f"per-round ratios: {report['vs_raw']:.3f}x"
    )
    print(f"{'CPU per round, mean (ms)':<34} {'user':>8} {'system':>8}")
    for name, cpu in report["cpu_s_per_round"].items():
        print(f"  {name:<32} {cpu['user'] * 1e3:8.1f} {cpu['system'] * 1e3:8.1f}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
