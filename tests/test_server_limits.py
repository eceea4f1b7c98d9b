"""The worker server against slow, idle and oversized clients (issue 23, finding 5).

The worker runs in a process of its own, as in production: what is measured is its
descriptors, its memory and whether it keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import io
import json
import logging
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import _models
import aiohttp
import anyio
import pytest
from _faults import assert_worker_has, info_for, proc_rss, read_line, worker_env

from asyncwt import HttpClient, ModuleSource, WeightTransferConfig, trainer_init
from asyncwt._worker.launch import start_worker, stop_worker
from asyncwt._worker.server import serve
from asyncwt._worker.server_limits import ServerLimits, ThrottledLog

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])

HALF_SENT = b"POST /start_weight_update HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le"


_CAPPED = (
    "import resource, runpy, sys; n = int(sys.argv[1]); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); sys.argv[1:2] = []; "
    "runpy.run_module('asyncwt', run_name='__main__', alter_sys=True)"
)
"""`python -c` that caps its descriptors at argv[1], then runs `python -m asyncwt argv[2:]`."""


@contextlib.contextmanager
def worker_with_fd_limit(nofile: int, *args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """`asyncwt worker` (a `_models:mixed` model) whose descriptors are capped at `nofile`."""

    cmd = [sys.executable, "-c", _CAPPED, str(nofile), "worker", "--model", "_models:mixed"]
    proc = subprocess.Popen(
        [*cmd, "--port", "0", *args], stdout=subprocess.PIPE, text=True, env=worker_env()
    )
    try:
        line = read_line(proc, 60)
        assert "listening on " in line, line
        yield proc, line.split("listening on ")[1]
    finally:
        stop_worker(proc)


def half_sent_requests(port: int, count: int) -> list[socket.socket]:
    """`count` connections that each send part of a request's headers, then nothing."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect(("127.0.0.1", port))
            socks.append(sock)
        time.sleep(0.2)
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(HALF_SENT)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


@uvloop_only
@pytest.mark.slow
async def test_half_sent_requests_past_the_worker_fd_limit_leave_a_round_working() -> None:
    """500 half-sent requests against a worker whose descriptors are capped at 256:
    the slow connections are evicted (or cut off by the header timeout) instead of
    taking every descriptor, and the trainer's init and round go through."""
    with worker_with_fd_limit(256) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        socks = half_sent_requests(port, 500)
        try:
            model = _models.mixed()
            _models.randomize(model, seed=5)
            async with HttpClient(url, timeout=20) as client:
                with anyio.fail_after(60):
                    engine = await trainer_init(
                        info_for("tcp"), client=client, source=ModuleSource(model)
                    )
                    async with engine:
                        await engine.send_weights(weight_version="past-the-flood")
                await assert_worker_has(client, model, "past-the-flood")
        finally:
            for sock in socks:
                sock.close()


@uvloop_only
@pytest.mark.slow
async def test_a_body_of_nested_lists_is_refused_before_parsing_and_stalls_nothing() -> None:
    """A 24 MiB body of empty lists is refused (413, naming max_json_items) without
    being parsed: the worker keeps answering meanwhile and its memory stays flat."""
    body = b'{"init_info": [' + b"[]," * (8 << 20) + b"[]]}"
    with worker_with_fd_limit(1024) as (proc, url):
        rss_before = proc_rss(proc.pid)
        async with aiohttp.ClientSession() as session:

            async def status_latency() -> float:
                await asyncio.sleep(0.3)  # while the body is being handled
                start = time.monotonic()
                async with session.get(url + "/weights_status") as response:
                    assert response.status == 200
                return time.monotonic() - start

            async def post() -> tuple[int, str]:
                route = url + "/init_weight_transfer_engine"
                async with session.post(route, data=io.BytesIO(body)) as response:
                    return response.status, (await response.json())["error"]

            with anyio.fail_after(60):
                (status, error), latency = await asyncio.gather(post(), status_latency())
        rss_after = proc_rss(proc.pid)
    assert status == 413, error
    assert error == (
        "request body of /init_weight_transfer_engine holds about 16777219 JSON values, "
        "more than max_json_items=2000000"
    )
    assert latency < 2.0
    assert rss_after - rss_before < 200 << 20


def _serve_in_thread(limits: ServerLimits) -> tuple[int, contextlib.ExitStack]:
    """`serve` with `limits` on a loop of its own; returns its port and a stack that stops it."""
    ports: list[int] = []
    stack = contextlib.ExitStack()
    portal = stack.enter_context(anyio.from_thread.start_blocking_portal())

    def ready(host: str, port: int) -> None:
        ports.append(port)

    future = portal.start_task_soon(
        lambda: serve(_models.mixed(), config=WeightTransferConfig(), ready=ready, limits=limits)
    )
    stack.callback(future.cancel)
    deadline = time.monotonic() + 30
    while not ports and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ports
    return ports[0], stack


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed `sock` within `seconds`, and what it sent first."""
    sock.settimeout(seconds)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        return False, received
    except ConnectionResetError:
        pass
    return True, received


def test_slow_headers_and_slow_bodies_are_cut_off_within_their_timeouts() -> None:
    limits = ServerLimits(header_timeout=0.5, body_timeout=0.5)
    port, stack = _serve_in_thread(limits)
    with stack:
        headers = socket.create_connection(("127.0.0.1", port))
        body = socket.create_connection(("127.0.0.1", port))
        try:
            headers.sendall(HALF_SENT)
            body.sendall(
                b"POST /start_weight_update HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Length: 100\r\n\r\n{"
            )
            closed, sent = _closed_within(headers, 5)
            assert closed and sent == b""
            closed, sent = _closed_within(body, 5)
            assert closed
            assert sent.startswith(b"HTTP/1.1 408"), sent
            error = json.loads(sent.split(b"\r\n\r\n", 1)[1])["error"]
            assert error == (
                "request body of /start_weight_update did not arrive within "
                "body_timeout=0.5s (1 bytes came)"
            )
        finally:
            headers.close()
            body.close()


def test_a_control_route_refuses_a_body_past_control_body_bytes() -> None:
    port, stack = _serve_in_thread(ServerLimits(control_body_bytes=1024))
    with stack, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            b"POST /finish_weight_update HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Length: 4096\r\n\r\n" + b" " * 4096
        )
        _, sent = _closed_within(sock, 10)
        assert sent.startswith(b"HTTP/1.1 413"), sent
        error = json.loads(sent.split(b"\r\n\r\n", 1)[1])["error"]
        assert error == (
            "request body of /finish_weight_update is 4096 bytes, larger than control_body_bytes=1024"
        )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("header_timeout", 0, "header_timeout should be a positive float, got 0"),
        ("body_timeout", float("inf"), "body_timeout should be a positive float, got inf"),
        ("max_connections", 0, "max_connections should be a positive int, got 0"),
        ("max_body_bytes", -1, "max_body_bytes should be a positive int, got -1"),
        ("max_json_items", 1.5, "max_json_items should be a positive int, got 1.5"),
    ],
)
def test_server_limits_are_validated_naming_the_setting(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        ServerLimits(**{field: value})  # type: ignore[arg-type]


def test_a_full_server_evicts_slow_newcomers_before_a_served_idle_connection() -> None:
    """At max_connections, half-sent requests evict one another (the oldest first),
    and a client's kept-alive connection that was served stays usable."""
    port, stack = _serve_in_thread(ServerLimits(max_connections=8))
    with stack, socket.create_connection(("127.0.0.1", port)) as client:
        status = b"GET /weights_status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        client.sendall(status)
        client.settimeout(10)
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        socks = half_sent_requests(port, 30)
        try:
            time.sleep(0.5)
            open_ones = []
            for sock in socks:
                sock.setblocking(True)
                closed, _ = _closed_within(sock, 0.05)
                open_ones.append(not closed)
            assert sum(open_ones) <= 7  # the cap, less the served connection
            assert open_ones[-1]  # the newest are the ones kept
            client.sendall(status)  # the same kept-alive connection
            assert client.recv(4096).startswith(b"HTTP/1.1 200")
        finally:
            for sock in socks:
                sock.close()


# -- issue 32: clients without the key, compressed and chunked bodies -----------------


@contextlib.contextmanager
def flood_without_the_key(port: int, per_second: int) -> Iterator[None]:
    """A process opening `per_second` connections a second to the worker, each sending
    one request without the API key and then holding its connection idle."""
    flood = subprocess.Popen(
        [sys.executable, str(_FLOOD), str(port), str(per_second)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert read_line(flood, 30) == "flooding"
        yield
    finally:
        flood.kill()
        flood.wait()
        assert flood.stdout is not None
        flood.stdout.close()


_FLOOD = Path(__file__).with_name("_flood.py")


@uvloop_only
@pytest.mark.slow
async def test_clients_without_the_key_never_take_the_trainers_connection(
    tmp_path: Path,
) -> None:
    """300 connections a second without the API key, each idle after its 401, against
    a worker with max_connections=32: every round of the trainer completes bit-exact
    (a 401 closes its connection, a connection that never presented the key is
    evicted first, and one that did is never evicted for a newcomer), and the
    refusals are logged once per interval, not once each."""
    key = secrets.token_urlsafe(16)
    log = tmp_path / "worker.log"
    model = _models.mixed()
    with log.open("wb") as stderr:
        proc, url = start_worker(
            "_models:mixed",
            "--api-key",
            key,
            "--max-connections",
            "32",
            env=worker_env(),
            stderr=stderr,
        )
        try:
            port = int(url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as refused:
                refused.sendall(b"GET /weights_status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                closed, answer = _closed_within(refused, 10)
            assert closed and answer.startswith(b"HTTP/1.1 401 Unauthorized\r\n"), answer
            with flood_without_the_key(port, 300):
                async with HttpClient(url, api_key=key, timeout=20) as client:
                    with anyio.fail_after(60):
                        engine = await trainer_init(
                            info_for("tcp"), client=client, source=ModuleSource(model)
                        )
                        async with engine:
                            for seed in range(12):
                                _models.randomize(model, seed=seed)
                                await engine.send_weights(weight_version=f"v{seed}")
                                await assert_worker_has(client, model, f"v{seed}")
                                await anyio.sleep(0.3)  # idle, as between training steps
        finally:
            stop_worker(proc)
    refusals = [line for line in log.read_text().splitlines() if "no valid API key" in line]
    assert len(refusals) <= 2, refusals[:5]
    assert refusals[0].endswith(
        "WARNING asyncwt.server: GET /weights_status from 127.0.0.1 refused: no valid API key"
    )


async def _post_chunked(port: int, route: str, nbytes: int) -> bytes:
    """POST `nbytes` of junk to `route` in 64 KiB chunks, stopping early once the worker
    answers; its status line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        writer.write(head.encode())
        answer = asyncio.ensure_future(reader.readline())
        chunk = b"10000\r\n" + b"x" * (64 << 10) + b"\r\n"
        with contextlib.suppress(ConnectionError):
            for _ in range(nbytes // (64 << 10)):
                if answer.done():
                    break
                writer.write(chunk)
                await writer.drain()
            else:
                writer.write(b"0\r\n\r\n")
        return await answer
    finally:
        writer.close()


async def _post_gzip(url: str, route: str, payload: bytes) -> tuple[int, str]:
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession(auto_decompress=False) as session,
        session.post(url + route, data=payload, headers=headers) as response,
    ):
        return response.status, (await response.json())["error"]


@uvloop_only
@pytest.mark.slow
async def test_compressed_and_chunked_bodies_are_refused_before_they_are_held() -> None:
    """80 gzip bombs (59 KiB inflating to 60 MiB) and 20 chunked bodies of 16 MiB,
    all at once, to a route whose limit is 64 KiB: the bombs are answered 415 without
    being inflated, the chunked bodies 413 once past the limit, and the worker's
    memory stays within a few MiB of where it was."""
    bomb = gzip.compress(b"{" + b" " * (60 << 20) + b"}", 9)
    with worker_with_fd_limit(1024) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        rss_before = proc_rss(proc.pid)
        with anyio.fail_after(60):
            bombs = [_post_gzip(url, "/finish_weight_update", bomb) for _ in range(80)]
            chunked = [_post_chunked(port, "/start_weight_update", 16 << 20) for _ in range(20)]
            answers = await asyncio.gather(*bombs, *chunked)
        rss_after = proc_rss(proc.pid)
    refused = (
        "request body of /finish_weight_update has Content-Encoding 'gzip'; the worker "
        "takes only uncompressed bodies (send it without Content-Encoding)"
    )
    assert set(answers[:80]) == {(415, refused)}
    assert {status.split(b" ", 2)[1] for status in answers[80:]} == {b"413"}
    assert rss_after - rss_before < 32 << 20


@uvloop_only
async def test_a_throttled_log_writes_one_line_per_interval_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """100 refusals in a burst: the first is logged at once, the other 99 in one line
    once the interval is over, naming the latest."""
    log = ThrottledLog("%s refused: no valid API key", interval=0.2)
    with caplog.at_level(logging.WARNING, logger="asyncwt.server"):
        for index in range(100):
            log.event(f"GET /r{index}")
        await anyio.sleep(0.5)
    held = "(99 more like it in the last 0.2s, not logged one by one)"
    assert [record.getMessage() for record in caplog.records] == [
        "GET /r0 refused: no valid API key",
        f"GET /r99 refused: no valid API key {held}",
    ]
