"""Pausing vLLM's generation around each round: what `HttpClient` and `RayClient` share.

vLLM (0.32) pauses its scheduler with `POST /pause?mode=...` (over HTTP; on an engine
actor, `pause_generation(mode=..., clear_cache=...)`) and resumes it with `/resume`:

- `"keep"`: requests in flight are frozen and continue after the round; with
  `clear_cache=true` their KV is recomputed, so every token after the round comes
  from the new weights. The usual choice for async RL (TRL, NeMo-RL).
- `"wait"`: no new request starts; the round begins once those in flight finished
  (on the old weights): strictly one version per completion, at the cost of waiting
  for the longest one.
- `"abort"`: requests in flight are aborted (their clients get an error); the round
  begins at once.

The client pauses before `start_weight_update` and resumes after
`finish_weight_update`, or as soon as the round failed (`round_failed`, which the
trainer engine calls): a failed round never leaves vLLM paused. `paused_s` says how
long generation was paused in the last round (`RoundStats.paused_s`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Literal, get_args

import anyio

__all__ = ["PAUSE_MODES", "PauseMode", "RoundPause", "check_pause"]

logger = logging.getLogger("asyncwt")

PauseMode = Literal["keep", "wait", "abort"]
"""vLLM's pause modes (see the module docstring)."""

PAUSE_MODES: tuple[str, ...] = get_args(PauseMode)


def check_pause(pause: object) -> PauseMode | None:
    """`pause` if it is None or one of vLLM's modes, else a `ValueError` naming it."""
    if pause is not None and pause not in PAUSE_MODES:
        raise ValueError(f"pause should be None or one of {PAUSE_MODES}, got {pause!r}")
    return pause  # type: ignore[return-value]


class RoundPause:
    """Pauses generation once per round and always resumes it (a client's helper).

    `pause` and `resume` are the client's calls to every server (each raises
    `ControlPlaneError` on failure). With `mode=None` nothing is paused.
    """

    def __init__(
        self,
        mode: PauseMode | None,
        pause: Callable[[PauseMode], Awaitable[None]],
        resume: Callable[[], Awaitable[None]],
    ) -> None:
        self.mode = check_pause(mode)
        self._pause = pause
        self._resume = resume
        self._since: float | None = None
        self.paused_s: float | None = None
        """Seconds generation was paused in the last round (None: never paused)."""

    async def begin(self) -> None:
        """Pause generation for a round (a no-op without a mode, or if paused already).

        If pausing fails, generation is resumed (some servers may have paused) and the
        error raised: the round does not start.
        """
        if self.mode is None or self._since is not None:
            return
        self._since = time.perf_counter()
        try:
            await self._pause(self.mode)
        except BaseException:
            await self.end()
            raise

    async def end(self) -> None:
        """Resume generation if this helper paused it; shielded from cancellation.

        Resuming is idempotent, so a failed resume is tried once more (a server
        closes a kept-alive connection after a failed call, which the first attempt
        may have met). Raises the second attempt's `ControlPlaneError`, after
        recording the pause's length.
        """
        since = self._since
        if since is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                try:
                    await self._resume()
                except Exception as exc:  # noqa: BLE001 - tried again; its error is raised
                    logger.debug("resuming generation failed once, trying again: %r", exc)
                    await self._resume()
            finally:
                self._since = None
                self.paused_s = time.perf_counter() - since

    async def end_quietly(self) -> None:
        """`end`, with its error logged instead of raised (the round failed already)."""
        try:
            await self.end()
        except Exception as exc:  # noqa: BLE001 - the round failed already; logged
            logger.warning("could not resume generation after a failed round: %r", exc)
