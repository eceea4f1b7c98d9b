"""The toy task shared by `async_rl_loop.py` and `plain_trainer.py`: a contextual bandit.

A *context* is a random vector of `CONTEXT_DIM` numbers (think "prompt"). The policy
maps it to a distribution over `NUM_ACTIONS` actions (think "completion"); the
environment pays reward 1 when the action is the best one for that context (decided
by a hidden linear map) and 0 otherwise, so a random policy earns about
1 / NUM_ACTIONS and a trained one approaches 1.

Who runs what:

- the trainer (the example script) owns the environment, computes rewards and
  trains the policy with a policy-gradient step;
- the rollout worker (`rollout_worker.py`, a separate process) holds its own copy
  of the policy, receives the trainer's weights through asyncwt, and samples actions.

This module also holds the small helpers both sides use: `weights_digest` (a
bit-exact fingerprint of a model's weights) and `rollout_worker` (start the worker
process and yield its URL).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

CONTEXT_DIM = 8
NUM_ACTIONS = 4
HIDDEN = 32
BATCH = 256
HERE = Path(__file__).resolve().parent


def make_policy() -> nn.Module:
    """The policy: contexts -> action logits. Trainer and worker build the same one."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(CONTEXT_DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, NUM_ACTIONS))


class Environment:
    """Hands out contexts and scores actions (trainer side only)."""

    def __init__(self, seed: int = 42) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._best_of = torch.randn(NUM_ACTIONS, CONTEXT_DIM, generator=self._generator)

    def contexts(self, n: int = BATCH) -> torch.Tensor:
        return torch.randn(n, CONTEXT_DIM, generator=self._generator)

    def rewards(self, contexts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        best = (contexts @ self._best_of.T).argmax(dim=1)
        return (actions == best).float()


def sample_actions(
    policy: nn.Module, contexts: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one action per context; return `(actions, their log-probabilities)`.

    Runs on the worker, with whatever weights the worker holds.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logp = torch.log_softmax(policy(contexts), dim=-1)
        actions = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1)
    return actions, logp.gather(1, actions[:, None]).squeeze(1)


def log_probs(policy: nn.Module, contexts: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of `actions` under `policy` (differentiable)."""
    logp = torch.log_softmax(policy(contexts), dim=-1)
    return logp.gather(1, actions[:, None]).squeeze(1)


def policy_gradient_loss(policy: nn.Module, batch: Rollouts, rewards: torch.Tensor) -> torch.Tensor:
    """REINFORCE with a mean baseline, importance-weighted for off-policy batches.

    `ratio = pi_current(a|x) / pi_behaviour(a|x)` corrects for a batch sampled by an
    older version of the policy (the async loop's batches may be one version behind);
    for an on-policy batch it is exactly 1 and this is plain REINFORCE.
    """
    advantage = rewards - rewards.mean()
    current = log_probs(policy, batch.contexts, batch.actions)
    ratio = (current - batch.log_probs).exp()
    return -(ratio * advantage).mean()


def weights_digest(model: nn.Module) -> str:
    """SHA-256 over every parameter's name and raw bytes: equal iff bit-identical."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        tensor = param.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(ctypes.string_at(tensor.data_ptr(), tensor.numel() * tensor.element_size()))
    return digest.hexdigest()


@dataclass
class Rollouts:
    """One batch of rollouts, as the worker answered it."""

    contexts: torch.Tensor
    actions: torch.Tensor
    log_probs: torch.Tensor
    """Log-probabilities of `actions` under the worker's weights when it sampled them."""
    weight_version: str | None
    """The worker's published weight version at generation time (`None`: initial weights)."""
    weights_digest: str
    """`weights_digest` of the worker's model at generation time."""

    @classmethod
    def from_answer(cls, contexts: torch.Tensor, answer: dict[str, Any]) -> Rollouts:
        return cls(
            contexts=contexts,
            actions=torch.tensor(answer["actions"], dtype=torch.int64),
            log_probs=torch.tensor(answer["log_probs"], dtype=torch.float32),
            weight_version=answer["weight_version"],
            weights_digest=answer["weights_digest"],
        )


def rollout_request(contexts: torch.Tensor, seed: int) -> dict[str, Any]:
    """The JSON body of `POST /rollouts`."""
    return {"contexts": contexts.tolist(), "seed": seed}


def request_rollouts_blocking(url: str, contexts: torch.Tensor, seed: int) -> Rollouts:
    """`POST /rollouts` with the standard library (for the plain, non-async trainer)."""
    request = urllib.request.Request(
        f"{url}/rollouts",
        data=json.dumps(rollout_request(contexts, seed)).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return Rollouts.from_answer(contexts, json.load(response))


def version_name(version: str | None) -> str:
    return "initial" if version is None else version


@contextlib.contextmanager
def rollout_worker(start_timeout: float = 60.0) -> Iterator[str]:
    """Run `rollout_worker.py` in a child process; yield its base URL; stop it on exit."""
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "rollout_worker.py"), "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the worker's first line, or "" if it died
        if not line.startswith("rollout worker listening on "):
            raise RuntimeError(f"rollout worker did not start (exit code {proc.poll()}): {line!r}")
        yield line.rsplit(" ", 1)[1].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
