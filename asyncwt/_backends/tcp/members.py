"""The trainer's workers addressed one by one on the control plane: a `"tcp"` chain
routes by member, and a fleet that drops or adds workers calls only the live ones.

`Members` is itself a control-plane client (the four calls), so the trainer engine
drives it like any other: each call goes to every live member concurrently. A
client that holds several workers and can be split (`HttpClient` over many URLs,
`LocalClient` over many engines) becomes one member per worker; any other client
(a vLLM plugin's, Ray's) is one member, whatever number of workers it reaches.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import anyio

from ..._core.concurrency import fan_out
from ..._core.protocol import AnyWeightSyncClient, call_client, round_keywords

__all__ = ["Member", "Members"]

_SHORT_CALLS = ("start_weight_update", "finish_weight_update")


@dataclass
class Member:
    """One worker (or one unsplittable client) on the control plane."""

    number: int
    client: Any
    label: str
    owned: bool
    """Whether `Members` made the client (a split part) and must close it."""


def _label(client: object, number: int) -> str:
    urls = getattr(client, "base_urls", None)
    if isinstance(urls, tuple) and len(urls) == 1:
        return str(urls[0])
    return f"member {number}"


class Members:
    """A control-plane client over numbered members; see the module docstring."""

    def __init__(self) -> None:
        self.members: dict[int, Member] = {}
        self._next = 0
        self.unanswered: set[int] = set()
        """Members whose call was still running when the last call was cancelled (the
        trainer gave up on it after `rpc_timeout`): stalled, if the call was short."""

    def add(self, client: AnyWeightSyncClient) -> list[int]:
        """Split `client` into members where it can be split; their numbers."""
        split = getattr(client, "split", None)
        parts = split() if callable(split) else [client]
        owned = parts != [client]
        numbers = []
        for part in parts:
            number = self._next
            self._next += 1
            self.members[number] = Member(number, part, _label(part, number), owned)
            numbers.append(number)
        return numbers

    def label(self, number: int) -> str:
        member = self.members.get(number)
        return member.label if member is not None else f"member {number}"

    async def drop(self, number: int) -> None:
        """Stop calling member `number` (closing the client if it is ours)."""
        member = self.members.pop(number, None)
        if member is not None and member.owned:
            await _close(member.client)

    async def close(self) -> None:
        """Close every client this object made. Idempotent."""
        members, self.members = list(self.members.values()), {}
        for member in members:
            if member.owned:
                await _close(member.client)

    async def _each(
        self, method: str, *args: Any, among: list[int] | None = None, **ids: Any
    ) -> None:
        numbers = list(self.members) if among is None else among
        running = set(numbers)

        async def one(number: int) -> None:
            client = self.members[number].client
            kwargs = round_keywords(client, method, **ids) if ids else {}
            await call_client(client, method, *args, **kwargs)
            running.discard(number)

        self.unanswered = set()
        try:
            await fan_out([functools.partial(one, number) for number in numbers])
        except anyio.get_cancelled_exc_class():
            if method in _SHORT_CALLS:  # an update lasts a round: not a sign of a stall
                self.unanswered = running
            raise

    async def init_members(self, init_info: dict[str, Any], numbers: list[int]) -> None:
        """Init members `numbers`, each told its number (`member`)."""
        calls = [
            functools.partial(
                call_client,
                self.members[n].client,
                "init_weight_transfer_engine",
                {**init_info, "member": n},
            )
            for n in numbers
        ]
        await fan_out(calls)

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await self.init_members(init_info, list(self.members))

    async def start_weight_update(
        self, *, round_id: int | None = None, trainer_id: str | None = None
    ) -> None:
        await self._each("start_weight_update", round_id=round_id, trainer_id=trainer_id)

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await self._each("update_weights", update_info)

    async def finish_weight_update(
        self,
        weight_version: str | None = None,
        *,
        round_id: int | None = None,
        trainer_id: str | None = None,
    ) -> None:
        await self._each(
            "finish_weight_update", weight_version, round_id=round_id, trainer_id=trainer_id
        )


async def _close(client: object) -> None:
    close = getattr(client, "close", None)
    if callable(close):
        result = close()
        if hasattr(result, "__await__"):
            await result
