"""The control plane: LocalClient in-process, HttpClient against worker server processes.

Worker servers run as real subprocesses (`python -m asyncwt worker`) with the fake
backend of `_server_models`, which pytest imports from tests/ (on sys.path through
the rootdir conftest) and the subprocesses import through PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch
from _server_models import FAKE_BACKEND, FakeEngine, tiny

import asyncwt
from asyncwt import ControlPlaneError, TransferAbortedError
from asyncwt._control.http import HttpClient
from asyncwt._control.local import LocalClient, finish_engine_round
from asyncwt._core.checksum import model_checksum

TESTS_DIR = Path(__file__).resolve().parent
STARTUP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
LISTENING = "asyncwt worker listening on "


@dataclass
class WorkerProcess:
    """A `python -m asyncwt worker` subprocess."""

    proc: subprocess.Popen[str]
    stderr_path: Path
    url: str = ""

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_listening(self) -> str:
        """Read the one `listening on` line; the base URL it names."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout=STARTUP_TIMEOUT_S):
                raise AssertionError(f"worker did not start in time; stderr:\n{self.stderr()}")
        line = self.proc.stdout.readline()
        if not line.startswith(LISTENING):
            raise AssertionError(f"unexpected worker stdout {line!r}; stderr:\n{self.stderr()}")
        self.url = line[len(LISTENING) :].strip()
        return self.url

    def stop(self) -> int:
        """Terminate (then kill) and reap; the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=STOP_TIMEOUT_S)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        return self.proc.returncode


def spawn_worker(stderr_path: Path, *extra: str, backend: str = FAKE_BACKEND) -> WorkerProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    command = [
        sys.executable,
        "-m",
        "asyncwt",
        "worker",
        "--import",
        "_server_models",
        "--model",
        "_server_models:tiny",
        "--backend",
        backend,
        *extra,
    ]
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
    return WorkerProcess(proc, stderr_path)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProcess]]:
    """Two worker servers, started concurrently, shared by the module's tests."""
    directory = tmp_path_factory.mktemp("workers")
    started = [spawn_worker(directory / f"worker{i}.err") for i in range(2)]
    try:
        for worker in started:
            worker.wait_listening()
        yield started
    finally:
        for worker in started:
            worker.stop()


def post_raw(url: str, route: str, data: bytes) -> tuple[int, str, str]:
    """POST `data` as is; (status, content type, body text), error statuses included."""
    request = urllib.request.Request(url + route, data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers.get_content_type(), response.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers.get_content_type(), exc.read().decode()


def reset(url: str) -> str:
    """Shut the worker's transfer engine down, so each test starts uninitialised."""
    status, _, body = post_raw(url, "/shutdown_weight_transfer_engine", b"{}")
    assert status == 200, body
    return url


@pytest.fixture
def worker_url(workers: list[WorkerProcess]) -> str:
    return reset(workers[0].url)


@pytest.fixture
def worker_urls(workers: list[WorkerProcess]) -> list[str]:
    return [reset(worker.url) for worker in workers]


def filled_checksum(value: float) -> str:
    model = tiny()
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)
    return model_checksum(model)


def engine_args() -> tuple[asyncwt.WeightTransferConfig, None, torch.device, torch.nn.Module]:
    """What `create_worker_engine` passes a fake engine: config, vllm_config, device, model."""
    return asyncwt.WeightTransferConfig(backend=FAKE_BACKEND), None, torch.device("cpu"), tiny()


def local_engines(count: int) -> list[FakeEngine]:
    config = asyncwt.WeightTransferConfig(backend=FAKE_BACKEND)
    engines = [asyncwt.create_worker_engine(config, model=tiny()) for _ in range(count)]
    assert all(isinstance(engine, FakeEngine) for engine in engines)
    return engines  # type: ignore[return-value]


# --- HttpClient against worker processes ------------------------------------------------


@pytest.mark.asyncio
async def test_http_client_runs_a_full_round_and_status_shows_version_and_checksum(
    worker_url: str,
) -> None:
    async with HttpClient(worker_url) as client:
        assert isinstance(client, asyncwt.AsyncWeightSyncClient)
        await client.init_weight_transfer_engine({"label": "round"})
        await client.start_weight_update()
        await client.update_weights({"fill": 1.5})
        await client.finish_weight_update("v1")
        [status] = await client.weights_status(checksum=True)
        assert status == {
            "weight_version": "v1",
            "weights_incomplete": False,
            "checksum": filled_checksum(1.5),
            "backend": FAKE_BACKEND,
            "initialized": True,
            "untouched_params": [],
        }

        await client.shutdown()
        [status] = await client.weights_status(checksum=True)
        assert status["weight_version"] == "v1"  # the model keeps the weights it holds
        assert status["initialized"] is False


@pytest.mark.asyncio
async def test_http_client_fans_out_to_two_workers_concurrently(
    worker_urls: list[str], tmp_path: Path
) -> None:
    async with HttpClient(worker_urls) as client:
        await client.init_weight_transfer_engine({})
        await client.start_weight_update()
        # Each worker waits in update_weights until both arrived: sequential calls
        # would fail with a TransferTimeoutError (500) after 5 s.
        await client.update_weights({"fill": -2.0, "rendezvous": str(tmp_path), "parties": 2})
        await client.finish_weight_update("v2")
        statuses = await client.weights_status(checksum=True)
    assert [s["weight_version"] for s in statuses] == ["v2", "v2"]
    assert [s["checksum"] for s in statuses] == [filled_checksum(-2.0)] * 2


@pytest.mark.asyncio
async def test_http_client_error_names_url_route_status_and_server_message(
    worker_url: str,
) -> None:
    async with HttpClient(worker_url + "/") as client:
        with pytest.raises(
            ControlPlaneError,
            match=(
                r"^POST /update_weights to http://127\.0\.0\.1:\d+ failed with HTTP 409: "
                r"update_weights needs an initialised transfer engine: "
                r"POST /init_weight_transfer_engine first$"
            ),
        ):
            await client.update_weights({"fill": 1.0})


@pytest.mark.asyncio
async def test_http_client_reports_engine_failure_as_500_with_its_type(worker_url: str) -> None:
    async with HttpClient(worker_url) as client:
        await client.init_weight_transfer_engine({})
        await client.start_weight_update()
        with pytest.raises(
            ControlPlaneError,
            match=r"^POST /update_weights to \S+ failed with HTTP 500: TransferAbortedError: boom$",
        ):
            await client.update_weights({"fill": 1.0, "fail": "boom"})


@pytest.mark.asyncio
async def test_http_client_connection_failure_is_control_plane_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nothing listens there
    async with HttpClient(f"http://127.0.0.1:{port}", timeout=10) as client:
        with pytest.raises(
            ControlPlaneError,
            match=r"^POST /start_weight_update to http://127\.0\.0\.1:\d+ failed: ",
        ) as info:
            await client.start_weight_update()
    assert isinstance(info.value.__cause__, aiohttp.ClientError)


def test_http_client_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"^base_urls should name at least one worker URL"):
        HttpClient([])
    with pytest.raises(ValueError, match=r"^base_urls should be http\(s\):// URLs, got 'host:1'$"):
        HttpClient("host:1")


# --- the server's answers to bad requests ------------------------------------------------

BAD_REQUESTS = [
    pytest.param(
        "/start_weight_update",
        b"{not json",
        400,
        r"^request body should be a JSON object: ",
        id="non-json-body",
    ),
    pytest.param(
        "/init_weight_transfer_engine",
        b"[1, 2]",
        400,
        r"^request body should be a JSON object, got a JSON array$",
        id="json-array",
    ),
    pytest.param(
        "/init_weight_transfer_engine",
        b'{"init_info": [1]}',
        400,
        r"^init_info should be a JSON object, got a JSON array$",
        id="init-info-not-object",
    ),
    pytest.param(
        "/update_weights",
        b'{"update_info": "fill"}',
        400,
        r"^update_info should be a JSON object, got a JSON string$",
        id="update-info-not-object",
    ),
    pytest.param(
        "/init_weight_transfer_engine",
        b'{"init_info": {}, "extra": 1}',
        400,
        r"^unknown keys \['extra'\] in request body; expected keys: init_info$",
        id="unknown-key",
    ),
    pytest.param(
        "/init_weight_transfer_engine",
        b'{"init_info": {"nope": 1}}',
        400,
        r"^Invalid init_info for FakeEngine: .*unexpected keyword argument 'nope'$",
        id="init-info-rejected-by-engine",
    ),
    pytest.param(
        "/finish_weight_update",
        b'{"weight_version": 3}',
        400,
        r"^weight_version should be a string or null, got a JSON number$",
        id="bad-weight-version-type",
    ),
    pytest.param(
        "/update_weights",
        b'{"update_info": {"fill": 1}}',
        409,
        r"^update_weights needs an initialised transfer engine: ",
        id="update-before-init",
    ),
    pytest.param(
        "/finish_weight_update",
        b'{"weight_version": "v"}',
        409,
        r"^finish_weight_update needs an initialised transfer engine: ",
        id="finish-before-init",
    ),
    pytest.param("/no_such_route", b"{}", 404, r"^Not Found$", id="unknown-route"),
]


@pytest.mark.parametrize(("route", "data", "status", "pattern"), BAD_REQUESTS)
def test_server_answers_bad_request_with_json_error(
    worker_url: str, route: str, data: bytes, status: int, pattern: str
) -> None:
    got_status, content_type, text = post_raw(worker_url, route, data)
    assert (got_status, content_type) == (status, "application/json"), text
    assert "Traceback" not in text
    body = json.loads(text)
    assert list(body) == ["error"]
    assert isinstance(body["error"], str)
    assert re.match(pattern, body["error"]), body["error"]


def test_server_rejects_bad_update_info_and_accepts_a_second_init(worker_url: str) -> None:
    assert post_raw(worker_url, "/init_weight_transfer_engine", b'{"init_info": {}}')[0] == 200
    status, _, text = post_raw(worker_url, "/update_weights", b'{"update_info": {"fill": "x"}}')
    assert (status, json.loads(text)) == (
        400,
        {"error": "Invalid update_info for FakeEngine: fill should be a number, got 'x'"},
    )
    # A second init re-initialises (a restarted trainer reconnects this way).
    status, _, text = post_raw(worker_url, "/init_weight_transfer_engine", b"{}")
    assert (status, json.loads(text)) == (200, {"ok": True})


def test_server_engine_failure_is_500_without_traceback(worker_url: str) -> None:
    assert post_raw(worker_url, "/init_weight_transfer_engine", b"{}")[0] == 200
    assert post_raw(worker_url, "/start_weight_update", b"{}")[0] == 200
    status, _, text = post_raw(
        worker_url, "/update_weights", b'{"update_info": {"fill": 1, "fail": "disk on fire"}}'
    )
    assert (status, json.loads(text)) == (500, {"error": "TransferAbortedError: disk on fire"})
    assert "Traceback" not in text


# --- the CLI ----------------------------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_worker_exits_zero_on_signal(tmp_path: Path, signum: signal.Signals) -> None:
    worker = spawn_worker(tmp_path / "worker.err")
    try:
        url = worker.wait_listening()
        assert reset(url) == url  # it answers
        worker.proc.send_signal(signum)
        assert worker.proc.wait(timeout=STOP_TIMEOUT_S) == 0, worker.stderr()
    finally:
        worker.stop()


@pytest.mark.slow
def test_worker_with_unknown_backend_fails_before_listening(tmp_path: Path) -> None:
    worker = spawn_worker(tmp_path / "worker.err", backend="no-such-backend")
    try:
        assert worker.proc.wait(timeout=STARTUP_TIMEOUT_S) == 2  # a usage error
        assert worker.proc.stdout is not None and worker.proc.stdout.read() == ""
        assert "unknown worker backend 'no-such-backend'" in worker.stderr()
    finally:
        worker.stop()


# --- LocalClient over in-process engines ---------------------------------------------


@pytest.mark.asyncio
async def test_local_client_runs_update_on_every_engine_concurrently(tmp_path: Path) -> None:
    engines = local_engines(2)
    client = LocalClient(engines)
    assert isinstance(client, asyncwt.AsyncWeightSyncClient)
    await client.init_weight_transfer_engine({"label": "local"})
    await client.start_weight_update()
    # Both engines wait in update_weights until both arrived: one after the other
    # would time out (TransferTimeoutError) after 5 s.
    await client.update_weights({"fill": 0.25, "rendezvous": str(tmp_path), "parties": 2})
    assert [engine.weight_version for engine in engines] == [None, None]
    await client.finish_weight_update("v3")
    assert [engine.weight_version for engine in engines] == ["v3", "v3"]
    assert [engine.init_info and engine.init_info.label for engine in engines] == ["local"] * 2
    assert [model_checksum(engine.model) for engine in engines] == [filled_checksum(0.25)] * 2
    await client.shutdown()
    assert [engine.shut_down for engine in engines] == [True, True]


class FailingEngine(FakeEngine):
    """Fails every round it receives."""

    def receive_weights(self, update_info: Any) -> None:
        raise TransferAbortedError("only the second")


@pytest.mark.asyncio
async def test_local_client_reraises_a_single_engine_failure_as_itself() -> None:
    good, failing = local_engines(1)[0], FailingEngine(*engine_args())
    client = LocalClient([good, failing])
    await client.init_weight_transfer_engine({})
    await client.start_weight_update()
    with pytest.raises(TransferAbortedError, match=r"^only the second$") as info:
        await client.update_weights({"fill": 1.0})
    assert not getattr(info.value, "__notes__", [])
    assert model_checksum(good.model) == filled_checksum(1.0)  # the other engine completed


@pytest.mark.asyncio
async def test_local_client_notes_the_other_failures_when_several_engines_fail() -> None:
    client = LocalClient(local_engines(2))
    await client.init_weight_transfer_engine({})
    await client.start_weight_update()
    with pytest.raises(TransferAbortedError) as info:
        await client.update_weights({"fill": 1.0, "fail": "boom"})
    assert str(info.value) == "boom"
    assert info.value.__notes__ == ["also failed concurrently: TransferAbortedError: boom"]


def test_local_client_rejects_no_engines() -> None:
    with pytest.raises(ValueError, match=r"^engines should hold at least one"):
        LocalClient([])


def test_finish_without_weight_version_parameter_says_so() -> None:
    class SpecEngine(FakeEngine):
        def finish_weight_update(self) -> None:  # type: ignore[override]
            """vLLM's signature: no weight_version."""

    engine = SpecEngine(*engine_args())
    finish_engine_round(engine, None)
    with pytest.raises(
        TypeError, match=r"^SpecEngine\.finish_weight_update takes no weight_version; got 'v'$"
    ):
        finish_engine_round(engine, "v")
