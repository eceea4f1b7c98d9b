"""The `asyncwt` command line: every mistake is one line on stderr, caught before the
model is built, with a non-zero exit; `--log-level` on every command."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncwt._cli import main as _cli

ROOT = Path(__file__).resolve().parent.parent
BUILT: list[str] = []
"""Names of the models `built` made: a mistake must be reported before any."""


def built() -> object:
    """A `--model` factory that records being called."""
    import torch

    BUILT.append("built")
    return torch.nn.Linear(2, 2)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the CLI puts "" on it
    monkeypatch.delenv("ASYNCWT_LOG_LEVEL", raising=False)
    monkeypatch.delenv("ASYNCWT_API_KEY", raising=False)
    BUILT.clear()
    yield


def run_worker(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """`asyncwt worker --model test_cli:built ARGS`: its exit status and its stderr."""
    try:
        code = _cli.main(["worker", "--model", "test_cli:built", *args])
    except SystemExit as exc:  # argparse's own mistakes
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


BUILT_IN = ("cuda_ipc", "shm", "tcp", "torch_dist")
BACKENDS = "registered backends: " + ", ".join(repr(name) for name in BUILT_IN)


@pytest.fixture(autouse=True)
def only_built_in_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lines name the registered backends: hide those other test modules register
    in this process (`tests/_server_models.py`), whatever ran before."""
    from asyncwt._core import registry as _registry

    built_in = {k: v for k, v in _registry._WORKER_ENGINES.items() if k in BUILT_IN}
    assert sorted(built_in) == list(BUILT_IN), sorted(_registry._WORKER_ENGINES)
    monkeypatch.setattr(_registry, "_WORKER_ENGINES", built_in)


TO_DO = "pass one that runs here to --backend (tcp and shm need only a CPU), or --import the module that registers yours"


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["--backend", "tpc"],
            f"unknown worker backend 'tpc'; {BACKENDS}; {TO_DO}",
        ),
        (
            ["--host", "999.1.1.1"],
            (
                "--host '999.1.1.1' is not an address: [Errno -2] Name or service not known; give "
                "an IP address or a name of this machine, e.g. 127.0.0.1 (this host only, the "
                "default) or 0.0.0.0 (every interface, with --api-key)"
            ),
        ),
        (
            ["--transform", "no_such_module_here:f"],
            (
                "--transform no_such_module_here:f: cannot import no_such_module_here (No module "
                "named 'no_such_module_here'); it should be importable from {cwd}: run from the "
                "folder holding no_such_module_here.py or its package, add that folder to "
                "PYTHONPATH, or pip install the package"
            ),
        ),
        (["--port", "x"], None),
        (["--log-level", "LOUD"], None),
    ],
    ids=["backend", "host", "transform", "port-type", "log-level"],
)
def test_worker_mistake_is_one_line_before_the_model_is_built(
    capsys: pytest.CaptureFixture[str], args: list[str], line: str | None
) -> None:
    code, err = run_worker(capsys, *args)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("asyncwt worker: error: "), err
    if line is not None:
        assert err == f"asyncwt worker: error: {line.format(cwd=os.getcwd())}\n"
    assert BUILT == []


def test_a_port_in_use_is_named_before_the_model_is_built(
    capsys: pytest.CaptureFixture[str], busy_port: int
) -> None:
    code, err = run_worker(capsys, "--port", str(busy_port))
    assert (code, err) == (
        2,
        (
            f"asyncwt worker: error: --port {busy_port} is already in use on 127.0.0.1: another "
            "process listens there; stop it, pick another port, or pass --port 0 for a free one\n"
        ),
    )
    assert BUILT == []


def test_cuda_ipc_without_a_gpu_says_why_and_what_to_use(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = run_worker(capsys, "--backend", "cuda_ipc")
    assert (code, err) == (
        2,
        (
            "asyncwt worker: error: worker backend 'cuda_ipc' is not available: it needs a CUDA "
            f"GPU and torch.cuda.is_available() is False here; {BACKENDS}; {TO_DO}\n"
        ),
    )


def test_a_bad_log_level_in_the_environment_names_the_variable(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCWT_LOG_LEVEL", "loud")
    code, err = run_worker(capsys)
    assert (code, err) == (
        2,
        (
            "asyncwt worker: error: $ASYNCWT_LOG_LEVEL should be one of DEBUG, INFO, WARNING, "
            "ERROR (any case), got 'loud'; unset it or pass --log-level\n"
        ),
    )


def test_a_failing_server_start_is_one_line_not_a_crash_outside_the_loop(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure of the server after the checks (here a port taken between the check and
    the bind) is reported from the task group's exception group, outside any loop."""
    monkeypatch.setattr(_cli, "_check_bindable", lambda host, port: None)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        code, err = run_worker(capsys, "--port", str(port))
    assert code == 1
    assert err.count("\n") == 1, err
    assert err.startswith("asyncwt worker: error: OSError: "), err
    assert "address already in use" in err


@pytest.mark.parametrize("command", ["worker", "demo", "bench"])
def test_every_command_takes_log_level(capsys: pytest.CaptureFixture[str], command: str) -> None:
    with pytest.raises(SystemExit):
        _cli.main([command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--log-level LEVEL DEBUG, INFO, WARNING, ERROR" in help_text
    assert "$ASYNCWT_LOG_LEVEL" in help_text


@pytest.mark.slow
def test_a_model_in_the_current_folder_is_found_as_python_m_finds_it() -> None:
    """From examples/, `--model quickstart:make_model` imports (the error that ends the
    run is the backend's, which is checked after the import)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncwt",
            "worker",
            "--model",
            "quickstart:make_model",
            "--backend",
            "tpc",
        ],
        check=False,
        cwd=ROOT / "examples",
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stderr) == (
        2,
        f"asyncwt worker: error: unknown worker backend 'tpc'; {BACKENDS}; {TO_DO}\n",
    )


def test_valid_options_build_the_model_then_serve(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control for the tests above: with nothing wrong, the factory is called."""
    served: list[object] = []
    monkeypatch.setattr(_cli.anyio, "run", lambda fn, model, *a, **kw: served.append(model))
    code, err = run_worker(capsys, "--backend", "shm")
    assert (code, err, BUILT, len(served)) == (0, "", ["built"], 1)
