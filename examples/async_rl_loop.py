"""An async RL loop: push the new weights while the next rollouts are being generated.

The trainer (this process) learns a contextual bandit (see `_bandit.py`) with a
policy gradient. Rollouts come from a separate worker process (`rollout_worker.py`)
that holds its own copy of the policy, receives the trainer's weights through
asyncwt's `"tcp"` backend, and samples actions with whatever weights it holds.

What it shows:

- `asyncwt.trainer_init` with an `HttpClient` and a `ModuleSource`, then
  `await engine.send_weights(weight_version=...)` after every optimizer step;
- overlap: right after step k, one anyio task group runs the push of version
  `step-k` and the request for the next batch of rollouts at the same time;
  the trainer does not wait for the push before asking for more data;
- version tags: the worker tags each batch with the `weight_version` it had
  published when it generated the batch (`None`, shown as "initial", before the
  first push). Depending on which request reaches the worker first, the batch
  for step k+1 was generated with `step-k` or with `step-(k-1)`; the worker never
  generates while a round is changing its weights. The trainer checks every tag
  twice and stops on a mismatch: the worker's digest of the weights it used
  must equal the trainer's digest of that version, and the worker's log-probs
  must equal log-probs recomputed with that version;
- using the tag: the loss importance-weights a batch that is one version behind.

Run it: `python examples/async_rl_loop.py [--steps N]` (CPU, a few seconds).
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp
import anyio
import torch
from _bandit import (
    Environment,
    Rollouts,
    log_probs,
    make_policy,
    policy_gradient_loss,
    rollout_request,
    rollout_worker,
    version_name,
    weights_digest,
)

from asyncwt import (
    HttpClient,
    ModuleSource,
    RoundStats,
    TcpTrainerInitInfo,
    TrainerWeightTransferEngine,
    trainer_init,
)


class VersionBook:
    """What the trainer remembers of each version it pushed, to check rollout tags."""

    def __init__(self, policy: torch.nn.Module) -> None:
        self.order: list[str | None] = []
        self.digests: dict[str | None, str] = {}
        self.weights: dict[str | None, dict[str, torch.Tensor]] = {}
        self._reference = make_policy()
        self.record(None, policy)  # the worker starts from the same initial weights

    def record(self, version: str | None, policy: torch.nn.Module) -> None:
        self.order.append(version)
        self.digests[version] = weights_digest(policy)
        self.weights[version] = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        # A real trainer would keep only the last few versions.

    def check(self, batch: Rollouts) -> int:
        """Raise unless `batch` was generated with the version it is tagged with.

        Returns how many versions behind the newest recorded one the batch is.
        """
        version = batch.weight_version
        if version not in self.digests:
            raise SystemExit(f"rollouts tagged with {version!r}, a version never pushed")
        if batch.weights_digest != self.digests[version]:
            raise SystemExit(
                f"rollouts tagged {version_name(version)} were generated with other weights "
                f"(digest {batch.weights_digest[:12]}…, expected {self.digests[version][:12]}…)"
            )
        self._reference.load_state_dict(self.weights[version])
        with torch.no_grad():
            expected = log_probs(self._reference, batch.contexts, batch.actions)
        if not torch.allclose(batch.log_probs, expected, rtol=1e-5, atol=1e-6):
            raise SystemExit(
                f"log-probs of rollouts tagged {version_name(version)} do not match it"
            )
        return len(self.order) - 1 - self.order.index(version)


async def request_rollouts(
    http: aiohttp.ClientSession, url: str, contexts: torch.Tensor, seed: int
) -> Rollouts:
    async with http.post(f"{url}/rollouts", json=rollout_request(contexts, seed)) as response:
        response.raise_for_status()
        answer: dict[str, Any] = await response.json()
    return Rollouts.from_answer(contexts, answer)


# --8<-- [start:overlap]
async def push_and_generate(
    engine: TrainerWeightTransferEngine[Any],
    version: str,
    http: aiohttp.ClientSession,
    url: str,
    contexts: torch.Tensor,
    seed: int,
) -> tuple[RoundStats, Rollouts]:
    """Push `version` to the worker and fetch the next rollouts from it, concurrently.

    The weights must not change until `send_weights` returns: the caller runs its
    next optimizer step only after this returns.
    """
    results: dict[str, Any] = {}

    async def push() -> None:
        results["stats"] = await engine.send_weights(weight_version=version)

    async def generate() -> None:
        results["batch"] = await request_rollouts(http, url, contexts, seed)

    async with anyio.create_task_group() as tg:  # a failure in one cancels the other
        tg.start_soon(push)
        tg.start_soon(generate)
    return results["stats"], results["batch"]


# --8<-- [end:overlap]


async def main(steps: int) -> None:
    env = Environment()
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.03)
    book = VersionBook(policy)
    rewards_seen: list[float] = []
    behind_counts = [0, 0]
    with rollout_worker() as url:
        print(f"rollout worker at {url}", flush=True)
        async with aiohttp.ClientSession() as http, HttpClient(url) as client:
            info = TcpTrainerInitInfo(rank=0, bucket_bytes=1 << 20)
            engine = await trainer_init(info, client=client, source=ModuleSource(policy))
            async with engine:
                batch = await request_rollouts(http, url, env.contexts(), seed=0)
                for step in range(1, steps + 1):
                    behind = book.check(batch)
                    if behind > 1:
                        raise SystemExit(f"step {step}: rollouts {behind} versions behind")
                    behind_counts[behind] += 1
                    rewards = env.rewards(batch.contexts, batch.actions)
                    rewards_seen.append(rewards.mean().item())
                    loss = policy_gradient_loss(policy, batch, rewards)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()

                    version = f"step-{step}"
                    book.record(version, policy)
                    trained_on = batch.weight_version
                    stats, batch = await push_and_generate(
                        engine, version, http, url, env.contexts(), seed=step
                    )
                    lag = "latest weights" if behind == 0 else "1 version behind"
                    print(
                        f"step {step}: trained on rollouts of {version_name(trained_on)} "
                        f"({lag}; digest and log-probs verified) | mean reward "
                        f"{rewards_seen[-1]:.3f} | pushed {version} ({stats.bytes / 1024:.1f} KiB, "
                        f"{stats.buckets} bucket(s), {stats.wall_s * 1e3:.0f} ms) while the next "
                        f"rollouts were generated with {version_name(batch.weight_version)}",
                        flush=True,
                    )
                book.check(batch)  # the batch fetched during the last push is tagged right too
    first, last = rewards_seen[0], sum(rewards_seen[-3:]) / len(rewards_seen[-3:])
    if steps >= 10 and not last > first + 0.2:
        raise SystemExit(f"the policy did not learn: mean reward {first:.3f} -> {last:.3f}")
    print(
        f"async RL loop finished: mean reward {first:.2f} -> {last:.2f}; every rollout batch "
        f"was generated with the version it was tagged with ({behind_counts[0]} with the latest "
        f"weights, {behind_counts[1]} one version behind)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    anyio.run(main, parser.parse_args().steps)
