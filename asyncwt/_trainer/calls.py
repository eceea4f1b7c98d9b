"""Bounded control-plane calls of the trainer engine (and of what it is handed)."""

from __future__ import annotations

import logging
from typing import Any

import anyio

from .._core.errors import ControlPlaneError
from .._core.protocol import call_client

__all__ = ["bounded_call", "round_failed"]

logger = logging.getLogger("asyncwt")


async def bounded_call(
    client: object, method: str, *args: Any, timeout: float, where: str, **kwargs: Any
) -> None:
    """`call_client`, abandoned with a `ControlPlaneError` after `timeout` seconds.

    A synchronous client's thread cannot be interrupted: it is left to finish in the
    background (its result is dropped), so the caller never waits past `timeout`.
    """
    with anyio.move_on_after(timeout) as scope:
        await call_client(client, method, *args, **kwargs)
    if scope.cancelled_caught:
        raise ControlPlaneError(
            f"{where}: {method} did not return within timeouts.rpc={timeout}s; the call was "
            f"abandoned (a worker stalled or unreachable?). Check the workers; raise "
            f"timeouts.rpc if they are only slow (it must exceed timeouts.drain)"
        )


async def round_failed(client: object, timeout: float) -> None:
    """Tell `client` a round failed, if it wants to know (`client.round_failed()`: an
    `HttpClient` that paused vLLM resumes it). Shielded and bounded by `timeout`;
    its errors are logged: the round's own error is the one raised."""
    if not callable(getattr(client, "round_failed", None)):
        return
    with anyio.CancelScope(shield=True), anyio.move_on_after(timeout):
        try:
            await call_client(client, "round_failed")
        except Exception as exc:  # noqa: BLE001 - the round's own error is raised
            logger.warning("%s.round_failed() failed: %r", type(client).__name__, exc)
