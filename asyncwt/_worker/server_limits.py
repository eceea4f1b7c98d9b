"""The worker server's defences against slow, idle and oversized clients.

- `ServerLimits`: every bound, validated, with its default.
- `GuardedSite`: an aiohttp site whose connections are counted and timed. A new
  connection has `header_timeout` seconds to deliver its first request's headers
  (aiohttp's own `keepalive_timeout` bounds the idle time between later requests).
  At most `max_connections` are open: past that, a newcomer evicts the connection
  that has waited longest for a request's headers (a slow or idle client), one that
  never presented the API key first; it is itself refused only when every open
  connection is busy with a request or, on a server with an API key, trusted.
- `read_json_body`: refuses a compressed body (415) before inflating any of it, reads
  the body with the route's size limit (counted while it arrives, chunked or not)
  and `body_timeout`, refuses a body whose JSON would build more than
  `max_json_items` values before parsing it (a count of `[`, `{` and `,`, which
  bounds the values json builds), and parses a large body in a worker thread, one
  at a time. The body stays cached on the request (as `request.read()` leaves
  it), for middlewares that read it after the handler.
- `return_memory`: a middleware that gives freed heap back to the system after a
  large request (glibc keeps it otherwise).
- `ThrottledLog`: one log line per interval for a refusal a client can repeat at
  will (a request without the API key), with the count of those it held back.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import ctypes
import ctypes.util
import functools
import json
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
from aiohttp import hdrs, web

from .._core.validate import check_positive, check_timeout

__all__ = [
    "BODY_LIMITS",
    "DEFAULT_MAX_BODY_BYTES",
    "EMPTY",
    "LIMITS_KEY",
    "BodyError",
    "GuardedSite",
    "ServerLimits",
    "ThrottledLog",
    "install",
    "read_json_body",
    "return_memory",
    "track_requests",
    "trust_connection",
]

logger = logging.getLogger("asyncwt.server")

DEFAULT_MAX_BODY_BYTES = 64 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerLimits:
    """Bounds on what a client may cost the worker server."""

    header_timeout: float = 10.0
    """Seconds a new connection has to send its first request's headers; a slower
    (or silent) one is cut off."""
    keepalive_timeout: float = 75.0
    """Seconds a connection may stay idle between requests, which also bounds how
    long a kept-alive connection may take over its next request's headers (aiohttp's
    `keepalive_timeout`). Keep it above the clients' own idle limit (15 s for
    aiohttp's client) so that the client, not the server, closes an idle connection."""
    body_timeout: float = 30.0
    """Seconds to read one request's body, once its headers arrived: a slower body is
    answered 408 and its connection closed."""
    max_connections: int | None = None
    """Connections open at once; `None` is half the process's file descriptor limit
    (`ulimit -n`), at most 1024, leaving room for the data plane. Past it, a new
    connection evicts the one that has waited longest on its client (for a request's
    headers or body), one that never presented the API key (or, without a key, never
    completed a request) first; on a server with an API key a connection that
    presented it is never evicted for a newcomer. When no connection can be evicted,
    the newcomer is refused."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    """Largest body of `init_weight_transfer_engine` and `update_weights`, which
    carry the trainer's plan (a name, dtype and shape per parameter: a few MiB for
    the largest models) or a backend's per-parameter lists."""
    control_body_bytes: int = 64 << 10
    """Largest body of every other route (`{}`, or a weight version).

    Both limits count the bytes as they arrive, chunked or not; a body with a
    `Content-Encoding` (gzip, deflate, ...) is refused (415) before any of it is
    inflated: no asyncwt client compresses, and a small compressed body can inflate
    a thousandfold."""
    max_json_items: int = 2_000_000
    """Most JSON values (counting the `[`, `{` and `,` of the body) a body may hold,
    checked before it is parsed: bounds the memory and time the parse takes (the
    plan costs about 5 per parameter)."""

    def __post_init__(self) -> None:
        for name in ("header_timeout", "keepalive_timeout", "body_timeout"):
            check_timeout(name, getattr(self, name))
        for name in ("max_body_bytes", "control_body_bytes", "max_json_items"):
            check_positive(name, getattr(self, name))
        if self.max_connections is not None:
            check_positive("max_connections", self.max_connections)

    def connection_cap(self) -> int:
        """`max_connections`, or its default for this process's descriptor limit."""
        if self.max_connections is not None:
            return self.max_connections
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return 1024
        return max(1, min(1024, soft // 2))

    def body_limit(self, path: str) -> tuple[str, int]:
        """The setting that bounds a body sent to `path`, and its value."""
        if path in BODY_LIMITS:
            return "max_body_bytes", self.max_body_bytes
        return "control_body_bytes", self.control_body_bytes


BODY_LIMITS = frozenset({"/init_weight_transfer_engine", "/update_weights"})
"""Routes whose bodies are bounded by `max_body_bytes`; all others by `control_body_bytes`."""

LIMITS_KEY = web.AppKey("asyncwt_limits", ServerLimits)

_INLINE_PARSE_BYTES = 64 << 10
"""Bodies up to this size are parsed on the loop (faster than a thread hop)."""
_TRIM_AFTER_BYTES = 1 << 20
"""A request whose body was at least this large returns freed memory afterwards."""
_large_body: contextvars.ContextVar[list[bool]] = contextvars.ContextVar("asyncwt_large_body")
"""Set by `return_memory` for the request its task handles; `read_json_body` marks it."""
_parse_limiter: anyio.CapacityLimiter | None = None


EMPTY: Any = object()
"""What `read_json_body` returns for a body of nothing but whitespace."""


class BodyError(Exception):
    """A body refused before it reached a route: the status and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_json_body(request: web.Request) -> Any:
    """The request's body as parsed JSON (`EMPTY` for an empty body).

    Raises `BodyError` (415, 413, 408, 400) naming what refused it.
    """
    limits = request.app[LIMITS_KEY]
    setting, limit = limits.body_limit(request.path)
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BodyError(
            413,
            f"request body of {request.path} is {declared} bytes, larger than {setting}={limit}",
        )
    encoding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BodyError(
            415,
            f"request body of {request.path} has Content-Encoding {encoding!r}; the worker "
            f"takes only uncompressed bodies (send it without Content-Encoding)",
        )
    guard = request.app.get(GUARD_KEY)
    if guard is not None:
        guard.reading(request.transport)
    try:
        with anyio.fail_after(limits.body_timeout):
            raw = await _read_at_most(request, limit)
    except TimeoutError:
        raise BodyError(
            408,
            f"request body of {request.path} did not arrive within "
            f"body_timeout={limits.body_timeout}s ({request.content.total_bytes} bytes came)",
        ) from None
    except web.RequestPayloadError as exc:  # e.g. bad chunking
        reason = getattr(exc.__cause__, "message", None) or " ".join(str(exc).split())
        raise BodyError(400, f"request body could not be read: {reason}") from None
    except ConnectionError:  # the client left mid-body: its doing, not the server's
        raise BodyError(400, "request body was cut short: the connection closed") from None
    finally:
        if guard is not None:
            guard.busy(request.transport)
    if raw is None:
        raise BodyError(
            413,
            f"request body of {request.path} is larger than {setting}={limit} bytes "
            f"({request.content.total_bytes} bytes came before it was refused)",
        )
    items = raw.count(b"[") + raw.count(b"{") + raw.count(b",")
    if items > limits.max_json_items:
        raise BodyError(
            413,
            f"request body of {request.path} holds about {items} JSON values, more than "
            f"max_json_items={limits.max_json_items}",
        )
    if not raw.strip():
        return EMPTY
    if len(raw) <= _INLINE_PARSE_BYTES:
        return _loads(raw)
    marker = _large_body.get(None)
    if marker is not None and len(raw) >= _TRIM_AFTER_BYTES:
        marker.append(True)
    global _parse_limiter
    if _parse_limiter is None:
        _parse_limiter = anyio.CapacityLimiter(1)  # one large parse at a time: bounded memory
    return await anyio.to_thread.run_sync(_loads, raw, limiter=_parse_limiter)


async def _read_at_most(request: web.Request, limit: int) -> bytes | None:
    """The request's body, or None as soon as more than `limit` bytes arrived (the
    rest is not read: a chunked body past its limit is never held whole).

    aiohttp's `request.read()` bounds a body only by the app's `client_max_size`
    (the largest route's limit), hence this loop. The body it returns is left in
    aiohttp's cache, so that a middleware may still `await request.json()` after
    the handler (as `examples/rollout_worker.py` does).
    """
    body = bytearray()
    while True:
        chunk = await request.content.readany()
        if not chunk:
            raw = request._read_bytes = bytes(body)
            return raw
        body += chunk
        if len(body) > limit:
            return None


def _loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise BodyError(400, f"request body should be a JSON object: {exc}") from None
    except RecursionError:
        raise BodyError(
            400, "request body should be a JSON object: it is nested too deeply"
        ) from None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


@web.middleware
async def return_memory(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """After a request with a large body, give the freed heap back to the system."""
    marker: list[bool] = []
    token = _large_body.set(marker)
    try:
        return await handler(request)
    finally:
        _large_body.reset(token)
        trim = _malloc_trim()
        if marker and trim is not None:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(trim, 0)


class ThrottledLog:
    """Logs a repeated event at most once per `interval` seconds, with the count of
    those it held back: a refusal any client can provoke at will costs one line per
    interval, not one per request.
    """

    def __init__(self, message: str, *, interval: float = 10.0) -> None:
        self.message = message
        """Logged at WARNING with `%s` filled by the latest event's detail."""
        self.interval = interval
        self._last = -float("inf")
        self._held = 0
        self._latest = ""
        self._flush: asyncio.TimerHandle | None = None

    def event(self, detail: str) -> None:
        """One occurrence; `detail` says which (a method and path, a peer)."""
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            logger.warning(self.message, detail)
            return
        self._held += 1
        self._latest = detail
        if self._flush is None:
            delay = self._last + self.interval - now
            self._flush = asyncio.get_running_loop().call_later(delay, self._report)

    def _report(self) -> None:
        """The count held back over the interval, in one line (with the latest detail)."""
        held, self._held, self._flush = self._held, 0, None
        self._last = time.monotonic()
        logger.warning(
            "%s (%d more like it in the last %gs, not logged one by one)",
            self.message % self._latest,
            held,
            self.interval,
        )


# -- connections ------------------------------------------------------------------------


class _ConnectionGuard:
    """Counts the server's connections and cuts off the slow and the idle.

    A connection is *waiting* while it waits on its client: for a (next) request's
    headers, from its start and again once a request's handler returned, and for a
    request's body. Waiting ones are kept oldest first. A connection is *trusted*
    once it presented the API key (`trust`), or, on a server without one
    (`keyed=False`), once it completed a request. A new connection past
    `max_connections` evicts the oldest waiting one that is not trusted; failing
    that, on a server without a key, the oldest waiting one. A trusted connection
    of a server with a key is never evicted for a newcomer: a client without the
    key cannot take the trainer's place.
    """

    def __init__(self, limits: ServerLimits, *, keyed: bool = False) -> None:
        self.limits = limits
        self.keyed = keyed
        self.cap = limits.connection_cap()
        self.live: set[asyncio.BaseTransport] = set()
        self.waiting: dict[asyncio.BaseTransport, asyncio.TimerHandle | None] = {}
        self.trusted: set[asyncio.BaseTransport] = set()
        """Connections evicted only after the others (never, on a server with a key)."""
        self._refusals = ThrottledLog("refused a connection: %s")

    def opened(self, transport: asyncio.BaseTransport) -> bool:
        """Admit `transport` (evicting a waiting one if full), or refuse it."""
        self.live.add(transport)
        if len(self.live) > self.cap:
            victim = self._victim()
            if victim is None:
                self._refusals.event(f"max_connections={self.cap} are all busy or trusted")
                self.live.discard(transport)
                _abort(transport)
                return False
            self.drop(victim)
            _abort(victim)
        loop = asyncio.get_running_loop()
        deadline = loop.call_later(self.limits.header_timeout, self._expire, transport)
        self.waiting[transport] = deadline
        return True

    def _victim(self) -> asyncio.BaseTransport | None:
        """The connection to evict: the longest-waiting one that is not trusted (a
        slowloris, a client without the key), else, without a key, the
        longest-waiting one; never one whose response is still being written."""
        candidates = [t for t in self.waiting if _write_buffer_empty(t)]
        fresh = (t for t in candidates if t not in self.trusted)
        fallback = candidates[0] if candidates and not self.keyed else None
        return next(fresh, fallback)

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        if self.waiting.get(transport) is not None:
            self.drop(transport)
            _abort(transport)

    def busy(self, transport: asyncio.BaseTransport | None) -> None:
        """A request's headers arrived on `transport`."""
        handle = self.waiting.pop(transport, None)  # type: ignore[arg-type]
        if handle is not None:
            handle.cancel()

    def trust(self, transport: asyncio.BaseTransport | None) -> None:
        """`transport` presented the API key."""
        if transport is not None and transport in self.live:
            self.trusted.add(transport)

    def reading(self, transport: asyncio.BaseTransport | None) -> None:
        """`transport` is sending a request's body: waiting on its client, the newest
        to be evicted (`body_timeout` bounds how long)."""
        if transport is not None and transport in self.live:
            self.waiting.pop(transport, None)
            self.waiting[transport] = None

    def idle(self, transport: asyncio.BaseTransport | None) -> None:
        """`transport` finished a request: it waits for the next (aiohttp's keep-alive
        timeout bounds how long), and is the newest to be evicted."""
        if transport is not None and transport in self.live:
            self.waiting.pop(transport, None)
            self.waiting[transport] = None
            if not self.keyed:
                self.trusted.add(transport)

    def drop(self, transport: asyncio.BaseTransport) -> None:
        self.busy(transport)
        self.live.discard(transport)
        self.trusted.discard(transport)


def _write_buffer_empty(transport: asyncio.BaseTransport) -> bool:
    size = getattr(transport, "get_write_buffer_size", None)
    return size is None or size() == 0


def _abort(transport: asyncio.BaseTransport) -> None:
    with contextlib.suppress(Exception):
        transport.abort()  # type: ignore[attr-defined]


class _GuardedProtocol(asyncio.Protocol):
    """Passes everything to aiohttp's protocol once the guard admitted the connection."""

    def __init__(self, guard: _ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.admitted = False
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.guard.opened(transport):
            self.admitted = True
            self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.guard.drop(self.transport)
        if self.admitted:
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.admitted:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.admitted else None

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()


GUARD_KEY = web.AppKey("asyncwt_connection_guard", _ConnectionGuard)


@web.middleware
async def track_requests(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Tell the connection guard when a request is being handled (not evictable)."""
    guard = request.app.get(GUARD_KEY)
    if guard is None:  # served by a plain aiohttp site
        return await handler(request)
    guard.busy(request.transport)
    try:
        return await handler(request)
    finally:
        guard.idle(request.transport)


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through the app's `_ConnectionGuard`."""

    __slots__ = ("_guard", "_host", "_port")

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, backlog: int = 128) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._guard = runner.app[GUARD_KEY]

    @property
    def name(self) -> str:
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        guard = self._guard

        def protocol() -> asyncio.Protocol:
            return _GuardedProtocol(guard, server())

        self._server = await loop.create_server(
            protocol, self._host, self._port, backlog=self._backlog
        )


def install(app: web.Application, limits: ServerLimits, *, keyed: bool = False) -> None:
    """Give `app` its limits and a connection guard (used by `GuardedSite`); `keyed`:
    the app requires an API key, whose middleware calls `trust_connection`."""
    app[LIMITS_KEY] = limits
    app[GUARD_KEY] = _ConnectionGuard(limits, keyed=keyed)


def trust_connection(request: web.Request) -> None:
    """`request` presented the API key: its connection is never evicted for a newcomer."""
    guard = request.app.get(GUARD_KEY)
    if guard is not None:
        guard.trust(request.transport)
