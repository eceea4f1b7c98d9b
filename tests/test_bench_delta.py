"""The delta trajectory benchmark runs end to end (a smoke run): every round bit-exact,
the always-delta trainer's rounds after the first put fewer bytes on the wire than
the payload, and the auto trainer keeps no copy on one host."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_delta_trajectory_smoke_run_is_bit_exact(tmp_path: Path, backend: str) -> None:
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "delta_trajectory.py"),
            "--quick",
            "--steps",
            "2",
            "--lrs",
            "1e-6",
            "--backend",
            backend,
            "--out",
            str(tmp_path),
        ],
        check=True,
        timeout=240,
        capture_output=True,
    )
    (run,) = json.loads((tmp_path / "trajectory.json").read_text())["runs"]
    assert run["all_bit_exact"]
    rows = run["rows"]
    assert len(rows) == 3 and rows[0]["wire_bytes"] == rows[0]["bytes"]
    assert all(row["wire_bytes"] < row["bytes"] for row in rows[1:])
    assert run["trainer_host_copy_bytes"] == {"always": rows[0]["bytes"], "auto": 0}
