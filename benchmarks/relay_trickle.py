"""Chain rounds while one connection trickles a byte every 1.5 s into each worker's
relay listener, against quiet rounds; then how long the workers take to exit
on SIGTERM mid-round.

    python benchmarks/relay_trickle.py [--rounds 3] [--mib 16]

Starts two `asyncwt worker` processes (tcp, `fanout=Chain()`,
`on_worker_failure="drop"`) and pushes rounds from this process, alternating
quiet ones and ones with a trickler (a thread of this process that needs no token)
at both relay listeners. Each round prints its outcome (ok, the workers dropped,
or the error) and its time; the summary gives the median round under attack over
the median quiet one, and how long each worker took to exit on a SIGTERM sent one
second into a last trickled round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TIMEOUTS = {"connect": 2.0, "ready": 5.0, "recv": 5.0, "rpc": 10.0}
"""`asyncwt.Timeouts` of the run (asyncwt is imported only in the trainer's function)."""


def model() -> torch.nn.Module:
    """The workers' and the trainer's model: `ASYNCWT_TRICKLE_MIB` MiB of fp32."""
    layers = max(1, int(os.environ.get("ASYNCWT_TRICKLE_MIB", "16")) // 4)
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)))


def trickle(address: tuple[str, int], stop: threading.Event) -> None:
    """One connection at a time to `address`, a byte every 1.5 s (reconnecting when cut)."""
    while not stop.is_set():
        with contextlib.suppress(OSError), socket.create_connection(address, 5) as sock:
            while True:
                sock.sendall(b"A")
                if stop.wait(1.5):
                    return
        stop.wait(0.1)


async def _rounds(
    procs: list[tuple[subprocess.Popen[bytes], str]], rounds: int
) -> tuple[list[float], list[float], list[float]]:
    import asyncwt
    from asyncwt._backends.tcp.chain import ChainSender

    source_model = model()
    quiet: list[float] = []
    attacked: list[float] = []
    stop = threading.Event()
    async with asyncwt.HttpClient([url for _, url in procs], timeout=120) as client:
        info = asyncwt.TcpTrainerInitInfo(
            rank=0,
            fanout=asyncwt.Chain(),
            on_worker_failure="drop",
            timeouts=asyncwt.Timeouts(**TIMEOUTS),
        )
        engine = await asyncwt.trainer_init(
            info, client=client, source=asyncwt.ModuleSource(source_model)
        )
        async with engine:
            await engine.send_weights(weight_version="warm-up")
            sender = engine.transport
            assert isinstance(sender, ChainSender)
            listeners = [(x.host, x.port) for x in sender.listings.values()]
            for index in range(2 * rounds):
                under_attack = index % 2 == 1
                threads = []
                if under_attack:
                    stop.clear()
                    threads = [
                        threading.Thread(target=trickle, args=(a, stop), daemon=True)
                        for a in listeners
                    ]
                    for thread in threads:
                        thread.start()
                    await asyncio.sleep(0.5)
                start = time.perf_counter()
                try:
                    stats = await engine.send_weights(weight_version=f"round-{index}")
                    outcome = f"ok, dropped {list(stats.dropped)}" if stats.dropped else "ok"
                except asyncwt.AsyncwtError as exc:
                    outcome = f"{type(exc).__name__}: {str(exc)[:110]}"
                took = time.perf_counter() - start
                stop.set()
                for thread in threads:
                    thread.join()
                (attacked if under_attack else quiet).append(took)
                kind = "trickled" if under_attack else "quiet"
                print(f"round {index}: {kind:>8} {took:6.2f}s  {outcome}", flush=True)
        # A fresh init (the rounds above may have closed links), then SIGTERM both
        # workers one second into a trickled round.
        engine = await asyncwt.trainer_init(
            info, client=client, source=asyncwt.ModuleSource(source_model)
        )
        async with engine:
            sender = engine.transport
            assert isinstance(sender, ChainSender)
            stop.clear()
            for x in sender.listings.values():
                threading.Thread(target=trickle, args=((x.host, x.port), stop), daemon=True).start()
            await asyncio.sleep(0.5)
            last = asyncio.ensure_future(engine.send_weights(weight_version="last"))
            await asyncio.sleep(1.0)
            exits = await asyncio.gather(
                *(asyncio.to_thread(_sigterm_exit_s, proc) for proc, _ in procs)
            )
            try:
                print(f"last round: {(await last).workers} worker(s)", flush=True)
            except asyncwt.AsyncwtError as exc:
                print(f"last round: {type(exc).__name__}: {str(exc)[:110]}", flush=True)
            stop.set()
    return quiet, attacked, list(exits)


def _sigterm_exit_s(proc: subprocess.Popen[bytes], limit: float = 120.0) -> float:
    """SIGTERM `proc`; the seconds until it exited (SIGKILL past `limit`)."""
    started = time.monotonic()
    proc.terminate()
    try:
        proc.wait(limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.monotonic() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    parser.add_argument("--mib", type=int, default=16, help="model size")
    args = parser.parse_args()

    from asyncwt._worker.launch import start_worker, stop_worker

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    env["ASYNCWT_TRICKLE_MIB"] = os.environ["ASYNCWT_TRICKLE_MIB"] = str(args.mib)
    procs = []
    try:
        for _ in range(2):
            procs.append(start_worker("relay_trickle:model", "--backend", "tcp", env=env))
        quiet, attacked, exits = asyncio.run(_rounds(procs, args.rounds))
    finally:
        for proc, _ in procs:
            stop_worker(proc)
    ratio = statistics.median(attacked) / statistics.median(quiet)
    print(
        f"relay trickle: median round {statistics.median(quiet):.2f}s quiet, "
        f"{statistics.median(attacked):.2f}s trickled: ratio {ratio:.2f}; SIGTERM exit "
        + ", ".join(f"{s:.2f}s" for s in exits)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
