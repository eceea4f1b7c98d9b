#!/usr/bin/env python
"""Delta rounds on a real training trajectory: bytes and time per round, both ways.

    python benchmarks/delta_trajectory.py                 # 57 M params, 20 steps at 1e-6 and 1e-5
    python benchmarks/delta_trajectory.py --quick         # 4 steps of a small model (a smoke run)
    python benchmarks/delta_trajectory.py --backend shm   # the same over shared memory
    python benchmarks/delta_trajectory.py --rate 1G       # tcp, emulated hosts, 1 Gbit/s links

A Llama-shaped decoder (the benchmark's `LlamaShape`: embedding, per layer
q/k/v/o and SwiGLU gate/up/down projections, RMS norms, LM head; no rotary
embedding) is trained from a fixed init with AdamW in fp32 on a fixed synthetic
token stream. After every step its weights are cast to bf16 and pushed, over
tcp on loopback (`--backend shm`: shared memory; `--rate`: tcp on an emulated
cluster), to four `asyncwt worker` processes, each by its own trainer (see
`KINDS`: deltas always, deltas where they pay, full rounds, and full rounds again
to show the noise; the last three take turns going first, the always-delta round
goes last). Every round of every kind is
checked bit-exact against the bf16 weights (the workers' `/weights_status`
checksum).

Reported per round: payload bytes, bytes on the wire, wall seconds of the delta
round and of the full round. Memory: the trainer's host copy (`host_bytes`) and
each worker's peak RSS (the delta worker keeps its base in its live weights, so
it should pay nothing more). Output: a table on stdout and OUT/trajectory.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.nn.functional as F

from asyncwt import (
    Delta,
    HttpClient,
    Listen,
    ModuleSource,
    ShmTrainerInitInfo,
    TcpTrainerInitInfo,
    model_checksum,
    trainer_init,
)
from asyncwt._bench._model import MODEL_ENV, LlamaShape, SyntheticLlama
from asyncwt._worker.launch import start_worker, stop_worker

HEAD_DIM = 64
WORKER_MODEL = "asyncwt._bench._model:worker_model"


def shape_for(quick: bool) -> LlamaShape:
    if quick:
        return LlamaShape(hidden=256, intermediate=704, kv_dim=64, vocab=4000, layers=2)
    # 57.4 M parameters: 115 MB of bf16 on the wire.
    return LlamaShape(hidden=512, intermediate=1408, kv_dim=128, vocab=32000, layers=8)


def init_master(shape: LlamaShape, seed: int) -> dict[str, torch.Tensor]:
    """fp32 master weights: N(0, 0.02) matrices, norms at one."""
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for name, dims in shape.param_shapes():
        if len(dims) == 1:
            tensor = torch.ones(dims)
        else:
            tensor = torch.empty(dims).normal_(0.0, 0.02, generator=generator)
        params[name] = tensor.requires_grad_(True)
    return params


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def forward(p: dict[str, torch.Tensor], shape: LlamaShape, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token logits of a Llama-style decoder over `tokens` (batch, seq)."""
    batch, seq = tokens.shape
    heads, kv_heads = shape.hidden // HEAD_DIM, shape.kv_dim // HEAD_DIM
    x = F.embedding(tokens, p["model.embed_tokens.weight"])
    for n in range(shape.layers):
        w = f"model.layers.{n}."
        h = _rms(x, p[w + "input_layernorm.weight"])
        q = (h @ p[w + "self_attn.q_proj.weight"].T).view(batch, seq, heads, HEAD_DIM)
        k = (h @ p[w + "self_attn.k_proj.weight"].T).view(batch, seq, kv_heads, HEAD_DIM)
        v = (h @ p[w + "self_attn.v_proj.weight"].T).view(batch, seq, kv_heads, HEAD_DIM)
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + out.transpose(1, 2).reshape(batch, seq, -1) @ p[w + "self_attn.o_proj.weight"].T
        h = _rms(x, p[w + "post_attention_layernorm.weight"])
        gate = F.silu(h @ p[w + "mlp.gate_proj.weight"].T) * (h @ p[w + "mlp.up_proj.weight"].T)
        x = x + gate @ p[w + "mlp.down_proj.weight"].T
    return _rms(x, p["model.norm.weight"]) @ p["lm_head.weight"].T


def token_stream(vocab: int, batch: int, seq: int, steps: int, seed: int) -> list[torch.Tensor]:
    """A fixed stream with structure to learn: noisy arithmetic progressions."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=generator)
        stride = torch.randint(1, 17, (batch, 1), generator=generator)
        tokens = (start + stride * torch.arange(seq + 1)) % vocab
        noise = torch.rand(batch, seq + 1, generator=generator) < 0.1
        tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=generator)
        batches.append(tokens)
    return batches


def cast_into(mirror: SyntheticLlama, master: dict[str, torch.Tensor]) -> None:
    """The bf16 wire copy of the fp32 master weights (round to nearest even)."""
    with torch.no_grad():
        for name, param in mirror.named_parameters():
            param.copy_(master[name])


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


KINDS = ("always", "auto", "full", "twin")
"""The four trainers, each to its own worker: `Delta(policy="always")` (every round
a delta: the encoding's bytes and cost), `"auto"` (what a user gets: deltas only
where they pay), `delta=False` (the full round, the baseline) and `twin`, a second
`delta=False` trainer: what it measures against `full` is the noise every per-round
ratio carries (both do the same work)."""
FULL_KINDS = ("full", "twin")


def trainer_info(
    kind: str, bucket: int, host: str, backend: str = "tcp"
) -> TcpTrainerInitInfo | ShmTrainerInitInfo:
    delta = None if kind in FULL_KINDS else Delta(policy=kind)
    if backend == "shm":
        return ShmTrainerInitInfo(rank=0, bucket_bytes=bucket, delta=delta)
    return TcpTrainerInitInfo(rank=0, bucket_bytes=bucket, listen=Listen(host=host), delta=delta)


async def run_lr(
    lr: float,
    shape: LlamaShape,
    args: argparse.Namespace,
    urls: list[str],
    *,
    api_key: str | None = None,
    host: str = "127.0.0.1",
) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    master = init_master(shape, args.seed)
    optimizer = torch.optim.AdamW(master.values(), lr=lr, weight_decay=0.0)
    mirror = SyntheticLlama(shape)
    cast_into(mirror, master)
    batches = token_stream(shape.vocab, args.batch, args.seq, args.steps, args.seed + 1)
    bucket = args.bucket_mib << 20
    rows: list[dict[str, Any]] = []
    clients = {kind: HttpClient(url, api_key=api_key) for kind, url in zip(KINDS, urls)}
    engines = {}
    try:
        for kind in KINDS:
            engines[kind] = await trainer_init(
                trainer_info(kind, bucket, host, args.backend),
                client=clients[kind],
                source=ModuleSource(mirror),
            )
        for step in range(args.steps + 1):
            loss = float("nan")
            if step:
                tokens = batches[step - 1]
                logits = forward(master, shape, tokens[:, :-1])
                loss_t = F.cross_entropy(logits.reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                loss_t.backward()
                optimizer.step()
                loss = float(loss_t.detach())
                cast_into(mirror, master)
            version = f"lr{lr:g}-step{step}"
            # The plain-cost kinds take turns going first; the always-delta round
            # (the slowest on one host) goes last, so its aftermath (its worker's
            # freed memory, the caches it swept) falls on the next training step
            # rather than on whichever kind follows it.
            light = KINDS[1:]
            order = (*light[step % len(light) :], *light[: step % len(light)], KINDS[0])
            stats = {}
            for kind in order:
                stats[kind] = await engines[kind].send_weights(weight_version=version)
            expected = model_checksum(mirror)
            exact = True
            for client in clients.values():
                (status,) = await client.weights_status(checksum=True)
                exact &= status["checksum"] == expected and status["weight_version"] == version
            full_s = stats["full"].wall_s
            encode_s = engines["always"].transport.round_encode_s  # type: ignore[union-attr]
            row = {
                "step": step,
                "loss": loss,
                "bytes": stats["full"].bytes,
                "wire_bytes": stats["always"].wire_bytes,
                "wire_fraction": stats["always"].wire_bytes / stats["always"].bytes,
                "auto_wire_bytes": stats["auto"].wire_bytes,
                "full_s": full_s,
                "always_s": stats["always"].wall_s,
                "always_encode_s": encode_s,
                "auto_s": stats["auto"].wall_s,
                "always_ratio": stats["always"].wall_s / full_s,
                "auto_ratio": stats["auto"].wall_s / full_s,
                "twin_s": stats["twin"].wall_s,
                "twin_ratio": stats["twin"].wall_s / full_s,
                "bit_exact": exact,
            }
            rows.append(row)
            print(
                f"lr {lr:g} step {step:2d} loss {loss:6.3f} | delta wire "
                f"{row['wire_bytes'] / 2**20:7.2f} of {row['bytes'] / 2**20:.1f} MiB "
                f"({100 * row['wire_fraction']:5.1f}%) | full {full_s:.3f}s, delta "
                f"{row['always_s']:.3f}s (x{row['always_ratio']:.2f}; coding "
                f"{encode_s:.3f}s), auto "
                f"{row['auto_s']:.3f}s (x{row['auto_ratio']:.2f}, "
                f"{row['auto_wire_bytes'] / 2**20:.1f} MiB), twin x{row['twin_ratio']:.2f} "
                f"| exact={exact}",
                flush=True,
            )
        host_bytes = {
            kind: engines[kind].transport.state.host_bytes  # type: ignore[union-attr]
            for kind in ("always", "auto")
        }
    finally:
        for engine in engines.values():
            await engine.shutdown()
        for client in clients.values():
            await client.close()
    deltas = rows[1:]  # round 0 is the first, full, round of every engine
    return {
        "lr": lr,
        "rows": rows,
        "trainer_host_copy_bytes": host_bytes,
        "median_wire_fraction": _median([r["wire_fraction"] for r in deltas]),
        "max_wire_fraction": max(r["wire_fraction"] for r in deltas),
        "median_always_ratio": _median([r["always_ratio"] for r in deltas]),
        "median_auto_ratio": _median([r["auto_ratio"] for r in deltas]),
        "max_auto_ratio": max(r["auto_ratio"] for r in deltas),
        "median_twin_ratio": _median([r["twin_ratio"] for r in deltas]),
        "max_twin_ratio": max(r["twin_ratio"] for r in deltas),
        "all_bit_exact": all(r["bit_exact"] for r in rows),
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    shape = shape_for(args.quick)
    params = sum(math.prod(d) for _, d in shape.param_shapes())
    print(f"model: {params / 1e6:.1f} M parameters, {shape.nbytes / 2**20:.1f} MiB of bf16")
    env = dict(os.environ, **{MODEL_ENV: shape.to_json(), "OMP_NUM_THREADS": "1"})
    workers = [start_worker(WORKER_MODEL, "--backend", args.backend, env=env) for _ in KINDS]
    try:
        urls = [url for _, url in workers]
        runs = [await run_lr(lr, shape, args, urls) for lr in args.lrs]
        rss = {f"{kind}_worker": peak_rss(proc.pid) for kind, (proc, _) in zip(KINDS, workers)}
    finally:
        for proc, _ in workers:
            stop_worker(proc)
    return {
        "command": " ".join(["python", "benchmarks/delta_trajectory.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "model": {
            "params": params,
            "wire_bytes": shape.nbytes,
            "shape": json.loads(shape.to_json()),
        },
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "worker_peak_rss_bytes": rss,
        "runs": runs,
    }


async def _cluster_trainer(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    shape = shape_for(args.quick)
    params = sum(math.prod(d) for _, d in shape.param_shapes())
    runs = [
        await run_lr(lr, shape, args, plan["urls"], api_key=plan["api_key"], host=plan["host"])
        for lr in args.lrs
    ]
    return {
        "command": " ".join(
            [
                "python",
                "benchmarks/delta_trajectory.py",
                *sys.argv[sys.argv.index("--in-cluster") + 2 :],
            ]
        ),
        "rate_bps": args.rate,
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(),
            "torch": torch.__version__,
        },
        "model": {"params": params, "wire_bytes": shape.nbytes},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "in_cluster")},
        "worker_peak_rss_bytes": {},
        "runs": runs,
    }


def run_in_cluster(args: argparse.Namespace) -> dict[str, Any]:
    """The same trajectory with every process on an emulated host (root needed): the
    trainer on one, each worker on its own, every link capped at `args.rate` bit/s both
    ways (`asyncwt._bench.cluster.hosts`). The trainer runs as a child of this script
    inside its host's namespace (`--in-cluster`)."""
    import secrets
    import subprocess

    from asyncwt._bench.cluster.hosts import Cluster, check_support
    from asyncwt._worker.launch import spawn_worker, wait_for_url
    from asyncwt._worker.server import API_KEY_ENV

    check_support()
    shape = shape_for(args.quick)
    api_key = secrets.token_hex(16)
    env = {
        "PYTHONPATH": os.pathsep.join(
            filter(
                None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]
            )
        ),
        MODEL_ENV: shape.to_json(),
        API_KEY_ENV: api_key,
        "OMP_NUM_THREADS": "1",
    }
    names = {"t0": 1, **{f"w{i}": 101 + i for i in range(len(KINDS))}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workers: list[subprocess.Popen[bytes]] = []
    with Cluster(names) as cluster:
        cluster.set_rate(args.rate)
        try:
            urls = []
            for i in range(len(KINDS)):
                host = cluster.hosts[f"w{i}"]
                proc = spawn_worker(
                    WORKER_MODEL, "--backend", "tcp", host=host.address, port=8100,
                    env={**os.environ, **env}, prefix=host.exec_prefix(env),
                )  # fmt: skip
                workers.append(proc)
                urls.append(wait_for_url(proc, 120))
            trainer = cluster.hosts["t0"]
            plan = {"urls": urls, "api_key": api_key, "host": trainer.address}
            cmd = trainer.exec_prefix(env) + [
                sys.executable, __file__, "--in-cluster", json.dumps(plan),
                *sys.argv[1:],
            ]  # fmt: skip
            subprocess.run(cmd, check=True)
        finally:
            for proc in workers:
                stop_worker(proc)
        left = cluster.down()
    if left:
        print(f"WARNING: could not remove {left}")
    return json.loads((out / "trajectory.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, 4 steps")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default 20)")
    parser.add_argument("--lrs", default="1e-6,1e-5", help="learning rates, comma-separated")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--bucket-mib", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the trainer")
    parser.add_argument("--out", default="bench-out/delta")
    parser.add_argument(
        "--rate",
        default=None,
        help="run on an emulated cluster with every link capped at this rate (bit/s, "
        "e.g. 1G; root needed), instead of loopback",
    )
    parser.add_argument(
        "--backend",
        choices=("tcp", "shm"),
        default="tcp",
        help="the backend on one host (default tcp; the emulated cluster is tcp only)",
    )
    parser.add_argument("--in-cluster", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rate is not None:
        units = {"K": 10**3, "M": 10**6, "G": 10**9}
        text = args.rate.upper()
        args.rate = int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    args.lrs = [float(x) for x in args.lrs.split(",")]
    if args.rate is not None and args.backend != "tcp":
        parser.error(f"--rate runs on an emulated cluster, tcp only; got --backend {args.backend}")
    if args.steps is None:
        args.steps = 4 if args.quick else 20
    torch.set_num_threads(args.threads)
    if args.rate is not None and args.in_cluster is None:
        result = run_in_cluster(args)
        _summary(result, Path(args.out))
        return
    if args.in_cluster is not None:
        plan = json.loads(args.in_cluster)
        result = anyio.run(_cluster_trainer, args, plan, backend="asyncio")
    else:
        result = anyio.run(main_async, args, backend="asyncio")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trajectory.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.in_cluster is None:
        _summary(result, out)


def _summary(result: dict[str, Any], out: Path) -> None:
    print()
    for run in result["runs"]:
        print(
            f"lr {run['lr']:g}: delta rounds put median {100 * run['median_wire_fraction']:.1f}% "
            f"(max {100 * run['max_wire_fraction']:.1f}%) of the payload on the wire; time vs "
            f"full: delta x{run['median_always_ratio']:.2f}, auto x{run['median_auto_ratio']:.2f}"
            f" (max x{run['max_auto_ratio']:.2f}), a second full trainer (the noise) "
            f"x{run['median_twin_ratio']:.2f} (max x{run['max_twin_ratio']:.2f}); bit-exact "
            f"{run['all_bit_exact']}; trainer host copy at the end: "
            + ", ".join(
                f"{k} {v / 2**20:.1f} MiB" for k, v in run["trainer_host_copy_bytes"].items()
            )
        )
    rss = result["worker_peak_rss_bytes"]
    print("worker peak RSS: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in rss.items()))
    print(f"wrote {out / 'trajectory.json'}")


if __name__ == "__main__":
    main()
