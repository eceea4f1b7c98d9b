"""Soak: many rounds against one worker process, with resource use checked flat.

Fifty small rounds per backend (ASYNCWT_SOAK_ROUNDS sets more), one in ten broken on purpose (the source breaks
the plan, so the round aborts on the worker), with the trainer's and the worker's
resident memory and file descriptors compared between round 10 and the end.
"""

from __future__ import annotations

import gc
import os

import _models
import anyio
import pytest
from _faults import (
    BACKENDS,
    FaultySource,
    assert_worker_has,
    info_for,
    open_fds,
    proc_rss,
    proc_threads,
    shm_leftovers,
    worker_env,
)

from asyncwt import HttpClient, SourceMismatchError, trainer_init
from asyncwt._worker.launch import start_worker, stop_worker

ROUNDS = int(os.environ.get("ASYNCWT_SOAK_ROUNDS", "50"))
"""Rounds per backend; CI runs 50, a long soak sets ASYNCWT_SOAK_ROUNDS (e.g. 300)."""
WARMUP = 10
RSS_SLACK = 24 << 20
"""Allowed growth of resident memory after the warm-up. Measured on this machine:
flat for tcp; shm and torch_dist workers grow 10-20 MiB and then plateau (allocator
arenas of the server's thread pool, gloo's buffers). A leak of 600 KiB or more per
round (half this model) exceeds it; descriptors and threads are checked exactly."""
SAMPLE_EVERY = 5
"""Rounds between resource samples after the warm-up (for the printed slopes)."""
THREAD_SLACK = 4
"""The worker server's thread pool grows and shrinks with concurrent requests."""


pytestmark = pytest.mark.slow


@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_many_rounds_keep_memory_and_descriptors_flat(backend: str) -> None:
    proc, url = start_worker("_models:mixed", "--backend", backend, env=worker_env())
    try:
        async with HttpClient(url) as client:
            model = _models.mixed()
            source = FaultySource(model)
            engine = await trainer_init(info_for(backend), client=client, source=source)
            async with engine:
                marks: dict[str, int] = {}
                samples: list[tuple[int, dict[str, int]]] = []
                with anyio.fail_after(max(60.0, 1.5 * ROUNDS)):
                    for r in range(1, ROUNDS + 1):
                        _models.randomize(model, seed=r)
                        if r % 10 == 5:  # a broken round: aborted, nothing published
                            source.fault = lambda pairs: pairs[:-1]
                            with pytest.raises(SourceMismatchError):
                                await engine.send_weights(weight_version=f"broken-{r}")
                            source.fault = None
                            continue
                        await engine.send_weights(weight_version=f"v{r}")
                        if r == WARMUP:
                            gc.collect()
                            marks = _measure(proc.pid)
                        if r >= WARMUP and r % SAMPLE_EVERY == 0:
                            samples.append((r, _measure(proc.pid)))
                await assert_worker_has(client, model, f"v{ROUNDS}")
                gc.collect()
                end = _measure(proc.pid)
    finally:
        stop_worker(proc)
    assert not shm_leftovers()
    for key in ("fds", "worker_fds"):
        assert end[key] <= marks[key], (key, marks[key], end[key])
    assert end["worker_threads"] <= marks["worker_threads"] + THREAD_SLACK
    for key in ("rss", "worker_rss"):
        assert end[key] - marks[key] < RSS_SLACK, (key, marks[key], end[key])
    print(f"{backend}: after round {WARMUP} {marks}, after round {ROUNDS} {end}")
    half = [(r, m) for r, m in samples if r >= ROUNDS // 2]
    slopes = {f"{key} per round, from round {WARMUP}": _slope(samples, key) for key in end} | {
        f"{key} per round, second half": _slope(half, key) for key in ("rss", "worker_rss")
    }
    print(
        f"{backend}: {ROUNDS} rounds; least-squares slopes: "
        + ", ".join(
            f"{name} {value:+.1f}" + (" B" if "rss" in name else "")
            for name, value in slopes.items()
        )
    )


def _slope(samples: list[tuple[int, dict[str, int]]], key: str) -> float:
    """Least-squares growth of `key` per round over `samples` (0 with fewer than two)."""
    if len(samples) < 2:
        return 0.0
    xs = [float(r) for r, _ in samples]
    ys = [float(m[key]) for _, m in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


def _measure(worker_pid: int) -> dict[str, int]:
    return {
        "fds": open_fds(),
        "rss": proc_rss(),
        "worker_fds": open_fds(worker_pid),
        "worker_rss": proc_rss(worker_pid),
        "worker_threads": proc_threads(worker_pid),
    }
