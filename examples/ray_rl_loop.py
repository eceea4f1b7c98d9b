"""An RL loop on a Ray cluster: one trainer actor pushes its weights to two rollout actors.

Ray places the actors; asyncwt moves the weights. After every optimizer step the
trainer actor runs `await engine.send_weights()` through a `RayClient` over the
rollout actors' handles; the bytes go over asyncwt's tcp transport (the rollout actors
connect to the trainer's node address), never through Ray's object store. Each round
is checked bit-exact against the actors' `weights_status(checksum=True)`.

    pip install -e '.[ray]' && python ray_rl_loop.py      # from the repository root, then cd examples

On several machines, start Ray on each (`ray start --head` on one, `ray start
--address=HEAD:6379` on the others) and call `ray.init(address="auto")` instead: the
code is the same, see docs/how-to/ray.md.
"""

from __future__ import annotations

import argparse
from typing import Any

import ray
import torch

from asyncwt import (
    Listen,
    ModuleSource,
    RayClient,
    TcpTrainerInitInfo,
    WorkerActor,
    model_checksum,
    trainer_init,
)


def make_model() -> torch.nn.Module:
    """The policy: trainer and rollout actors build the same architecture."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


class Rollout(WorkerActor):
    """A rollout engine: asyncwt's worker actor plus a `generate` that uses its weights."""

    async def generate(self, seed: int) -> tuple[str | None, torch.Tensor, torch.Tensor]:
        """A batch of observations and the actions the current policy takes, with the
        version of the weights that produced them."""
        generator = torch.Generator().manual_seed(seed)
        observations = torch.randn(64, 16, generator=generator)
        with torch.no_grad():
            actions = self.model(observations).argmax(dim=-1)
        return await self.get_weight_version(), observations, actions


class Trainer:
    """The trainer actor: a policy, its optimizer, and an asyncwt engine over the rollouts."""

    def __init__(self, rollouts: list[Any]) -> None:
        self.rollouts = rollouts
        self.model = make_model()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.client = RayClient(rollouts)

    async def run(self, steps: int) -> list[str]:
        # Bind to this node's address and tell the rollout actors to connect there:
        # the same line works when they are on other machines.
        host = ray.util.get_node_ip_address()
        engine = await trainer_init(
            TcpTrainerInitInfo(rank=0, listen=Listen(host=host)),
            client=self.client,
            source=ModuleSource(self.model),
        )
        lines = []
        async with engine:  # shuts the trainer's transport down at the end
            for step in range(1, steps + 1):
                batches = await _gather(
                    [r.generate.remote(step * 10 + i) for i, r in enumerate(self.rollouts)]
                )
                versions = sorted({version or "initial" for version, _, _ in batches})
                # A toy objective: make the policy prefer action 0 on every observation.
                observations = torch.cat([obs for _, obs, _ in batches])
                targets = torch.zeros(len(observations), dtype=torch.long)
                loss = torch.nn.functional.cross_entropy(self.model(observations), targets)
                self.optimizer.zero_grad()
                loss.backward()
                self.optimizer.step()

                stats = await engine.send_weights(weight_version=f"step-{step}")
                expected = model_checksum(self.model)
                statuses = await self.client.weights_status(checksum=True)
                exact = all(
                    s["weight_version"] == f"step-{step}" and s["checksum"] == expected
                    for s in statuses
                )
                if not exact:
                    raise RuntimeError(f"step {step}: a rollout actor's weights differ: {statuses}")
                lines.append(
                    f"step {step}: loss {loss.item():.4f} | rollouts of {', '.join(versions)} | "
                    f"pushed step-{step} ({stats.bytes / 1024:.1f} KiB in "
                    f"{stats.wall_s * 1000:.0f} ms) | {len(statuses)} rollout actors at "
                    f"step-{step}, checksums match"
                )
        await self.client.shutdown()  # the rollout actors release their transport
        return lines


async def _gather(refs: list[Any]) -> list[Any]:
    return [await ref for ref in refs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    ray.init(include_dashboard=False)  # a local Ray cluster; address="auto" joins one
    try:
        # Small CPU shares so that the three actors fit on a 2-core machine.
        rollouts = [ray.remote(num_cpus=0.5)(Rollout).remote(make_model) for _ in range(2)]
        trainer = ray.remote(num_cpus=1)(Trainer).remote(rollouts)
        print(f"ray cluster: 1 trainer actor, {len(rollouts)} rollout actors")
        for line in ray.get(trainer.run.remote(args.steps)):
            print(line)
        for actor in [trainer, *rollouts]:
            ray.kill(actor)
    finally:
        ray.shutdown()
    print(f"ray RL loop finished: {args.steps} rounds arrived bit-exact in both rollout actors")


if __name__ == "__main__":
    main()
