"""The worker server: a model and a worker engine behind vLLM's weight-transfer routes.

Routes (every answer is JSON; an error is `{"error": message}`, never a stack trace):

    POST /init_weight_transfer_engine  {"init_info": {...}}                  200 | 400 | 409 | 500
    POST /start_weight_update          {"round_id"?, "trainer_id"?}          200 | 400 | 409 | 500
    POST /update_weights               {"update_info": {...}}                200 | 400 | 409 | 500
    POST /finish_weight_update         {"weight_version": str|null,
                                        "round_id"?, "trainer_id"?}          200 | 400 | 409 | 500
    POST /shutdown_weight_transfer_engine  {}                                200 | 400 | 500
    GET  /weights_status[?checksum=1]  -> {"weight_version", "weights_incomplete",
                               "checksum", "backend", "initialized",
                               "untouched_params"}
    GET  /metrics          -> Prometheus text format (see `metrics.py`)

`GET /weights_status` is cheap (a health probe, a poll); its `checksum` is null
unless the query asks for it with `?checksum=1`, which hashes every weight.

Rounds follow `RoundState` (see `_rounds.py`): a version is published only by the
finish that closes the round its start opened, once every update and the drain of
that round succeeded. The optional `round_id` and `trainer_id` (the trainer engine
sends them) tie start and finish to the round and trainer the update infos name.

With an API key (`build_app(api_key=...)`, `asyncwt worker --api-key`) every
request must carry `Authorization: Bearer <key>`, else it is answered 401 and its
connection closed.

400: the body cannot be read (cut short, or badly chunked), is not a
JSON object, has unknown keys or values of the wrong type, or the engine rejected the
info (`ValueError`/`TypeError` from `parse_*_info`). 409: the call needs an
initialised transfer engine (init it first), or the round state refuses it
(`RoundConflictError`: out of order, for another round, from another trainer), or
the engine does (`PlanMismatchError`, `StaleRoundError`). 408: the body did not
arrive within `body_timeout`. 413: the body is larger than its route's limit
(`max_body_bytes` or `control_body_bytes`, counted as it arrives) or holds more than
`max_json_items` JSON values (`ServerLimits`). 415: the body has a `Content-Encoding`
(refused before it is inflated). 500: the engine failed (`"<ExceptionType>: message"`; the traceback
goes to the server log). An unknown route or method is a JSON 404 or 405.

`weight_version` is the version of the last round that completed (a failed round
never changes it); `weights_incomplete` is true while the model holds a mix left by
a round that failed after it started writing into the weights, until a round
completes (always false with a staged worker, whose failed rounds never reach the
model).
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch
from aiohttp import web

from .._core.errors import AsyncwtError, PlanMismatchError, RoundConflictError, StaleRoundError
from .._core.registry import create_worker_engine
from .._core.settings import API_KEY_ENV, MAX_ROUND_ID, MAX_TRAINER_ID_CHARS
from .._core.worker_api import WeightTransferConfig, WeightTransferEngine
from .metrics import CONTENT_TYPE, WorkerMetrics
from .round_driver import InvalidInfoError, RoundDriver, weights_status
from .server_limits import (
    DEFAULT_MAX_BODY_BYTES,
    EMPTY,
    BodyError,
    GuardedSite,
    ServerLimits,
    ThrottledLog,
    install,
    read_json_body,
    return_memory,
    track_requests,
    trust_connection,
)

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_MAX_BODY_BYTES",
    "ServerLimits",
    "build_app",
    "check_api_key",
    "format_url",
    "is_loopback",
    "serve",
]

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


def _ok() -> web.Response:
    return web.json_response({"ok": True})


def _round_field(body: dict[str, Any]) -> int | None:
    value = body.get("round_id")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_ROUND_ID:
        raise _ApiError(
            400, f"round_id should be an integer in [1, {MAX_ROUND_ID}] or null, got {value!r}"
        )
    return value


def _trainer_field(body: dict[str, Any]) -> str | None:
    value = body.get("trainer_id")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_TRAINER_ID_CHARS:
        raise _ApiError(
            400,
            f"trainer_id should be a string of 1-{MAX_TRAINER_ID_CHARS} characters or null, "
            f"got a JSON {_json_kind(value)}",
        )
    return value


_ROUND_KEYS = frozenset({"round_id", "trainer_id"})


def _flag(request: web.Request, name: str) -> bool:
    """A yes/no query parameter: `1`/`true` or `0`/`false`, absent meaning no."""
    value = request.query.get(name, "0").lower()
    if value not in ("0", "1", "true", "false"):
        raise _ApiError(400, f"?{name}= should be 1, true, 0 or false, got {value!r}")
    return value in ("1", "true")


def _routes(
    worker: RoundDriver, model: torch.nn.Module, config: WeightTransferConfig
) -> web.RouteTableDef:
    routes = web.RouteTableDef()

    @routes.post("/init_weight_transfer_engine")
    async def init(request: web.Request) -> web.Response:
        init_info = _object_field(await _read_body(request, frozenset({"init_info"})), "init_info")
        # A second init re-initialises the same engine: that is how a new
        # trainer_init reconnects after a trainer restart.
        await worker.init(init_info)
        return _ok()

    @routes.post("/start_weight_update")
    async def start(request: web.Request) -> web.Response:
        body = await _read_body(request, _ROUND_KEYS)
        await worker.start(round_id=_round_field(body), trainer_id=_trainer_field(body))
        return _ok()

    @routes.post("/update_weights")
    async def update(request: web.Request) -> web.Response:
        body = await _read_body(request, frozenset({"update_info"}))
        await worker.update(_object_field(body, "update_info"))
        return _ok()

    @routes.post("/finish_weight_update")
    async def finish(request: web.Request) -> web.Response:
        body = await _read_body(request, frozenset({"weight_version"}) | _ROUND_KEYS)
        version = body.get("weight_version")
        if version is not None and not isinstance(version, str):
            raise _ApiError(
                400, f"weight_version should be a string or null, got a JSON {_json_kind(version)}"
            )
        await worker.finish(version, round_id=_round_field(body), trainer_id=_trainer_field(body))
        return _ok()

    @routes.post("/shutdown_weight_transfer_engine")
    async def shutdown(request: web.Request) -> web.Response:
        await _read_body(request, frozenset())
        await worker.shutdown(drop=True)
        return _ok()

    @routes.get("/weights_status")
    async def status(request: web.Request) -> web.Response:
        checksum = _flag(request, "checksum")
        return web.json_response(
            await weights_status(worker, model, config.backend, checksum=checksum)
        )

    @routes.get("/metrics")
    async def metrics(request: web.Request) -> web.Response:
        if worker.metrics is None:  # a driver built without metrics
            raise web.HTTPNotFound()
        body = worker.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    return routes


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn every failure into a JSON `{"error": ...}` answer without a stack trace."""
    try:
        return await handler(request)
    except _ApiError as exc:
        return web.json_response({"error": exc.message}, status=exc.status)
    except InvalidInfoError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
        return web.json_response({"error": exc.reason}, status=exc.status, headers=allow)
    except RoundConflictError as exc:
        # Out of order, for another round, or from another trainer: nothing changed.
        logger.warning("%s %s refused: %s", request.method, request.path, exc)
        return web.json_response({"error": str(exc)}, status=409)
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


def _auth_middleware(
    api_key: str,
) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    """Every request, the status route and unknown routes included, must carry
    `Authorization: Bearer <api_key>`; compared in constant time. Else a JSON 401,
    and the connection is closed: a client without the key holds no slot (see
    `ServerLimits.max_connections`). Refusals are logged once per 10 s with a count."""
    expected = api_key.encode()
    refusals = ThrottledLog("%s refused: no valid API key")

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            given.strip().encode(errors="replace"), expected
        ):
            peer = request.remote or "unknown peer"
            refusals.event(f"{request.method} {request.path} from {peer}")
            refused = web.json_response(
                {
                    "error": "this worker requires an API key: send 'Authorization: Bearer "
                    "<key>' with the key the worker was started with (--api-key or "
                    f"{API_KEY_ENV}); HttpClient(..., api_key=KEY) does"
                },
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
            refused.force_close()
            return refused
        trust_connection(request)
        return await handler(request)

    return authenticate


def is_loopback(host: str) -> bool:
    """Whether `host` names only loopback addresses (`127.0.0.1`, `::1`, `localhost`)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(
        ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos
    )


def check_api_key(api_key: str | None, host: str) -> str | None:
    """The API key to require (None: none), or a `ValueError` for a key that cannot be
    used, or for a `host` beyond loopback with no key: its routes would be open to
    every host that reaches it."""
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError(f"api_key should be a non-empty str or None, got {api_key!r}")
    if api_key is not None and (api_key != api_key.strip() or not api_key.isprintable()):
        raise ValueError("api_key should be printable, without leading or trailing spaces")
    if api_key is None and not is_loopback(host):
        raise ValueError(
            f"refusing to serve on {host!r} without an API key: beyond loopback anyone who "
            f"reaches the port could re-init the worker and push weights. Pass --api-key KEY "
            f"or set {API_KEY_ENV} (serve(api_key=...)), and give the trainer "
            f"HttpClient(..., api_key=KEY)"
        )
    return api_key


def build_app(
    model: torch.nn.Module,
    *,
    config: WeightTransferConfig,
    device: torch.device | str | None = None,
    max_body_bytes: int | None = None,
    limits: ServerLimits | None = None,
    api_key: str | None = None,
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
    408. The connection limits apply where the app is served by `serve`. With an
    `api_key`, every request (`GET /weights_status` too) must carry
    `Authorization: Bearer <api_key>`, else it is answered 401.
    """
    key = check_api_key(api_key, "127.0.0.1")
    limits = limits or ServerLimits()
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)

    def create() -> Engine:
        return create_worker_engine(config, model=model, device=device)

    worker = RoundDriver(create(), create=create, metrics=WorkerMetrics())
    middlewares: list[Any] = [track_requests, return_memory, _json_errors]
    if key is not None:
        middlewares.append(_auth_middleware(key))
    app = web.Application(
        middlewares=middlewares,
        client_max_size=max(limits.max_body_bytes, limits.control_body_bytes),
    )
    install(app, limits, keyed=key is not None)
    app.add_routes(_routes(worker, model, config))

    async def on_shutdown(app: web.Application) -> None:
        await worker.shutdown(drop=True)

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
    api_key: str | None = None,
) -> None:
    """Serve `model` (see `build_app`) on `host:port` until cancelled.

    Binds 127.0.0.1 by default. With `api_key` every request must carry
    `Authorization: Bearer <api_key>` (else 401); a `host` beyond loopback without
    one is a `ValueError`, raised before anything is bound. `port=0` picks a free
    port; `ready` is called with the bound host and port once the server accepts
    connections.

    `limits` bounds every client (see `ServerLimits`): a connection that does not
    send its request's headers within `header_timeout`, or its body within
    `body_timeout`, is cut off, and at most `max_connections` are open at once.

    Cancellation: stops accepting, shuts the engine down, waits up to
    `shutdown_timeout` seconds for requests in flight, then returns by re-raising.
    """
    check_api_key(api_key, host)
    limits = limits or ServerLimits()
    app = build_app(model, config=config, device=device, limits=limits, api_key=api_key)
    runner = web.AppRunner(
        app,
        shutdown_timeout=shutdown_timeout,
        keepalive_timeout=limits.keepalive_timeout,
        lingering_time=min(1.0, limits.body_timeout),  # an unread body is not waited for
        auto_decompress=False,  # a compressed body is refused (415), never inflated
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
