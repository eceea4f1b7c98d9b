"""The trainer's listener admits real workers through a flood (issue 23, finding 6).

The flood comes from this process while the trainer listens; the worker is an
`asyncwt worker` process of its own, connecting as it would in production.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import _models
import anyio
import pytest
from _faults import assert_worker_has, info_for, worker_env

from asyncwt import HttpClient, ModuleSource, Timeouts, trainer_init
from asyncwt._transports.wire import pack_hello
from asyncwt._worker.launch import worker_process

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])


pytestmark = pytest.mark.slow


@contextlib.asynccontextmanager
async def flooding(port: int, idle: int, stalled: int) -> AsyncIterator[None]:
    """`idle` connections that send nothing and `stalled` ones that send a HELLO and
    then nothing, held for the block's duration (connected without blocking the
    loop, which the trainer's listener shares)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(idle + stalled):
            sock = socket.socket()
            socks.append(sock)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
        await anyio.sleep(0.2)  # the trainer takes in what it will take in
        for sock in socks[idle:]:
            with contextlib.suppress(OSError):
                sock.send(pack_hello(secrets.token_bytes(32), bytes(32)))
        yield
    finally:
        for sock in socks:
            sock.close()


class FloodingClient(HttpClient):
    """Floods the trainer's listener just before the workers are told where it is."""

    def __init__(self, url: str, idle: int, stalled: int) -> None:
        super().__init__(url, timeout=60)
        self.idle = idle
        self.stalled = stalled
        self.stack = contextlib.AsyncExitStack()

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self.stack.enter_async_context(flooding(init_info["port"], self.idle, self.stalled))
        await super().init_weight_transfer_engine(init_info)


@uvloop_only
@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_a_flood_of_idle_and_stalled_handshakes_does_not_starve_a_worker(
    backend: str,
) -> None:
    """160 idle connections (and 40 that stall after their HELLO) held through init:
    the worker is admitted at once instead of waiting behind them (16 slots x 10 s)."""
    model = _models.mixed()
    _models.randomize(model, seed=6)
    with worker_process("_models:mixed", "--backend", backend, env=worker_env()) as url:
        client = FloodingClient(url, idle=160, stalled=40)
        try:
            async with client:
                start = time.monotonic()
                with anyio.fail_after(60):
                    engine = await trainer_init(
                        info_for(backend, timeouts=Timeouts(connect=20.0)),
                        client=client,
                        source=ModuleSource(model),
                    )
                took = time.monotonic() - start
                async with engine:
                    await engine.send_weights(weight_version="admitted")
                await assert_worker_has(client, model, "admitted")
        finally:
            await client.stack.aclose()
    assert took < 10.0
