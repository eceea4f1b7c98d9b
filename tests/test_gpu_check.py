"""scripts/gpu-check off the GPU: its list, its refusal to pretend without CUDA, its
argument errors, its preflight, its targets and report. Its checks themselves run on
the lent GPU machine only."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
SCRIPT = SCRIPTS / "gpu-check"
CHECK_NAMES = [  # these, in this order; checks added in scripts/_gpu_checks/ go among them
    "cuda-tests",
    "caller-fence",
    "nccl-world1",
    "lag-probe",
    "event-wait-idle",
    "fsdp2-nccl",
    "ipc-reinit",
    "cpu-model-gloo",
    "fork-after-import",
    "nccl-group-probe",  # issue 33, findings 1-2
    "broadcast-skips-training-queue",  # 3
    "reassembly-stays-on-device",  # 4
    "vllm-own-copy",  # 5
    "staged-commit-settles",  # 6
    "shard1-block-copies",  # 7
    "ipc-ring-own-allocations",  # 8
    "ipc-map-on-own-gpu",  # 9
    "delta-scatters-on-gpu",  # 10
    "staging-at-init-off-the-loop",  # 11
    "pinned-gloo-and-shm-ring",  # 12
    "non-sender-rank-joins-lanes",  # 13
    "no-spin-waits",  # 14
    "staging-tcp",
    "staging-shm",
    "staging-gloo",
    "staging-cuda-ipc",
    "staging-nccl",
    "limits",
    "perf-tcp",
    "perf-shm",
    "perf-gloo",
    "perf-cuda-ipc",
]


def _load_script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script as a module (no `.py` suffix, so by its loader; registered while the
    test runs, as its dataclasses need)."""
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts scripts/ first
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


def _registered(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every check's name, in run order (the registry's)."""
    return [c.name for c in _load_script(monkeypatch).core.ordered_checks()]


@pytest.mark.slow
def test_list_names_every_check_once_with_a_description(monkeypatch: pytest.MonkeyPatch) -> None:
    done = _run("--list")
    assert done.returncode == 0, done.stderr
    rows = [line.split(None, 1) for line in done.stdout.splitlines()]
    names = [row[0] for row in rows]
    assert names == _registered(monkeypatch)
    assert [name for name in names if name in CHECK_NAMES] == CHECK_NAMES
    assert len(set(names)) == len(names)
    assert all(len(row) == 2 and len(row[1]) > 20 for row in rows)


@pytest.mark.slow
def test_without_cuda_every_check_is_reported_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    done = _run("--out", str(tmp_path))
    assert done.returncode == 3, done.stdout + done.stderr
    assert re.search(r"^gpu-check: CUDA is not available: ", done.stdout, re.MULTILINE)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["exit_code"] == 3
    names = _registered(monkeypatch)
    assert list(report["checks"]) == names
    for result in report["checks"].values():
        assert result["outcome"] == "not-run (no CUDA)"
        assert result["error"] == "CUDA is not available: torch.cuda.is_available() is False"
    table = (tmp_path / "report.md").read_text()
    for name in names:
        assert re.search(rf"^\| {re.escape(name)} \| not-run \(no CUDA\) \|", table, re.MULTILINE)


@pytest.mark.slow
def test_without_cuda_only_the_selected_checks_are_reported(tmp_path: Path) -> None:
    done = _run("--only", "ipc-reinit,cuda-tests", "--out", str(tmp_path))
    assert done.returncode == 3
    report = json.loads((tmp_path / "report.json").read_text())
    assert list(report["checks"]) == ["cuda-tests", "ipc-reinit"]


def test_only_with_an_unknown_name_names_it_and_the_known_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = _load_script(monkeypatch)
    known = ", ".join(c.name for c in module.core.ordered_checks())
    with pytest.raises(
        ValueError,
        match=rf"^unknown check 'nccl-world2' in --only; known checks: {re.escape(known)}$",
    ):
        module.select_checks("cuda-tests,nccl-world2")


@pytest.mark.slow
def test_only_with_an_unknown_name_exits_with_a_usage_error() -> None:
    done = _run("--only", "nccl-world2", "--list")
    assert done.returncode == 2
    assert re.search(
        r"^gpu-check: error: unknown check 'nccl-world2' in --only; known checks: cuda-tests, ",
        done.stderr,
        re.MULTILINE,
    )


# -- import asyncwt on the GPU image -------------------------------------------------------


@pytest.mark.slow
def test_import_asyncwt_needs_no_zstandard() -> None:
    # The GPU image has no zstandard: asyncwt, its worker CLI and its delta modules
    # import without it (a delta round imports it when it first codes a body).
    code = (
        "import sys; sys.modules['zstandard'] = None\n"
        "import asyncwt, asyncwt._cli.main, asyncwt._worker.delta, asyncwt._delta.sender\n"
        "print('imported')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "imported"


# -- preflight -----------------------------------------------------------------------------


@pytest.fixture
def preflight(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import _gpu_check_preflight

    return _gpu_check_preflight


def _probe_env() -> dict[str, str]:
    paths = [str(ROOT), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))


CHECK_SOURCE = textwrap.dedent(
    """
    import os
    from _gpu_check_core import check, workers

    PROBE = "import json\\nfrom asyncwt._vllm import plugin"


    def helper():
        from asyncwt._trainer import pipeline as _pipeline

        return _pipeline._copy_into_gone


    @check("uses-helper", "a check whose helper reads a renamed function", timeout_s=1)
    def uses_helper(figures):
        helper()


    @check("moved-module", "a check that imports a module the layout removed", timeout_s=1)
    def moved_module(figures):
        import torch

        from asyncwt._core.trainer_api import pipeline

        torch.cuda._sleep(1)
        with workers(("staging", "tcp"), ("no_such_factory", "no_such_backend")):
            pass


    @check("probe-user", "a check that runs PROBE in a child", timeout_s=1)
    def probe_user(figures):
        os.system(PROBE)
    """
)


def test_discover_reads_bodies_helpers_code_strings_chains_and_worker_specs(
    preflight: ModuleType, tmp_path: Path
) -> None:
    source = tmp_path / "checks.py"
    source.write_text(CHECK_SOURCE)
    owners = {str(ref): sorted(who) for ref, who in preflight.discover([source]).items()}
    assert owners["asyncwt._trainer.pipeline._copy_into_gone"] == ["uses-helper"]
    assert owners["asyncwt._core.trainer_api.pipeline"] == ["moved-module"]
    assert owners["torch.cuda._sleep"] == ["moved-module"]
    assert owners["_gpu_check_models.staging"] == ["moved-module"]
    assert owners["_gpu_check_models.no_such_factory"] == ["moved-module"]
    assert owners["backend 'no_such_backend'"] == ["moved-module"]
    assert owners["asyncwt._vllm.plugin"] == ["probe-user"]
    assert owners["_gpu_check_core.check"] == ["*"]  # top-level imports: every check's


@pytest.mark.slow
def test_preflight_probe_names_what_does_not_resolve_and_passes_the_rest(
    preflight: ModuleType, tmp_path: Path
) -> None:
    source = tmp_path / "checks.py"
    source.write_text(CHECK_SOURCE)
    refs = sorted(preflight.discover([source]))
    result = preflight.run_probe(refs, [], _probe_env(), ROOT, 120)
    failed = {f["what"]: f["error"] for f in result["failures"]}
    assert failed == {
        "asyncwt._trainer.pipeline._copy_into_gone": (
            "AttributeError: asyncwt._trainer.pipeline has no attribute '_copy_into_gone'"
        ),
        "asyncwt._core.trainer_api.pipeline": (
            "AttributeError: asyncwt._core.trainer_api has no attribute 'pipeline'"
        ),
        "_gpu_check_models.no_such_factory": (
            "AttributeError: _gpu_check_models has no attribute 'no_such_factory'"
        ),
        "backend 'no_such_backend'": failed["backend 'no_such_backend'"],
    }
    assert failed["backend 'no_such_backend'"].startswith(
        "LookupError: no backend 'no_such_backend' is registered"
    )
    assert result["versions"]["torch"].startswith("2.")


@pytest.mark.slow
def test_every_check_resolves_in_this_interpreter(preflight: ModuleType) -> None:
    # What `gpu-check --preflight` runs (CI runs it in the GPU image's packages too),
    # less the pytest collection of the cuda tests that this suite's run already is.
    owners = preflight.discover(preflight.sources(SCRIPTS))
    assert len(owners) > 100
    result = preflight.run_probe(sorted(owners), [], _probe_env(), ROOT, 120)
    assert result["failures"] == []


def _wheel(where: Path, name: str, tag: str) -> Path:
    """A minimal wheel of one module `name` that sets `VALUE = 1`."""
    path = where / f"{name}-1.0-{tag}.whl"
    info = f"{name}-1.0.dist-info"
    files = {
        f"{name}.py": "VALUE = 1\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as zf:
        for n, text in {**files, f"{info}/RECORD": record}.items():
            zf.writestr(n, text)
    return path


def test_every_probe_a_check_runs_in_a_child_compiles() -> None:
    # A probe (`python -c PROBE`) that does not parse is invisible to the preflight
    # (it reads only code strings that parse): it would fail on the GPU machine only.
    probes = 0
    for path in sorted((SCRIPTS / "_gpu_checks").glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)):
                continue
            text = node.value.value
            if isinstance(text, str) and re.search(r"^(import|from) \w", text, re.MULTILINE):
                compile(text, f"{path.name}:{node.lineno}", "exec")  # raises SyntaxError
                probes += 1
    assert probes >= 5  # basics' fork probe, the lone NCCL rank's, the cuda_ipc ring's three


@pytest.mark.slow
def test_wheels_install_one_by_one_and_a_misfit_drops_only_itself(
    preflight: ModuleType, tmp_path: Path
) -> None:
    wheels, target = tmp_path / "whl", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "aaa_fits", "py3-none-any")
    _wheel(wheels, "bbb_misfit", "cp27-cp27m-win32")
    _wheel(wheels, "ccc_fits", "py3-none-any")
    report = preflight.install_wheels(wheels, target)
    assert [(r["wheel"], r["status"].split(":")[0]) for r in report] == [
        ("aaa_fits-1.0-py3-none-any.whl", "installed"),
        ("bbb_misfit-1.0-cp27-cp27m-win32.whl", "failed"),
        ("ccc_fits-1.0-py3-none-any.whl", "installed"),
    ]
    assert "is not a supported wheel on this platform" in report[1]["status"]
    assert sorted(p.name for p in target.glob("*.py")) == ["aaa_fits.py", "ccc_fits.py"]


# -- the registry ----------------------------------------------------------------------------


def test_a_second_check_of_one_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _load_script(monkeypatch)
    with pytest.raises(ValueError, match=r"^two checks are named 'limits': "):
        module.core.check("limits", "again", timeout_s=1)(lambda figures: None)
    with pytest.raises(ValueError, match=r"^group of check 'x' should be one of "):
        module.core.check("x", "bad group", timeout_s=1, group="fast")


# -- targets and the report --------------------------------------------------------------------


@pytest.fixture
def report(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import _gpu_check_report

    return _gpu_check_report


LIMITS = {
    "d2d_gbps": 2000.0,
    "pinned_d2h_gbps": 50.0,
    "memcpy_gbps": 10.0,
    "shm_streams": 4,
    "tcp_raw_gbps": 8.0,
}


def _result(outcome: str = "pass", **figures: Any) -> dict[str, Any]:
    return {"outcome": outcome, "figures": figures, "summary": "", "error": ""}


def _rows(report: ModuleType, results: dict[str, Any]) -> dict[tuple[str, str], Any]:
    return {(r["check"], r["figure"]): r for r in report.judge(results)}


def test_ratios_are_judged_against_the_limits_of_the_same_run(report: ModuleType) -> None:
    results = {
        "limits": _result(**LIMITS),
        "perf-tcp": _result(**{"64mib_gbps": 7.2, "256mib_gbps": 6.0}),
        "perf-shm": _result(**{"256mib_gbps": 28.0}),  # min(50, 10 x 4) = 40: 0.7x
        "perf-cuda-ipc": _result(**{"64mib_gbps": 100.0, "256mib_gbps": 300.0}),
    }
    rows = _rows(report, results)
    assert rows["perf-tcp", "64mib_gbps"]["ratio"] == 0.9
    assert rows["perf-tcp", "64mib_gbps"]["verdict"] == "meets"
    assert rows["perf-tcp", "256mib_gbps"]["ratio"] == 0.75
    assert rows["perf-tcp", "256mib_gbps"]["verdict"] == "below"
    assert rows["perf-shm", "256mib_gbps"]["limit"] == 40.0
    assert rows["perf-shm", "256mib_gbps"]["verdict"] == "meets"
    assert rows["perf-shm", "64mib_gbps"]["verdict"] == "unjudged"  # its figure is missing
    # cuda_ipc against half the device copy: judged at 256 MiB, shown at 64 MiB.
    assert rows["perf-cuda-ipc", "256mib_gbps"]["ratio"] == 0.3
    assert rows["perf-cuda-ipc", "256mib_gbps"]["verdict"] == "below"
    assert rows["perf-cuda-ipc", "64mib_gbps"]["verdict"] == "shown"
    assert ("perf-gloo", "64mib_gbps") not in rows  # not run: no row


def test_without_the_limits_no_ratio_is_judged(report: ModuleType) -> None:
    rows = _rows(report, {"perf-tcp": _result(**{"64mib_gbps": 7.2})})
    assert rows["perf-tcp", "64mib_gbps"]["ratio"] is None
    assert rows["perf-tcp", "64mib_gbps"]["verdict"] == "unjudged"


def test_lag_device_memory_and_gemm_targets(report: ModuleType) -> None:
    figures = {
        "64mib_lag_ms": 12.0,
        "256mib_lag_ms": 140.0,
        "64mib_extra_device_mib": 150,
        "64mib_device_pool_mib": 128,
        "256mib_extra_device_mib": 700,
        "256mib_device_pool_mib": 512,
        "gemm_ratio": 0.85,
    }
    rows = _rows(report, {"perf-cuda-ipc": _result(**figures), "perf-tcp": _result()})
    assert rows["perf-cuda-ipc", "64mib_lag_ms"]["verdict"] == "meets"
    assert rows["perf-cuda-ipc", "256mib_lag_ms"]["verdict"] == "below"
    assert rows["perf-cuda-ipc", "64mib_extra_device_mib"]["limit"] == 192
    assert rows["perf-cuda-ipc", "64mib_extra_device_mib"]["verdict"] == "meets"
    assert rows["perf-cuda-ipc", "256mib_extra_device_mib"]["verdict"] == "below"
    assert rows["perf-cuda-ipc", "gemm_ratio"]["verdict"] == "meets"
    assert rows["perf-tcp", "64mib_lag_ms"]["verdict"] == "unjudged"


def test_a_missed_target_fails_a_passing_check_and_the_report_shows_it(
    report: ModuleType, tmp_path: Path
) -> None:
    results = {
        "limits": _result(**LIMITS),
        "perf-tcp": _result(**{"64mib_gbps": 4.0, "256mib_gbps": 8.0}),
        "perf-shm": _result("error", **{"64mib_gbps": 1.0}),
    }
    report.apply_verdicts(results, report.judge(results))
    assert results["perf-tcp"]["outcome"] == "fail"
    assert results["perf-tcp"]["summary"] == (
        "missed targets: 64mib_gbps = 4.0 (0.5x raw loopback TCP, needs >= 0.85x)"
    )
    assert results["perf-shm"]["outcome"] == "error"  # its own outcome stands
    wheel = {"wheel": "zstandard-0.25.0-cp312.whl", "status": "installed"}
    checked = {"ok": True, "wheels": [wheel], "versions": {}, "failures": []}
    report.write(tmp_path, {"torch": "2.11.0", "preflight": checked}, results)
    table = (tmp_path / "report.md").read_text()
    assert table.splitlines()[2] == "torch: 2.11.0"
    assert "\nPreflight: passed; wheels: zstandard-0.25.0-cp312.whl (installed)\n" in table
    assert re.search(
        r"^\| perf-tcp \| 64mib_gbps \| 4.0 \| raw loopback TCP \| 8.0 \| 0.5 \| >= 0.85x \| below \|$",
        table,
        re.MULTILINE,
    )
    document = json.loads((tmp_path / "report.json").read_text())
    verdicts = {(r["check"], r["figure"]): r["verdict"] for r in document["targets"]}
    assert verdicts["perf-tcp", "256mib_gbps"] == "meets"
    assert verdicts["perf-shm", "64mib_gbps"] == "below"


@pytest.mark.slow
def test_perf_rounds_fill_the_figures_the_targets_read(
    report: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    # perf-tcp's rounds, on the CPU and a 32 MiB model: what the GPU run will fill.
    monkeypatch.setenv("GPU_CHECK_PERF_GIB", "0.03125")
    monkeypatch.setenv("PYTHONPATH", _probe_env()["PYTHONPATH"])  # the worker's factories
    from _gpu_check_core import workers
    from _gpu_checks import perf

    from asyncwt import TcpTrainerInitInfo

    def info(bucket: int) -> Any:
        return TcpTrainerInitInfo(rank=0, bucket_bytes=bucket)

    figures: dict[str, Any] = {}
    with workers(("perf_cpu", "tcp")) as (url,):
        perf.perf_rounds(figures, "tcp", url, info, device_pool=False, device="cpu")
    assert figures["model_gib"] == 0.03
    for mib in perf.BUCKETS_MIB:
        assert figures[f"{mib}mib_gbps"] > 0
        assert figures[f"{mib}mib_lag_ms"] >= 0
        assert figures[f"{mib}mib_extra_device_mib"] == figures[f"{mib}mib_device_pool_mib"] == 0
    results = {"perf-tcp": _result(**figures), "limits": _result(**LIMITS)}
    verdicts = {r["figure"]: r["verdict"] for r in report.judge(results)}
    assert "unjudged" not in verdicts.values()


def test_a_preflight_failure_blocks_only_the_checks_that_need_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    module = _load_script(monkeypatch)
    failures = [
        {
            "what": "asyncwt._core.trainer_api.pipeline",
            "error": "AttributeError: x",
            "blocks": ["a"],
        },
        {"what": "backend 'shm'", "error": "LookupError: y", "blocks": ["a", "b"]},
    ]
    assert module.blocked_by(failures) == {
        "a": "preflight: asyncwt._core.trainer_api.pipeline: AttributeError: x",
        "b": "preflight: backend 'shm': LookupError: y",
    }
    assert module.group_failures(failures) == [
        ("AttributeError: x", ["asyncwt._core.trainer_api.pipeline"], ["a"]),
        ("LookupError: y", ["backend 'shm'"], ["a", "b"]),
    ]
