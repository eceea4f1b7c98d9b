"""README's main job, `asyncwt demo`, run as a user runs it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_pushes_every_step_bit_exact() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asyncwt", "demo", "--steps", "2"],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.match(r"^worker server at http://127\.0\.0\.1:\d+; model of [\d.]+ MiB$", lines[0])
    for step, line in enumerate(lines[1:3], start=1):
        assert re.match(
            rf"^step {step}: loss [\d.]+ \| pushed [\d.]+ MiB in \d+ buckets in \d+ ms "
            rf"\([\d.]+ GB/s\) \| worker at step-{step}, checksum matches$",
            line,
        ), line
    assert lines[3] == "demo finished: every round arrived bit-exact"
    assert "Warning" not in result.stderr


def test_demo_rejects_zero_steps() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asyncwt", "demo", "--steps", "0"],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--steps should be >= 1, got 0" in result.stderr
