"""An async control-plane client speaking vLLM's weight-transfer HTTP routes."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import aiohttp
import anyio
from typing_extensions import Self

from .._core.concurrency import fan_out, single_error
from .._core.errors import ControlPlaneError
from .._core.protocol import WeightTransferUpdatePayload
from .._core.settings import API_KEY_ENV
from .._core.validate import check_timeout
from .pause import PauseMode, RoundPause

__all__ = ["HttpClient"]

_MAX_ERROR_CHARS = 500
_HEALTH_EVERY_S = 2.0
"""While `update_weights` waits, each server's `GET /health` is asked this often."""
_KEEPALIVE_S = 2.0
"""Idle connections are dropped after this long, before the server drops them: vLLM's
server (uvicorn) closes idle connections after 5 s, and a request sent on a connection
the server is closing fails. Rounds further apart than this open a new connection."""


class HttpClient:
    """An `AsyncWeightSyncClient` over one or more workers' HTTP servers.

    Speaks vLLM's routes (`POST /init_weight_transfer_engine {"init_info"}`,
    `/start_weight_update`, `/update_weights {"update_info"}`,
    `/finish_weight_update {"weight_version"}`, `/shutdown_weight_transfer_engine`),
    so the same trainer code drives an `asyncwt worker` or a vLLM server. With several
    base URLs each call goes to all of them concurrently (see `fan_out`): a worker's
    `update_weights` answers only once it received the whole round.

    One `aiohttp.ClientSession`, created on first use inside the running loop; close
    it with `await client.close()` or `async with HttpClient(...)`.

    Args:
        base_urls: `http://host:port` of each worker (a trailing `/` is ignored).
        timeout: seconds a single call may take in all; `update_weights` lasts a
            whole round, so keep it generous.
        api_key: the workers' API key (`asyncwt worker --api-key`), sent with every
            request as `Authorization: Bearer <api_key>`; None reads it from
            `$ASYNCWT_API_KEY`, as the worker does, and sends none where that is unset
            or empty.
        pause: vLLM servers only: pause generation around each round with
            `POST /pause?mode=<pause>&clear_cache=true` before `start_weight_update`,
            and `POST /resume` after `finish_weight_update` or as soon as the round
            failed (see `asyncwt._control.pause`). `"keep"`: requests in flight
            continue after the round, on the new weights; `"wait"`: the round waits
            for them to finish on the old ones; `"abort"`: they are aborted. None
            (the default) pauses nothing: asyncwt's vLLM plugin reloads the weights
            inside one engine call and then recomputes the requests in flight on the
            new weights, so a round is safe while requests stream.

    Raises:
        ControlPlaneError: from every call, when a worker answers non-2xx (the
            message names the URL, route, status and the worker's error) or cannot be
            reached.
    """

    def __init__(
        self,
        base_urls: str | Sequence[str],
        *,
        timeout: float = 300.0,
        api_key: str | None = None,
        pause: PauseMode | None = None,
    ) -> None:
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        if not urls:
            raise ValueError("base_urls should name at least one worker URL, got none")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"base_urls should be http(s):// URLs, got {url!r}")
        check_timeout("timeout", timeout)
        if api_key is None:
            api_key = os.environ.get(API_KEY_ENV) or None
        if api_key is not None and (
            not isinstance(api_key, str) or not api_key or not api_key.isprintable()
        ):
            raise ValueError(
                f"api_key (or ${API_KEY_ENV}) should be a non-empty printable str or None"
            )
        self.base_urls: tuple[str, ...] = tuple(url.rstrip("/") for url in urls)
        self.timeout = timeout
        self._api_key = api_key
        self._headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
        self._session: aiohttp.ClientSession | None = None
        self._pause = RoundPause(pause, self._pause_all, self._resume_all)

    @property
    def pause(self) -> PauseMode | None:
        """The pause mode around each round (None: no pause)."""
        return self._pause.mode

    @property
    def paused_s(self) -> float | None:
        """Seconds generation was paused in the last round (None without `pause`)."""
        return self._pause.paused_s

    def split(self) -> list[HttpClient]:
        """One client per base URL, with this one's settings: to address the workers
        one by one (a trainer that drops or adds workers). Close each when done."""
        return [
            HttpClient(url, timeout=self.timeout, api_key=self._api_key, pause=self.pause)
            for url in self.base_urls
        ]

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers=self._headers,
                connector=aiohttp.TCPConnector(keepalive_timeout=_KEEPALIVE_S),
            )
        return self._session

    async def _request(self, method: str, base_url: str, route: str, body: Any) -> Any:
        """One call to one worker: the decoded JSON answer (None if not JSON)."""
        url = base_url + route
        try:
            async with self._get_session().request(method, url, json=body) as response:
                if response.status // 100 != 2:
                    detail = await _error_detail(response)
                    raise ControlPlaneError(
                        f"{method} {route} to {base_url} failed with HTTP {response.status}: "
                        f"{detail}"
                    )
                if response.content_type != "application/json":
                    return None
                return await response.json()
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            reason = str(exc) or f"no answer within {self.timeout} s"
            raise ControlPlaneError(
                f"{method} {route} to {base_url} failed: {type(exc).__name__}: {reason}"
            ) from exc

    async def _post_all(self, route: str, body: dict[str, Any]) -> None:
        await fan_out(
            [functools.partial(self._request, "POST", url, route, body) for url in self.base_urls]
        )

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """POST `/init_weight_transfer_engine` to every worker.

        Cancellation: the requests are abandoned; a worker may still complete its init.
        """
        await self._post_all("/init_weight_transfer_engine", {"init_info": init_info})

    async def start_weight_update(
        self, *, round_id: int | None = None, trainer_id: str | None = None
    ) -> None:
        """POST `/start_weight_update` to every worker.

        `round_id` and `trainer_id` (optional; the trainer engine sends them) name the
        round: a worker then refuses updates and finishes of any other round.

        Cancellation: the requests are abandoned; a worker may still start the round.
        """
        await self._pause.begin()
        try:
            await self._post_all("/start_weight_update", _round_body(round_id, trainer_id))
        except BaseException:
            await self._pause.end_quietly()
            raise

    async def update_weights(self, update_info: WeightTransferUpdatePayload) -> None:
        """POST `/update_weights` to every worker; returns when all received the round.

        While it waits, each server's `GET /health` is asked every 2 s: a 500 or 503
        (vLLM's answer once its engine died) or a refused connection fails the call with
        `ControlPlaneError` at once, instead of after `timeout`.

        Cancellation: the requests are abandoned; each worker keeps receiving until
        its transport finishes or aborts, so the sender must abort the round.
        """
        try:
            await fan_out(
                [
                    functools.partial(self._update_watched, url, update_info)
                    for url in self.base_urls
                ]
            )
        except BaseException:
            await self._pause.end_quietly()
            raise

    async def _update_watched(
        self, base_url: str, update_info: WeightTransferUpdatePayload
    ) -> None:
        """`POST /update_weights` to one server, failed as soon as its `/health` says it died.

        A vLLM server whose engine core died keeps its HTTP server up, and the call in
        flight never answers: without this the round would wait for `timeout`.
        """
        with single_error():
            async with anyio.create_task_group() as group:
                group.start_soon(self._watch_health, base_url)
                await self._request(
                    "POST", base_url, "/update_weights", {"update_info": update_info}
                )
                group.cancel_scope.cancel()

    async def _watch_health(self, base_url: str) -> None:
        """Raise `ControlPlaneError` once `base_url` answers `GET /health` with 500 or 503
        (vLLM's answer once its engine died) or refuses connections; return if it has
        no health route (an `asyncwt worker`)."""
        while True:
            await anyio.sleep(_HEALTH_EVERY_S)
            try:
                async with self._get_session().get(
                    base_url + "/health", timeout=aiohttp.ClientTimeout(total=_HEALTH_EVERY_S)
                ) as response:
                    status = response.status
            except asyncio.TimeoutError:
                continue  # busy, not dead: the call itself is bounded by `timeout`
            except aiohttp.ClientError as exc:
                raise ControlPlaneError(
                    f"POST /update_weights to {base_url} failed: the server stopped answering "
                    f"GET /health during the round ({type(exc).__name__}: {exc})"
                ) from exc
            if status in (500, 503):
                raise ControlPlaneError(
                    f"POST /update_weights to {base_url} failed: GET /health answered "
                    f"{status} during the round (vLLM answers 503 once its engine died)"
                )
            if status // 100 != 2:
                return

    async def finish_weight_update(
        self,
        weight_version: str | None = None,
        *,
        round_id: int | None = None,
        trainer_id: str | None = None,
    ) -> None:
        """POST `/finish_weight_update`: every worker drains and publishes `weight_version`.

        `round_id` and `trainer_id` (optional) name the round to close: a worker
        refuses (409) a finish for any round but the one open.

        Cancellation: the requests are abandoned; workers may still publish.
        """
        body = {"weight_version": weight_version, **_round_body(round_id, trainer_id)}
        try:
            await self._post_all("/finish_weight_update", body)
        finally:
            await self._pause.end()

    async def round_failed(self) -> None:
        """The trainer engine's call after a failed round: resume generation if this
        client paused it (errors are logged, not raised). Without `pause`, a no-op."""
        await self._pause.end_quietly()

    async def _pause_all(self, mode: PauseMode) -> None:
        await self._post_all(f"/pause?mode={mode}&clear_cache=true", {})

    async def _resume_all(self) -> None:
        await self._post_all("/resume", {})

    async def shutdown(self) -> None:
        """POST `/shutdown_weight_transfer_engine`: release every worker's transport.

        The workers keep serving (a later init sets the transport up again), and this
        client stays open. Cancellation: workers may still shut their transport down.
        """
        await self._post_all("/shutdown_weight_transfer_engine", {})

    async def weights_status(self, *, checksum: bool = False) -> list[dict[str, Any]]:
        """GET `/weights_status` from every worker, concurrently, in `base_urls` order.

        Each dict holds `weight_version` (the last round that completed),
        `weights_incomplete` (whether a failed round left the model half-updated),
        `checksum` (see `model_checksum`; None unless `checksum` is true, which asks
        for `?checksum=1`: the worker hashes every weight), `backend` and
        `initialized`. Cancellation: the requests are abandoned; nothing changes
        remotely.
        """
        route = "/weights_status?checksum=1" if checksum else "/weights_status"
        results: list[dict[str, Any]] = [{} for _ in self.base_urls]

        async def fetch(index: int) -> None:
            url = self.base_urls[index]
            answer = await self._request("GET", url, route, None)
            if not isinstance(answer, dict):
                raise ControlPlaneError(
                    f"GET /weights_status to {url} answered {type(answer).__name__}, "
                    "expected a JSON object"
                )
            results[index] = answer

        await fan_out([functools.partial(fetch, i) for i in range(len(self.base_urls))])
        return results

    async def close(self) -> None:
        """Close the HTTP session. Idempotent; a later call opens a new one.

        Cancellation: the session may be left half-closed.
        """
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


def _round_body(round_id: int | None, trainer_id: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if round_id is not None:
        body["round_id"] = round_id
    if trainer_id is not None:
        body["trainer_id"] = trainer_id
    return body


async def _error_detail(response: aiohttp.ClientResponse) -> str:
    """The worker's error message: `{"error": ...}` if it sent one, else the body text."""
    text = await response.text(errors="replace")
    detail: object = text
    if response.content_type == "application/json":
        try:
            body = await response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and "error" in body:
            detail = body["error"]
    message = str(detail).strip() or response.reason or "no error message"
    if len(message) > _MAX_ERROR_CHARS:
        message = message[:_MAX_ERROR_CHARS] + "..."
    return message
