"""The registry and the shared helpers of `scripts/gpu-check`'s checks.

A check is a function taking a `Figures` dict, registered with `@check(...)` in a
module of `scripts/_gpu_checks/` (gpu-check imports every module there). It fills
the figures as it goes, raises `CheckFailed` (through `expect`) when what it checks
does not hold, `NotRun` when this machine cannot run it (one GPU where it needs
two), and anything else when it could not check. It runs in a child process of
its own, with `scripts/` and the repository root first on `sys.path`.

Import in a check's body what only the check needs (torch, asyncwt, ...): this
module and the check modules import only the standard library at the top, so
that `gpu-check --list` and `--preflight` need no torch, and `--preflight` can
name which check an import that fails belongs to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

Figures = dict[str, Any]

MAX_LAG_S = 0.100
"""An event-loop stall longer than this during a round means something blocked the loop."""

CHECK_TIMEOUT_S = 60.0
"""In a check's child process: the seconds it was given (the parent kills it after);
`check_timeout()` reads it."""

GROUPS = ("correctness", "perf")
"""The order checks run in: every `correctness` check, then every `perf` one (a run
that meets its deadline loses the slow measurements first)."""


def check_timeout() -> float:
    """The seconds this check was given (its child is killed after them)."""
    return CHECK_TIMEOUT_S


class CheckFailed(Exception):
    """What a check checks did not hold (its outcome is `fail`, not `error`)."""


class NotRun(Exception):
    """This machine cannot run the check (its outcome is `not-run (REASON)`)."""


def expect(condition: bool, message: str) -> None:
    """Fail the check with `message` unless `condition` holds."""
    if not condition:
        raise CheckFailed(message)


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    description: str
    timeout_s: float
    run: Callable[[Figures], None]
    """Fills the figures as it goes (they are reported even when it fails)."""
    group: str = "correctness"
    """`correctness` or `perf` (see `GROUPS`)."""
    preflight: Callable[[], None] | None = None
    """Run by `--preflight` (no CUDA, the run's interpreter and wheels): raises when
    the check could not start on the GPU machine for a reason an import does not show."""


CHECKS: dict[str, Check] = {}


def check(
    name: str,
    description: str,
    timeout_s: float,
    *,
    group: str = "correctness",
    preflight: Callable[[], None] | None = None,
) -> Callable[[Callable[[Figures], None]], Callable[[Figures], None]]:
    """Register the decorated function as the check `name` (unique across modules)."""
    if group not in GROUPS:
        raise ValueError(f"group of check {name!r} should be one of {GROUPS}, got {group!r}")

    def register(fn: Callable[[Figures], None]) -> Callable[[Figures], None]:
        if name in CHECKS:
            raise ValueError(f"two checks are named {name!r}: {CHECKS[name].run} and {fn}")
        CHECKS[name] = Check(name, description, timeout_s, fn, group, preflight)
        return fn

    return register


def ordered_checks() -> list[Check]:
    """Every registered check in run order: by group, then as registered."""
    return sorted(CHECKS.values(), key=lambda c: GROUPS.index(c.group))


def tail(text: str, lines: int = 30) -> str:
    """The last `lines` lines of `text`."""
    return "\n".join(text.rstrip().splitlines()[-lines:])


# -- helpers shared by the checks (they run in a check's child process) ---------------------


def run_async(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` on a fresh event loop (uvloop where installed), as a trainer would."""
    import anyio

    try:
        import uvloop  # noqa: F401

        options = {"use_uvloop": True}
    except ImportError:
        options = {}
    return anyio.run(fn, *args, backend="asyncio", backend_options=options)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextlib.contextmanager
def workers(*specs: tuple[Any, ...]) -> Iterator[list[str]]:
    """Start one `asyncwt worker` child per `(factory, backend[, env])` (factories from
    `_gpu_check_models`), all at once; yield their URLs; stop them all on exit."""
    from asyncwt._worker.launch import start_worker, stop_worker

    def start(spec: tuple[Any, ...]) -> Any:
        factory, backend, *env = spec
        model = f"_gpu_check_models:{factory}"
        return start_worker(model, "--backend", backend, env=env[0] if env else None)

    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start, spec) for spec in specs]
        urls, errors = [], []
        for future in futures:  # every worker that started is stopped, whatever failed
            try:
                proc, url = future.result()
            except Exception as exc:  # noqa: BLE001 - raised below, once all are stopped
                errors.append(exc)
                continue
            stack.callback(stop_worker, proc)
            urls.append(url)
        if errors:
            raise errors[0]
        yield urls


def worker_statuses(urls: Sequence[str]) -> list[dict[str, Any]]:
    """Each worker's `GET /weights_status?checksum=1` (blocking: for code outside the event loop)."""
    import urllib.request

    statuses = []
    for url in urls:
        with urllib.request.urlopen(f"{url}/weights_status?checksum=1", timeout=120) as response:
            statuses.append(json.loads(response.read()))
    return statuses


def expect_bit_exact(
    statuses: Sequence[dict[str, Any]], version: str, expected: str, where: str
) -> None:
    """Every worker published `version` and holds the bytes whose checksum is `expected`."""
    for index, status in enumerate(statuses):
        got = (status.get("weight_version"), status.get("checksum"))
        expect(
            got == (version, expected),
            f"{where}: worker {index} holds version {got[0]!r} with checksum "
            f"{str(got[1])[:16]}, but the trainer sent {version!r} with checksum {expected[:16]}",
        )


async def verify(client: Any, model: Any, version: str, where: str) -> None:
    """Every worker behind `client` holds `version` of `model`, bit for bit."""
    import anyio.to_thread

    from asyncwt import model_checksum

    expected = await anyio.to_thread.run_sync(model_checksum, model)
    expect_bit_exact(await client.weights_status(checksum=True), version, expected, where)


async def send_and_verify(engine: Any, client: Any, model: Any, version: str, where: str) -> Any:
    """One round, then `verify`; the round's stats."""
    stats = await engine.send_weights(weight_version=version)
    await verify(client, model, version, where)
    return stats


async def with_lag_probe(fn: Callable[[], Any]) -> tuple[Any, float]:
    """`await fn()` while a task sleeps 1 ms in a loop; its result and the worst
    overshoot of those sleeps (how long the event loop was kept from running it)."""
    import anyio

    worst = 0.0
    done = anyio.Event()

    async def probe() -> None:
        nonlocal worst
        while not done.is_set():
            started = time.perf_counter()
            await anyio.sleep(0.001)
            worst = max(worst, time.perf_counter() - started - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(probe)
        try:
            result = await fn()
        finally:
            done.set()
    return result, worst


def sleep_cycles(seconds: float) -> int:
    """How many `torch.cuda._sleep` cycles last about `seconds` on this GPU (measured:
    the SM clock varies; the second measurement runs at the clock a busy GPU holds)."""
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


class StagingTimer:
    """Times the pack stage's copies into staging buffers on the device, with CUDA
    events around each bucket's copies on the pack stream (`asyncwt._trainer.pipeline._copy_into`
    wrapped while active): the round's device-to-host (or device-to-device) staging rate."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, int, Any, Any]] = []

    @contextlib.contextmanager
    def active(self) -> Iterator[StagingTimer]:
        import torch

        from asyncwt._trainer import pipeline as _pipeline

        original = _pipeline._copy_into

        def timed(staging: Any, copies: Any, lane: Any, ready: Any, *rest: Any) -> Any:
            if lane.stream is None:
                return original(staging, copies, lane, ready, *rest)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with lane.activate():
                lane.wait_on(ready)  # time the copies, not the wait for the source
                start.record(lane.stream)
            event = original(staging, copies, lane, ready, *rest)
            end.record(lane.stream)
            kind = "d2d" if staging.is_cuda else "d2h"
            self.marks.append((kind, sum(s.nbytes for s, _ in copies), start, end))
            return event

        _pipeline._copy_into = timed
        try:
            yield self
        finally:
            _pipeline._copy_into = original

    def take(self) -> dict[str, float]:
        """GB/s per kind of copy since the last `take`."""
        totals: dict[str, list[float]] = {}
        for kind, nbytes, start, end in self.marks:
            end.synchronize()
            total = totals.setdefault(kind, [0.0, 0.0])
            total[0] += nbytes
            total[1] += start.elapsed_time(end) / 1e3
        self.marks.clear()
        return {kind: round(b / s / 1e9, 2) for kind, (b, s) in totals.items() if s > 0}
