"""A plain trainer: the same bandit toy in an ordinary for-loop, no async code at all.

`asyncwt.SyncTrainerEngine` runs the async engine on a private event loop thread;
`engine.send_weights(weight_version=...)` blocks until the worker has the new
weights applied and published. The loop is strictly on-policy: rollouts for step
k come from `rollout_worker.py` (a separate process) after the push of step k-1
returned, so every batch must be tagged with the version pushed just before, and
the trainer checks that tag against a digest of the weights the worker used.

What it shows:

- `SyncTrainerEngine(TcpTrainerInitInfo(rank=0), client=HttpClient(url), source=...)`
  as a context manager: the engine shuts down (and closes the client) on exit;
- no `async`/`await` in user code: rollouts are fetched with `urllib`;
- a blocking push per step, whose `RoundStats` is printed.

Run it: `python examples/plain_trainer.py [--steps N]` (CPU, a few seconds).
"""

from __future__ import annotations

import argparse

import torch
from _bandit import (
    Environment,
    make_policy,
    policy_gradient_loss,
    request_rollouts_blocking,
    rollout_worker,
    version_name,
    weights_digest,
)

from asyncwt import HttpClient, ModuleSource, SyncTrainerEngine, TcpTrainerInitInfo


def main(steps: int) -> None:
    env = Environment()
    policy = make_policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.03)
    rewards_seen: list[float] = []
    with rollout_worker() as url:
        print(f"rollout worker at {url}", flush=True)
        info = TcpTrainerInitInfo(rank=0, bucket_bytes=1 << 20)
        with SyncTrainerEngine(info, client=HttpClient(url), source=ModuleSource(policy)) as engine:
            expected_version: str | None = None  # the worker starts from the same initial weights
            expected_digest = weights_digest(policy)
            for step in range(1, steps + 1):
                batch = request_rollouts_blocking(url, env.contexts(), seed=step)
                if (batch.weight_version, batch.weights_digest) != (
                    expected_version,
                    expected_digest,
                ):
                    raise SystemExit(
                        f"step {step}: rollouts tagged {version_name(batch.weight_version)}, "
                        f"expected {version_name(expected_version)} with the trainer's weights"
                    )
                rewards = env.rewards(batch.contexts, batch.actions)
                rewards_seen.append(rewards.mean().item())
                loss = policy_gradient_loss(policy, batch, rewards)  # on-policy: plain REINFORCE
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

                version = f"step-{step}"
                stats = engine.send_weights(weight_version=version)  # blocks for the round
                expected_version, expected_digest = version, weights_digest(policy)
                print(
                    f"step {step}: rollouts of {version_name(batch.weight_version)} verified | "
                    f"mean reward {rewards_seen[-1]:.3f} | pushed {version} "
                    f"({stats.bytes / 1024:.1f} KiB in {stats.wall_s * 1e3:.0f} ms)",
                    flush=True,
                )
    first, last = rewards_seen[0], sum(rewards_seen[-3:]) / len(rewards_seen[-3:])
    if steps >= 10 and not last > first + 0.2:
        raise SystemExit(f"the policy did not learn: mean reward {first:.3f} -> {last:.3f}")
    print(
        f"plain trainer finished: mean reward {first:.2f} -> {last:.2f}; every batch was on-policy"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    main(parser.parse_args().steps)
