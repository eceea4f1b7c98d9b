"""A legitimate round's time while 500 slow connections hold on to the worker server.

    python benchmarks/slowloris.py [--connections 500] [--rounds 8] [--mib 128]

Starts an `asyncwt worker` process (tcp backend, a model of about `--mib` MiB), a
slowloris process that keeps `--connections` connections open to it, each sending
one more byte of an unfinished request's headers every second (and reconnecting
whenever the server cuts one off), and pushes rounds from this process. Rounds
alternate between "quiet" (no slowloris) and "under attack", so drift on a noisy
machine hits both alike; the figure printed is the median round time under attack
over the median quiet one, both measured in this run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def model() -> torch.nn.Module:
    """The worker's and the trainer's model: `ASYNCWT_SLOWLORIS_MIB` MiB of fp32."""
    mib = int(os.environ.get("ASYNCWT_SLOWLORIS_MIB", "64"))
    layers = max(1, mib // 4)
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


# -- the slowloris (a process of its own) -------------------------------------------


async def _slow_connection(host: str, port: int, held: list[int]) -> None:
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        held[0] += 1
        try:
            writer.write(b"POST /start_weight_update HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            while True:  # one more header byte a second: never a whole request
                await asyncio.sleep(1.0)
                writer.write(b"X")
                await writer.drain()
        except OSError:
            pass
        finally:
            held[0] -= 1
            writer.close()


async def _slowloris(host: str, port: int, connections: int) -> None:
    held = [0]
    tasks = [asyncio.create_task(_slow_connection(host, port, held)) for _ in range(connections)]
    deadline = time.monotonic() + 30
    while held[0] < connections and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    print(f"holding {held[0]}", flush=True)
    try:
        await asyncio.sleep(3600)  # until terminated
    finally:
        for task in tasks:
            task.cancel()


# -- the legitimate trainer ----------------------------------------------------------


async def _rounds(url: str, rounds: int, attack: list[str]) -> tuple[list[float], list[float], int]:
    import asyncwt

    source_model = model()
    quiet: list[float] = []
    attacked: list[float] = []
    held = 0
    async with asyncwt.HttpClient(url, timeout=120) as client:
        info = asyncwt.TcpTrainerInitInfo(rank=0, bucket_bytes=16 << 20)
        engine = await asyncwt.trainer_init(
            info, client=client, source=asyncwt.ModuleSource(source_model)
        )
        async with engine:
            await engine.send_weights(weight_version="warm-up")
            for index in range(2 * rounds):
                under_attack = index % 2 == 1
                slowloris = None
                if under_attack:
                    slowloris = await asyncio.create_subprocess_exec(
                        *attack, stdout=subprocess.PIPE, start_new_session=True
                    )
                    assert slowloris.stdout is not None
                    line = (await slowloris.stdout.readline()).decode().split()
                    held = int(line[1]) if len(line) == 2 else 0
                    await asyncio.sleep(1.0)  # the worker has taken every connection in
                try:
                    start = time.perf_counter()
                    await engine.send_weights(weight_version=f"round-{index}")
                    took = time.perf_counter() - start
                finally:
                    if slowloris is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(slowloris.pid, signal.SIGKILL)
                        await slowloris.wait()
                (attacked if under_attack else quiet).append(took)
                print(
                    f"round {index}: {'500 slow' if under_attack else 'quiet':>8} {took:.3f}s",
                    flush=True,
                )
    return quiet, attacked, held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=8, help="rounds of each kind")
    parser.add_argument("--mib", type=int, default=128, help="model size")
    parser.add_argument(
        "--slowloris", nargs=3, metavar=("HOST", "PORT", "N"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    raise_fd_limit(4 * args.connections + 256)
    if args.slowloris:
        host, port, count = args.slowloris
        asyncio.run(_slowloris(host, int(port), int(count)))
        return 0

    from asyncwt._worker.launch import worker_process

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    env["ASYNCWT_SLOWLORIS_MIB"] = str(args.mib)
    os.environ["ASYNCWT_SLOWLORIS_MIB"] = str(args.mib)
    with worker_process("slowloris:model", "--backend", "tcp", env=env) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        attack = [sys.executable, __file__, "--slowloris", host, port, str(args.connections)]
        quiet, attacked, held = asyncio.run(_rounds(url, args.rounds, attack))
    ratio = statistics.median(attacked) / statistics.median(quiet)
    print(
        f"slowloris: {held} slow connections held; median round {statistics.median(quiet):.3f}s "
        f"quiet, {statistics.median(attacked):.3f}s under attack: ratio {ratio:.3f} "
        f"(bar 1.2)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
