"""Every script in examples/ runs as a user runs it, and prints what it promises."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncwt._worker.launch import worker_process

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(*args: str, timeout: float = 100) -> list[str]:
    """Run `python examples/ARGS...`; assert exit code 0; return its stdout lines."""
    result = subprocess.run(
        [sys.executable, *args],
        cwd=EXAMPLES,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return result.stdout.splitlines()


def test_every_example_starts_with_a_docstring_and_is_tested() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    for name in scripts:
        source = (EXAMPLES / name).read_text()
        assert source.startswith('"""'), (
            f"{name} should start with a docstring saying what it shows"
        )
    tested = {
        "async_rl_loop.py",
        "plain_trainer.py",
        "fsdp_trainer.py",
        "quickstart.py",
        "ray_rl_loop.py",
        "grpo_vllm.py",  # needs vLLM: test_vllm.py runs it against a real server
    }
    helpers = {"_bandit.py", "rollout_worker.py"}  # run by the examples above
    assert set(scripts) == tested | helpers, "a new example needs a test here"


def test_examples_use_only_public_names() -> None:
    allowed_private = {
        "asyncwt._worker.launch",  # worker_process: starts `asyncwt worker`
    }
    for path in EXAMPLES.glob("*.py"):
        for module in re.findall(r"^\s*from (asyncwt\.\w+) import", path.read_text(), re.MULTILINE):
            assert module in allowed_private, f"{path.name} imports private {module}"


@pytest.mark.slow
def test_async_rl_loop_tags_every_batch_with_its_version() -> None:
    steps = 12
    lines = run_example("async_rl_loop.py", "--steps", str(steps))
    assert re.fullmatch(r"rollout worker at http://127\.0\.0\.1:\d+", lines[0])
    versions = ["initial"] + [f"step-{k}" for k in range(1, steps + 1)]
    previous_next = "initial"
    for step, line in enumerate(lines[1 : steps + 1], start=1):
        match = re.fullmatch(
            rf"step {step}: trained on rollouts of (initial|step-\d+) "
            r"\((latest weights|1 version behind); digest and log-probs verified\) \| "
            rf"mean reward [\d.]+ \| pushed step-{step} \([\d.]+ KiB, 1 bucket\(s\), \d+ ms\) "
            r"while the next rollouts were generated with (initial|step-\d+)",
            line,
        )
        assert match, line
        trained_on, lag, generated_with = match.groups()
        assert trained_on == previous_next  # the batch fetched during the previous push
        # Generated during the push of step-{step}: with that version or the one before.
        assert generated_with in (versions[step - 1], versions[step])
        newest = versions[step - 1]
        assert lag == ("latest weights" if trained_on == newest else "1 version behind")
        previous_next = generated_with
    assert re.fullmatch(
        r"async RL loop finished: mean reward [\d.]+ -> [\d.]+; every rollout batch was "
        r"generated with the version it was tagged with \(\d+ with the latest weights, "
        r"\d+ one version behind\)",
        lines[steps + 1],
    ), lines[steps + 1]
    assert len(lines) == steps + 2


@pytest.mark.slow
def test_plain_trainer_is_on_policy_every_step() -> None:
    steps = 12
    lines = run_example("plain_trainer.py", "--steps", str(steps))
    assert re.fullmatch(r"rollout worker at http://127\.0\.0\.1:\d+", lines[0])
    for step, line in enumerate(lines[1 : steps + 1], start=1):
        version = "initial" if step == 1 else f"step-{step - 1}"
        assert re.fullmatch(
            rf"step {step}: rollouts of {version} verified \| mean reward [\d.]+ \| "
            rf"pushed step-{step} \([\d.]+ KiB in \d+ ms\)",
            line,
        ), line
    assert re.fullmatch(
        r"plain trainer finished: mean reward [\d.]+ -> [\d.]+; every batch was on-policy",
        lines[steps + 1],
    ), lines[steps + 1]


@pytest.mark.slow
def test_fsdp_trainer_ranks_push_bit_exact() -> None:
    lines = run_example("fsdp_trainer.py", "--steps", "2")
    assert re.fullmatch(
        r"worker server at http://127\.0\.0\.1:\d+; spawning 2 FSDP2 trainer ranks", lines[0]
    )
    for step, line in enumerate(lines[1:3], start=1):
        assert re.fullmatch(
            rf"step {step}: loss [\d.]+ \| rank 0 pushed \d+ KiB in \d+ buckets \(\d+ ms\) \| "
            rf"worker at step-{step}, checksum matches the gathered model",
            line,
        ), line
    assert lines[3:] == ["fsdp trainer finished: 2 rounds from 2 ranks arrived bit-exact"]


@pytest.mark.slow
def test_fsdp_trainer_owner_senders_push_bit_exact() -> None:
    lines = run_example("fsdp_trainer.py", "--steps", "2", "--senders", "owners")
    for step, line in enumerate(lines[1:3], start=1):
        assert re.fullmatch(
            rf"step {step}: loss [\d.]+ \| ranks pushed (\d+) KiB, rank 0 (\d+) KiB in \d+ "
            rf"buckets \(\d+ ms\) \| worker at step-{step}, checksum matches the gathered model",
            line,
        ), line
    assert lines[3:] == ["fsdp trainer finished: 2 rounds from 2 ranks arrived bit-exact"]


@pytest.mark.slow
def test_quickstart_pushes_three_steps() -> None:
    env = dict(os.environ, PYTHONPATH=str(EXAMPLES))  # as `cd examples` does in the docs
    with worker_process("quickstart:make_model", env=env) as url:
        lines = run_example("quickstart.py", url)
    assert len(lines) == 3
    for step, line in enumerate(lines, start=1):
        assert re.fullmatch(
            rf"step {step}: round {step} \(version step-{step}\): [\d.]+ MiB in 1 buckets to "
            rf"1 worker\(s\) in [\d.]+s, [\d.]+ GB/s; busy iterate=[\d.]+s pack=[\d.]+s "
            rf"send=[\d.]+s; worker at step-{step}",
            line,
        ), line


@pytest.mark.ray
@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None and os.environ.get("ASYNCWT_REQUIRE_RAY") != "1",
    reason="Ray is not installed (pip install 'asyncwt[ray]'); ASYNCWT_REQUIRE_RAY=1 fails instead",
)
def test_ray_rl_loop_pushes_bit_exact_to_two_rollout_actors() -> None:
    steps = 3
    lines = run_example("ray_rl_loop.py", "--steps", str(steps))
    assert lines[0] == "ray cluster: 1 trainer actor, 2 rollout actors"
    for step, line in enumerate(lines[1 : steps + 1], start=1):
        version = "initial" if step == 1 else f"step-{step - 1}"
        assert re.fullmatch(
            rf"step {step}: loss [\d.]+ \| rollouts of {version} \| pushed step-{step} "
            rf"\([\d.]+ KiB in \d+ ms\) \| 2 rollout actors at step-{step}, checksums match",
            line,
        ), line
    assert lines[steps + 1 :] == [
        f"ray RL loop finished: {steps} rounds arrived bit-exact in both rollout actors"
    ]
