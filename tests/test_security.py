"""No way in: authentication, bounded inputs, loopback by default, no pickle.

The fuzzing of every reader (frame headers, handshakes, the server's routes) is in
test_fuzz.py; its harness, shared with the tests here, in _fuzzkit.py.
"""

from __future__ import annotations

import ast
import asyncio
import json
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _models
import aiohttp
import anyio
import pytest
from _faults import info_for, open_fds
from _fuzzkit import TOKEN, fake_trainer, run_trainer_handshake, small_plan, trainer_links

import asyncwt
from asyncwt import (
    AuthenticationError,
    Listen,
    LocalClient,
    ModuleSource,
    TcpTrainerInitInfo,
    Timeouts,
    WeightTransferConfig,
    create_worker_engine,
    trainer_init,
)
from asyncwt._transports.link import connect_link
from asyncwt._transports.wire import (
    CHALLENGE_SIZE,
    HandshakeStatus,
    pack_challenge,
    pack_hello,
    pack_proof,
    pack_result,
)
from asyncwt._worker.server import DEFAULT_MAX_BODY_BYTES, build_app

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])
PACKAGE = Path(asyncwt.__file__).resolve().parent


# -- no pickle, no eval -----------------------------------------------------------------

FORBIDDEN_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "marshal",
    "shelve",
    "dill",
    "cloudpickle",
    "joblib",
}
FORBIDDEN_CALLS = {"eval", "exec", "__import__"}
FORBIDDEN_ATTRIBUTES = {
    ("torch", "load"),
    ("pickle", "loads"),
    ("pickle", "load"),
    ("marshal", "loads"),
}


def _violations(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    yield f"{path.name}:{node.lineno}: import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                yield f"{path.name}:{node.lineno}: from {node.module} import ..."
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
                yield f"{path.name}:{node.lineno}: {func.id}(...)"
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and (func.value.id, func.attr) in FORBIDDEN_ATTRIBUTES
            ):
                yield f"{path.name}:{node.lineno}: {func.value.id}.{func.attr}(...)"


def test_the_package_never_unpickles_or_evaluates() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    found = [v for path in files for v in _violations(path)]
    assert found == []


def test_the_scan_catches_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\neval('1')\ntorch.load('x')\n")
    assert len(list(_violations(bad))) == 4


# -- loopback by default ----------------------------------------------------------------


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc shows them) listening on `port`."""
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


LOOPBACK_V4 = "0100007F"


@uvloop_only
@pytest.mark.parametrize("backend", ["tcp", "shm", "torch_dist"])
async def test_every_trainer_listener_binds_loopback_by_default(backend: str) -> None:
    """The link's listener and (torch_dist) the group's store: 127.0.0.1 only."""
    seen: dict[str, list[str]] = {}
    engines = [create_worker_engine(WeightTransferConfig(backend=backend), model=_models.mixed())]

    class Recording(LocalClient):
        async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            seen["link"] = _listening_addresses(init_info["port"])
            if "store_port" in init_info:
                seen["store"] = _listening_addresses(init_info["store_port"])
            await super().init_weight_transfer_engine(init_info)

    try:
        info = info_for(backend)
        assert info.listen.host == "127.0.0.1"  # type: ignore[attr-defined]
        engine = await trainer_init(
            info, client=Recording(engines), source=ModuleSource(_models.mixed())
        )
        await engine.shutdown()
    finally:
        engines[0].shutdown()
    assert seen["link"] == [LOOPBACK_V4]
    if backend == "torch_dist":
        assert seen["store"] == [LOOPBACK_V4]


def test_the_worker_server_binds_loopback_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    from asyncwt._cli import main as _cli
    from asyncwt._worker import server as _server

    assert inspect.signature(_server.serve).parameters["host"].default == "127.0.0.1"
    with pytest.raises(SystemExit):
        _cli.main(["worker", "--help"])
    assert "address to bind (default 127.0.0.1)" in " ".join(capsys.readouterr().out.split())


# -- mutual authentication --------------------------------------------------------------


def test_the_worker_refuses_a_trainer_that_does_not_know_the_token() -> None:
    plan = small_plan()
    digest = bytes.fromhex(plan.digest)

    def wrong_token(hello: bytes) -> bytes:
        worker_nonce = hello[8:40]
        return pack_challenge("not-the-token-at-all", worker_nonce, secrets.token_bytes(32), digest)

    port, thread = fake_trainer(wrong_token)
    with pytest.raises(AuthenticationError, match=r"^the trainer failed the token challenge"):
        connect_link("127.0.0.1", port, TOKEN, plan, timeout=5)
    thread.join(10)


@uvloop_only
async def test_a_replayed_proof_is_refused() -> None:
    """The trainer's nonce is fresh per handshake: a recorded proof does not verify."""
    links = trainer_links()
    digest = bytes.fromhex(links.plan.digest)
    nonce = secrets.token_bytes(32)
    old_trainer_nonce = secrets.token_bytes(32)
    replay = pack_hello(nonce, digest) + pack_proof(TOKEN, nonce, old_trainer_nonce, digest)
    peers, answer = await run_trainer_handshake(links, replay)
    assert peers == []
    assert answer[CHALLENGE_SIZE:] == pack_result(HandshakeStatus.BAD_PROOF)


# -- bounded inputs on the control plane ------------------------------------------------


@uvloop_only
async def test_the_worker_server_refuses_an_oversized_body_with_a_json_413() -> None:
    assert DEFAULT_MAX_BODY_BYTES == 64 << 20
    from aiohttp import web

    app = build_app(_models.mixed(), config=WeightTransferConfig(), max_body_bytes=4096)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/init_weight_transfer_engine"
            big = json.dumps({"init_info": {"plan": {"pad": "x" * 8192}}})
            async with session.post(
                url, data=big, headers={"Content-Type": "application/json"}
            ) as r:
                assert r.status == 413
                assert "error" in await r.json()
    finally:
        await runner.cleanup()


@uvloop_only
async def test_deeply_nested_json_is_a_400_not_a_500() -> None:
    from aiohttp import web

    app = build_app(_models.mixed(), config=WeightTransferConfig())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            deep = '{"update_info": ' + "[" * 100_000 + "]" * 100_000 + "}"
            async with session.post(f"http://127.0.0.1:{port}/update_weights", data=deep) as r:
                assert r.status == 400, await r.text()
                assert (await r.json())["error"].endswith("nested too deeply")
    finally:
        await runner.cleanup()


# -- connection limits ------------------------------------------------------------------


@uvloop_only
async def test_a_flood_of_idle_connections_during_init_holds_few_trainer_descriptors() -> None:
    """Idle connections occupy at most `max_pending_handshakes` accepted sockets, each
    for `handshake_timeout`; the real worker still gets in once they time out."""
    flood = 24
    limit = 4
    worker = create_worker_engine(WeightTransferConfig(), model=_models.mixed())
    idle: list[socket.socket] = []
    during: list[int] = []

    class Flooding(LocalClient):
        async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            before = open_fds()
            for _ in range(flood):
                idle.append(socket.create_connection(("127.0.0.1", init_info["port"])))
            await anyio.sleep(0.2)  # the trainer accepts what it will accept
            during.append(open_fds() - before - flood)  # the trainer's share
            await super().init_weight_transfer_engine(init_info)

    info = TcpTrainerInitInfo(
        rank=0,
        bucket_bytes=_models.BUCKET_BYTES,
        listen=Listen(max_pending_handshakes=limit),
        timeouts=Timeouts(handshake=0.3),
    )
    try:
        with anyio.fail_after(30):
            engine = await trainer_init(
                info, client=Flooding([worker]), source=ModuleSource(_models.mixed())
            )
        async with engine:
            assert engine.num_workers == 1
            await engine.send_weights(weight_version="through")
    finally:
        for sock in idle:
            sock.close()
        worker.shutdown()
    assert during and during[0] <= limit
    assert worker.weight_version == "through"
    await asyncio.sleep(0)


# -- the control plane's API key (issue 23, finding 4) ---------------------------------

ROUTES = [
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/start_weight_update"),
    ("POST", "/update_weights"),
    ("POST", "/finish_weight_update"),
    ("POST", "/shutdown_weight_transfer_engine"),
    ("GET", "/weights_status"),
    ("GET", "/no_such_route"),
]


async def _answers_without_the_key(url: str, headers: dict[str, str]) -> list[tuple[int, str, str]]:
    found = []
    async with aiohttp.ClientSession(headers=headers) as session:
        for method, route in ROUTES:
            async with session.request(method, url + route, json={}) as response:
                body = await response.json()
                found.append(
                    (response.status, response.headers.get("WWW-Authenticate", ""), body["error"])
                )
    return found


@uvloop_only
@pytest.mark.parametrize("how", ["flag-on-loopback", "env-on-all-interfaces"])
@pytest.mark.slow
async def test_a_worker_with_an_api_key_refuses_every_route_without_it(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the key in $ASYNCWT_API_KEY, HttpClient finds it there, as the worker does."""
    from _faults import assert_worker_has, worker_env

    from asyncwt import HttpClient
    from asyncwt._worker.launch import worker_process

    key = secrets.token_urlsafe(24)
    if how == "flag-on-loopback":
        args, env = (f"--api-key={key}",), worker_env()  # a key may start with "-"
    else:
        args, env = ("--host", "0.0.0.0"), worker_env(ASYNCWT_API_KEY=key)
    with worker_process("_models:mixed", "--backend", "tcp", *args, env=env) as url:
        url = url.replace("0.0.0.0", "127.0.0.1")
        for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": key}):
            answers = await _answers_without_the_key(url, headers)
            assert {(status, challenge) for status, challenge, _ in answers} == {(401, "Bearer")}
            assert answers[0][2].startswith(
                "this worker requires an API key: send 'Authorization: Bearer"
            )
        if how == "env-on-all-interfaces":
            monkeypatch.setenv("ASYNCWT_API_KEY", key)
            client = HttpClient(url)
        else:
            client = HttpClient(url, api_key=key)
        async with client:
            model = _models.mixed()
            engine = await trainer_init(
                TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(model)
            )
            async with engine:
                _models.randomize(model, seed=4)
                await engine.send_weights(weight_version="authenticated")
            await assert_worker_has(client, model, "authenticated")


@pytest.mark.slow
def test_the_worker_refuses_to_serve_beyond_loopback_without_an_api_key() -> None:
    import subprocess
    import sys

    from _faults import worker_env

    env = worker_env()
    env.pop("ASYNCWT_API_KEY", None)
    command = [
        sys.executable,
        "-m",
        "asyncwt",
        "worker",
        "--model",
        "_models:mixed",
        "--host",
        "0.0.0.0",
    ]
    done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")  # a usage error
    assert done.stderr.startswith(
        "asyncwt worker: error: refusing to serve on '0.0.0.0' without an API key: beyond "
        "loopback anyone who reaches the port could re-init the worker and push weights. "
        "Pass --api-key KEY or set ASYNCWT_API_KEY"
    ), done.stderr


def test_serve_checks_the_api_key_before_binding() -> None:
    from asyncwt._worker.server import check_api_key, is_loopback

    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    assert check_api_key(None, "127.0.0.1") is None
    assert check_api_key("k", "0.0.0.0") == "k"
    with pytest.raises(ValueError, match=r"^refusing to serve on '::' without an API key"):
        check_api_key(None, "::")
    with pytest.raises(ValueError, match=r"^api_key should be a non-empty str or None, got ''$"):
        check_api_key("", "127.0.0.1")


@uvloop_only
@pytest.mark.slow
async def test_a_round_from_a_stranger_cannot_break_the_trainers_link() -> None:
    """A second client that is not the trainer (it does not know the trainer's id):
    its update with round id 2**64-1 and its start naming another trainer are
    refused (409), and the trainer's next round completes."""
    from _faults import SMALL_TIMEOUTS, assert_worker_has, worker_env

    from asyncwt import HttpClient
    from asyncwt._worker.launch import worker_process

    with worker_process("_models:mixed", "--backend", "tcp", env=worker_env()) as url:
        async with HttpClient(url) as client, HttpClient(url) as stranger:
            model = _models.mixed()
            info = TcpTrainerInitInfo(
                rank=0, bucket_bytes=_models.BUCKET_BYTES, timeouts=SMALL_TIMEOUTS
            )
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=5)
                await engine.send_weights(weight_version="v1")
                stale: dict[str, Any] = {"round_id": 2**64 - 1, "plan_digest": engine.plan.digest}
                for update_info in (stale, {**stale, "trainer_id": "f" * 32}):
                    await stranger.start_weight_update()
                    with pytest.raises(
                        asyncwt.ControlPlaneError,
                        match=r"HTTP 409: update_weights for round 18446744073709551615 refused: it "
                        r"names a trainer other than the one this worker was initialised with",
                    ):
                        await stranger.update_weights(update_info)
                with pytest.raises(
                    asyncwt.ControlPlaneError,
                    match=r"HTTP 409: start_weight_update refused: it names a trainer other than "
                    r"the one this worker was initialised with",
                ):
                    await stranger.start_weight_update(trainer_id="f" * 32)
                _models.randomize(model, seed=6)
                await engine.send_weights(weight_version="v2")
            await assert_worker_has(client, model, "v2")
