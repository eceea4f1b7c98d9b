"""`HttpClient` with vLLM: generation paused around each round (`pause=...`) and always
resumed; a server whose engine died fails the round at once.

A stub of vLLM's routes records what the client asks; the real server is in
test_vllm.py (`pytest -m vllm`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from asyncwt import ControlPlaneError, HttpClient
from asyncwt._trainer.engine import round_failed


class VllmStub:
    """vLLM's pause and weight-update routes; `update_weights` fails when told to."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail_update = False
        self.paused = False
        self.update_s = 0.0
        self.health = 200

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(request.path_qs)
        if request.path == "/pause":
            self.paused = True
        elif request.path == "/resume":
            self.paused = False
        elif request.path == "/update_weights" and self.fail_update:
            return web.json_response({"error": "boom"}, status=500)
        elif request.path == "/update_weights":
            await asyncio.sleep(self.update_s)
        elif request.path == "/health":
            return web.Response(status=self.health)
        return web.json_response({})


@pytest_asyncio.fixture
async def stub() -> AsyncIterator[tuple[VllmStub, str]]:
    server = VllmStub()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", server.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)  # a hung update is cut short
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_pause_should_be_a_vllm_mode() -> None:
    with pytest.raises(ValueError, match=r"pause should be None or one of .*got 'later'"):
        HttpClient("http://127.0.0.1:1", pause="later")  # type: ignore[arg-type]


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
async def test_a_round_is_bracketed_by_pause_and_resume(
    stub: tuple[VllmStub, str], mode: Any
) -> None:
    server, url = stub
    async with HttpClient(url, pause=mode) as client:
        await client.start_weight_update()
        assert server.paused
        await client.update_weights({})
        await client.finish_weight_update("v1")
        assert server.calls == [
            f"/pause?mode={mode}&clear_cache=true",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/resume",
        ]
        assert not server.paused
        assert client.paused_s is not None and client.paused_s > 0


@pytest.mark.asyncio
async def test_a_failed_round_resumes_generation(stub: tuple[VllmStub, str]) -> None:
    server, url = stub
    server.fail_update = True
    async with HttpClient(url, pause="keep") as client:
        await client.start_weight_update()
        with pytest.raises(ControlPlaneError, match=r"/update_weights .* HTTP 500: boom"):
            await client.update_weights({})
        assert not server.paused
        await round_failed(client, timeout=10)  # the engine's call after any failure: no-op now
        assert server.calls.count("/resume") == 1


@pytest.mark.asyncio
async def test_round_failed_resumes_a_round_that_failed_elsewhere(
    stub: tuple[VllmStub, str],
) -> None:
    """The round may fail on the trainer's side after `update_weights` returned: the
    engine's `round_failed` call resumes generation then."""
    server, url = stub
    async with HttpClient(url, pause="keep") as client:
        await client.start_weight_update()
        await client.update_weights({})
        assert server.paused
        await round_failed(client, timeout=10)
        assert not server.paused
        assert "/finish_weight_update" not in server.calls


@pytest.mark.asyncio
async def test_without_pause_nothing_is_paused(stub: tuple[VllmStub, str]) -> None:
    server, url = stub
    async with HttpClient(url) as client:
        await client.start_weight_update()
        await client.update_weights({})
        await client.finish_weight_update("v1")
        await round_failed(client, timeout=10)
    assert server.calls == ["/start_weight_update", "/update_weights", "/finish_weight_update"]
    assert client.paused_s is None


@pytest.mark.asyncio
async def test_update_weights_fails_once_the_server_says_its_engine_died(
    stub: tuple[VllmStub, str],
) -> None:
    """vLLM keeps its HTTP server up when its engine core dies, and the update in
    flight never answers; `/health` answers 503. Before the watch, the round waited
    for the client's whole timeout."""
    server, url = stub
    server.update_s, server.health = 3600.0, 503
    async with HttpClient(url, timeout=600) as client:
        with pytest.raises(
            ControlPlaneError, match=r"/update_weights to .* GET /health answered 503"
        ):
            await client.update_weights({})


@pytest.mark.asyncio
async def test_a_server_without_health_route_is_not_watched(stub: tuple[VllmStub, str]) -> None:
    server, url = stub
    server.update_s, server.health = 2.5, 404  # outlasts the first health poll
    async with HttpClient(url) as client:
        await client.update_weights({})
    assert server.calls.count("/health") == 1
