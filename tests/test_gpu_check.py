"""scripts/gpu-check off the GPU: its list, its refusal to pretend without CUDA, its
argument errors. Its checks themselves run on the lent GPU machine only."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check"
CHECK_NAMES = [
    "cuda-tests",
    "pack-cuda-staging",
    "caller-fence",
    "nccl-world1",
    "lag-probe",
    "event-wait-idle",
    "fsdp2-nccl",
    "ipc-reinit",
    "cpu-model-gloo",
    "fork-after-import",
]


def _load_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (no `.py` suffix, so by its loader; registered while the
    test runs, as its dataclasses need)."""
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check", module)
    loader.exec_module(module)
    return module


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # No GPU, even where the tests run on one: the run must find no CUDA.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_list_names_every_check_once_with_a_description() -> None:
    done = _run("--list")
    assert done.returncode == 0, done.stderr
    rows = [line.split(None, 1) for line in done.stdout.splitlines()]
    assert [row[0] for row in rows] == CHECK_NAMES
    assert all(len(row) == 2 and len(row[1]) > 20 for row in rows)


def test_without_cuda_every_check_is_reported_not_run(tmp_path: Path) -> None:
    done = _run("--out", str(tmp_path))
    assert done.returncode == 3, done.stdout + done.stderr
    assert re.search(r"^gpu-check: CUDA is not available: ", done.stdout, re.MULTILINE)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["exit_code"] == 3
    assert list(report["checks"]) == CHECK_NAMES
    for result in report["checks"].values():
        assert result["outcome"] == "not-run (no CUDA)"
        assert result["error"] == "CUDA is not available: torch.cuda.is_available() is False"
    table = (tmp_path / "report.md").read_text()
    for name in CHECK_NAMES:
        assert re.search(rf"^\| {re.escape(name)} \| not-run \(no CUDA\) \|", table, re.MULTILINE)


def test_without_cuda_only_the_selected_checks_are_reported(tmp_path: Path) -> None:
    done = _run("--only", "ipc-reinit,cuda-tests", "--out", str(tmp_path))
    assert done.returncode == 3
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["checks"]) == ["cuda-tests", "ipc-reinit"]


def test_only_with_an_unknown_name_names_it_and_the_known_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    known = ", ".join(CHECK_NAMES)
    with pytest.raises(
        ValueError,
        match=rf"^unknown check 'nccl-world2' in --only; known checks: {re.escape(known)}$",
    ):
        _load_script(monkeypatch).select_checks("cuda-tests,nccl-world2")


def test_only_with_an_unknown_name_exits_with_a_usage_error() -> None:
    done = _run("--only", "nccl-world2", "--list")
    assert done.returncode == 2
    assert re.search(
        r"^gpu-check: error: unknown check 'nccl-world2' in --only; known checks: cuda-tests, ",
        done.stderr,
        re.MULTILINE,
    )
