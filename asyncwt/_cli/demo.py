"""`asyncwt demo`: a trainer pushing its weights to a worker server after each step.

It starts `asyncwt worker` in a separate process, trains a small MLP on a synthetic
regression task, pushes the weights over TCP after every optimizer step
(`await engine.send_weights(weight_version=...)`), and checks that the worker's
checksum equals the trainer's, printing one line per round.
"""

from __future__ import annotations

import asyncio

import torch
from torch import nn

from .._backends.tcp.settings import TcpTrainerInitInfo
from .._control.http import HttpClient
from .._core.checksum import model_checksum
from .._core.registry import trainer_init
from .._core.source import ModuleSource
from .._worker.launch import worker_process

__all__ = ["demo_model", "run_demo"]

HIDDEN = 1536
LAYERS = 8


def demo_model() -> nn.Module:
    """The demo's policy: an MLP of about 75 MB in fp32 (the worker builds the same)."""
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(HIDDEN, HIDDEN), nn.GELU()]
    layers.append(nn.Linear(HIDDEN, 1))
    return nn.Sequential(*layers)


async def run_demo(steps: int = 5, bucket_mib: int = 16) -> None:
    """Train for `steps` steps, pushing and verifying the weights after each."""
    torch.manual_seed(0)
    policy = demo_model()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-4)
    inputs = torch.randn(256, HIDDEN)
    targets = inputs[:, :1].sin()
    with worker_process("asyncwt._cli.demo:demo_model") as url:
        print(f"worker server at {url}; model of {_mib(policy):.1f} MiB")
        async with HttpClient(url) as client:
            info = TcpTrainerInitInfo(rank=0, bucket_bytes=bucket_mib << 20)
            engine = await trainer_init(info, client=client, source=ModuleSource(policy))
            async with engine:
                for step in range(1, steps + 1):
                    loss = nn.functional.mse_loss(policy(inputs), targets)
                    optimizer.zero_grad()
                    loss.backward()  # type: ignore[no-untyped-call]
                    optimizer.step()
                    stats = await engine.send_weights(weight_version=f"step-{step}")
                    (status,) = await client.weights_status(checksum=True)
                    same = status["checksum"] == model_checksum(policy)
                    if not same or status["weight_version"] != f"step-{step}":
                        raise SystemExit(f"step {step}: the worker's weights differ: {status}")
                    print(
                        f"step {step}: loss {loss.item():.4f} | pushed {stats.bytes / 2**20:.1f} MiB "
                        f"in {stats.buckets} buckets in {stats.wall_s * 1e3:.0f} ms "
                        f"({stats.throughput_gbps:.2f} GB/s) | worker at {status['weight_version']}, "
                        f"checksum matches",
                        flush=True,
                    )
    print("demo finished: every round arrived bit-exact")


def _mib(model: nn.Module) -> float:
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20


def main(steps: int = 5) -> int:
    """Entry point of `asyncwt demo`."""
    try:
        import uvloop

        uvloop.run(run_demo(steps))
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        asyncio.run(run_demo(steps))
    return 0
