"""The worker server: a model and a worker engine behind vLLM's weight-transfer routes.

Routes (every answer is JSON; an error is `{"error": message}`, never a stack trace):

    POST /init_weight_transfer_engine  {"init_info": {...}}          200 | 400 | 409 | 500
    POST /start_weight_update          {}                            200 | 400 | 409 | 500
    POST /update_weights               {"update_info": {...}}        200 | 400 | 409 | 500
    POST /finish_weight_update         {"weight_version": str|null}  200 | 400 | 409 | 500
    POST /shutdown_weight_transfer_engine  {}                        200 | 400 | 500
    GET  /weights_status   -> {"weight_version", "weights_incomplete", "checksum",
                               "backend", "initialized"}

400: the body cannot be read (cut short, or not in its Content-Encoding), is not a
JSON object, has unknown keys or values of the wrong type, or the engine rejected the
info (`ValueError`/`TypeError` from `parse_*_info`). 409: the call needs an
initialised transfer engine (init it first). 408: the body did not arrive within
`body_timeout`. 413: the body is larger than its route's limit (`max_body_bytes` or
`control_body_bytes`) or holds more than `max_json_items` JSON values (`ServerLimits`).
500: the engine failed (`"<ExceptionType>: message"`; the traceback
goes to the server log). An unknown route or method is a JSON 404 or 405.

`weight_version` is the version of the last round that completed (a failed round
never changes it); `weights_incomplete` is true while the model holds a mix left by
a round that failed after it started writing into the weights, until a round
completes (always false with a staged worker, whose failed rounds never reach the
model).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch
from aiohttp import web

from ._checksum import model_checksum
from ._exceptions import AsyncwtError, PlanMismatchError, StaleRoundError
from ._local_client import finish_engine_round
from ._registry import create_worker_engine
from ._server_limits import (
    DEFAULT_MAX_BODY_BYTES,
    EMPTY,
    BodyError,
    GuardedSite,
    ServerLimits,
    install,
    read_json_body,
    return_memory,
    track_requests,
)
from ._worker import WeightTransferConfig, WeightTransferEngine

__all__ = ["DEFAULT_MAX_BODY_BYTES", "ServerLimits", "build_app", "format_url", "serve"]

logger = logging.getLogger("asyncwt.server")

T = TypeVar("T")
Engine = WeightTransferEngine[Any, Any]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _ApiError(Exception):
    """An error answer: its HTTP status and the message for `{"error": ...}`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Worker:
    """The server's state: the model, its engine, and whether the engine is initialised.

    The engine is built here, when the app is built, so that a bad backend or device
    fails the server at start instead of at the trainer's first call. After
    `/shutdown_weight_transfer_engine` it is dropped; the next init builds a new one.
    """

    def __init__(self, model: torch.nn.Module, config: WeightTransferConfig, device: Any) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.engine: Engine | None = self.create_engine()
        self.initialized = False
        self.init_lock = anyio.Lock()  # one init at a time
        self._version_at_shutdown: str | None = None
        self._incomplete_at_shutdown = False

    @property
    def weights_incomplete(self) -> bool:
        """Whether a failed round left the model's weights half-updated."""
        if self.engine is None:
            return self._incomplete_at_shutdown
        return bool(getattr(self.engine, "weights_incomplete", False))

    @property
    def weight_version(self) -> str | None:
        """The engine's published version, else the one published before the last shutdown.

        The model keeps its weights across an engine shutdown, so their version holds
        until a new engine publishes one.
        """
        version: str | None = getattr(self.engine, "weight_version", None)
        return self._version_at_shutdown if version is None else version

    async def shut_down_engine(self) -> None:
        """Shut the engine down (in a thread) and drop it; the next init builds a new one.

        Takes no lock on purpose: a shutdown must reach an engine stuck in its init.
        """
        self._version_at_shutdown = self.weight_version
        self._incomplete_at_shutdown = self.weights_incomplete
        engine, self.engine, self.initialized = self.engine, None, False
        if engine is not None:
            await _in_thread(engine.shutdown)

    def create_engine(self) -> Engine:
        return create_worker_engine(self.config, model=self.model, device=self.device)

    def ready_engine(self, route: str) -> Engine:
        """The initialised engine, or a 409 saying to init first."""
        if self.engine is None or not self.initialized:
            raise _ApiError(
                409,
                f"{route} needs an initialised transfer engine: "
                "POST /init_weight_transfer_engine first",
            )
        return self.engine


async def _in_thread(fn: Callable[[], T]) -> T:
    """Run a blocking engine call in a worker thread; the loop keeps serving."""
    return await anyio.to_thread.run_sync(fn)


async def _read_body(request: web.Request, allowed: frozenset[str]) -> dict[str, Any]:
    """The request's JSON object body (an empty body is `{}`), with only `allowed` keys.

    Read and parsed within the app's `ServerLimits` (size per route, time, JSON values).
    """
    try:
        body = await read_json_body(request)
    except BodyError as exc:
        raise _ApiError(exc.status, exc.message) from None
    if body is EMPTY:
        return {}
    if not isinstance(body, dict):
        raise _ApiError(400, f"request body should be a JSON object, got a JSON {_json_kind(body)}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        expected = ", ".join(sorted(allowed)) or "none"
        raise _ApiError(400, f"unknown keys {unknown} in request body; expected keys: {expected}")
    return body


def _json_kind(value: object) -> str:
    kinds = {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "number",
        float: "number",
    }
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _object_field(body: dict[str, Any], key: str) -> dict[str, Any]:
    value = body.get(key, {})
    if not isinstance(value, dict):
        raise _ApiError(400, f"{key} should be a JSON object, got a JSON {_json_kind(value)}")
    return value


async def _parse(fn: Callable[[], T]) -> T:
    """Run an engine's `parse_*_info`; its `ValueError`/`TypeError` becomes a 400."""
    try:
        return await _in_thread(fn)
    except (ValueError, TypeError) as exc:
        raise _ApiError(400, str(exc)) from None


def _ok() -> web.Response:
    return web.json_response({"ok": True})


def _routes(worker: _Worker) -> web.RouteTableDef:
    routes = web.RouteTableDef()

    @routes.post("/init_weight_transfer_engine")
    async def init(request: web.Request) -> web.Response:
        init_info = _object_field(await _read_body(request, frozenset({"init_info"})), "init_info")
        async with worker.init_lock:
            # A second init re-initialises the same engine: that is how a new
            # trainer_init reconnects after a trainer restart.
            if worker.engine is None:
                worker.engine = await _in_thread(worker.create_engine)
            engine = worker.engine
            parsed = await _parse(functools.partial(engine.parse_init_info, init_info))
            await _in_thread(functools.partial(engine.init_transfer_engine, parsed))
            if worker.engine is not engine:
                raise _ApiError(409, "the transfer engine was shut down during its init")
            worker.initialized = True
        return _ok()

    @routes.post("/start_weight_update")
    async def start(request: web.Request) -> web.Response:
        await _read_body(request, frozenset())
        engine = worker.ready_engine("start_weight_update")
        await _in_thread(engine.start_weight_update)
        return _ok()

    @routes.post("/update_weights")
    async def update(request: web.Request) -> web.Response:
        body = await _read_body(request, frozenset({"update_info"}))
        update_info = _object_field(body, "update_info")
        engine = worker.ready_engine("update_weights")
        # Parse once up front so a bad info is a 400, not an engine failure (500).
        await _parse(functools.partial(engine.parse_update_info, update_info))
        await _in_thread(functools.partial(engine.update_weights, update_info))
        return _ok()

    @routes.post("/finish_weight_update")
    async def finish(request: web.Request) -> web.Response:
        body = await _read_body(request, frozenset({"weight_version"}))
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise _ApiError(
                400, f"weight_version should be a string or null, got a JSON {_json_kind(version)}"
            )
        engine = worker.ready_engine("finish_weight_update")
        await _in_thread(functools.partial(finish_engine_round, engine, version))
        return _ok()

    @routes.post("/shutdown_weight_transfer_engine")
    async def shutdown(request: web.Request) -> web.Response:
        await _read_body(request, frozenset())
        await worker.shut_down_engine()
        return _ok()

    @routes.get("/weights_status")
    async def status(request: web.Request) -> web.Response:
        checksum = await _in_thread(functools.partial(model_checksum, worker.model))
        return web.json_response(
            {
                "weight_version": worker.weight_version,
                "weights_incomplete": worker.weights_incomplete,
                "checksum": checksum,
                "backend": worker.config.backend,
                "initialized": worker.initialized,
            }
        )

    return routes


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON `{"error": ...}` answer without a stack trace."""
    try:
        return await handler(request)
    except _ApiError as exc:
        return web.json_response({"error": exc.message}, status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return web.json_response({"error": exc.reason}, status=exc.status, headers=allow)
    except (PlanMismatchError, StaleRoundError) as exc:
        # The request disagrees with the worker's state (its model, its last round).
        logger.warning(
            "%s %s refused: %s: %s", request.method, request.path, type(exc).__name__, exc
        )
        return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=409)
    except AsyncwtError as exc:
        # An expected failure of a round (aborted, timed out, apply failed): one line.
        logger.warning(
            "%s %s failed: %s: %s", request.method, request.path, type(exc).__name__, exc
        )
        return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)
    except Exception as exc:
        # Anything else is a bug: answered the same way, with the traceback in the log.
        logger.exception("%s %s failed", request.method, request.path)
        return web.json_response({"error": f"{type(exc).__name__}: {exc}"}, status=500)


def build_app(
    model: torch.nn.Module,
    *,
    config: WeightTransferConfig,
    device: torch.device | str | None = None,
    max_body_bytes: int | None = None,
    limits: ServerLimits | None = None,
) -> web.Application:
    """The aiohttp application serving `model` through the engine `config` names.

    The engine is built now (`create_worker_engine(config, model=model, device=device)`),
    so an unknown backend raises `ValueError` here. Every engine call runs in a worker
    thread: `update_weights` blocks for a whole round and the loop must keep serving.
    On app shutdown the engine is shut down first, which lets a round still receiving
    fail out instead of holding the server open.

    Requests are bounded by `limits` (see `ServerLimits`): a body larger than its
    route's limit (`max_body_bytes`, which the argument of that name overrides, or
    `control_body_bytes`) or holding more than `max_json_items` JSON values is
    refused with a JSON 413 before it is parsed; one slower than `body_timeout` is a
    408. The connection limits apply where the app is served by `serve`.
    """
    limits = limits or ServerLimits()
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
    worker = _Worker(model, config, device)
    app = web.Application(
        middlewares=[track_requests, return_memory, _json_errors],
        client_max_size=max(limits.max_body_bytes, limits.control_body_bytes),
    )
    install(app, limits)
    app.add_routes(_routes(worker))

    async def on_shutdown(app: web.Application) -> None:
        await worker.shut_down_engine()

    app.on_shutdown.append(on_shutdown)
    return app


def format_url(host: str, port: int) -> str:
    """`http://host:port`, with brackets around an IPv6 host."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve(
    model: torch.nn.Module,
    *,
    config: WeightTransferConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    device: torch.device | str | None = None,
    ready: Callable[[str, int], object] | None = None,
    shutdown_timeout: float = 5.0,
    limits: ServerLimits | None = None,
) -> None:
    """Serve `model` (see `build_app`) on `host:port` until cancelled.

    Binds 127.0.0.1 by default: the routes are unauthenticated, so expose them
    beyond the host only on a trusted network. `port=0` picks a free port; `ready`
    is called with the bound host and port once the server accepts connections.

    `limits` bounds every client (see `ServerLimits`): a connection that does not
    send its request's headers within `header_timeout`, or its body within
    `body_timeout`, is cut off, and at most `max_connections` are open at once.

    Cancellation: stops accepting, shuts the engine down, waits up to
    `shutdown_timeout` seconds for requests in flight, then returns by re-raising.
    """
    limits = limits or ServerLimits()
    app = build_app(model, config=config, device=device, limits=limits)
    runner = web.AppRunner(
        app,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=limits.keepalive_timeout,
        lingering_time=min(1.0, limits.body_timeout),  # an unread body is not waited for
    )
    await runner.setup()
    try:
        site = GuardedSite(runner, host, port)
        await site.start()
        bound_host, bound_port = runner.addresses[0][:2]
        if ready is not None:
            ready(bound_host, bound_port)
        await anyio.sleep_forever()
    finally:
        with anyio.CancelScope(shield=True):
            await runner.cleanup()
