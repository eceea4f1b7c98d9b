"""The fleet modes that do not work together, as data, checked at construction.

A trainer init info describes its modes as `{setting: Mode}` (`modes()`: only the
settings its backend has). `check_modes` refuses the first pair that `REFUSED`
lists, naming both settings and their values. A combination a backend cannot
express (a field it does not have) needs no rule: its type makes it impossible.
`NOT_BUILT` lists pairs a round plan can describe but no engine runs yet (sliced
receivers in a tracked fleet): init infos refuse those too, plans do not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["NOT_BUILT", "REFUSED", "Mode", "Refusal", "check_modes"]


@dataclass(frozen=True, slots=True)
class Mode:
    """One setting's mode: the key the rules match, and the value as the user wrote it."""

    key: str
    shown: str
    setting: str | None = None
    """The setting a user writes for it, where that is not the mode's own name (tcp's
    sliced receivers are `fanout=Star(slices=True)`)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """`first` in mode `first_key` cannot run together with `second` in `second_key`."""

    first: str
    first_key: str
    second: str
    second_key: str
    reason: str


REFUSED: tuple[Refusal, ...] = (
    Refusal(
        "delta",
        "on",
        "fanout",
        "chain",
        "a relay forwards the bytes it receives, and delta rounds are sent by rank 0 "
        "to every worker directly (fanout=Star())",
    ),
    Refusal(
        "delta",
        "on",
        "on_worker_failure",
        "drop",
        "a delta round needs every worker to hold the previous round, which a dropped "
        "and rejoined worker does not (on_worker_failure='fail')",
    ),
    Refusal(
        "senders",
        "owners",
        "delta",
        "on",
        "delta rounds are encoded from rank 0's full tensors (senders='rank0')",
    ),
    Refusal(
        "senders",
        "owners",
        "fanout",
        "chain",
        "each owner rank sends to every worker directly (fanout=Star())",
    ),
    Refusal(
        "senders",
        "owners",
        "on_worker_failure",
        "drop",
        "a dropped worker's round would run again on rank 0 alone, which holds only its "
        "own shards (on_worker_failure='fail')",
    ),
    Refusal(
        "receivers",
        "sliced",
        "fanout",
        "chain",
        "a relay forwards the whole stream it receives, and a receiver that holds only "
        "its slice cannot forward what its successor needs (fanout=Star())",
    ),
    Refusal(
        "receivers",
        "sliced",
        "delta",
        "on",
        "a delta round's base is the whole tensor on every receiver, and per-slice bases "
        "are not built yet (delta=None)",
    ),
)
"""Every refused pair of modes (delta, senders, fanout, on_worker_failure, receivers).

`receivers` is tcp's `fanout=Star(slices=True)` on an init info (each receiver then
declares its slice); a round plan built by hand meets the same pairs
(`asyncwt._core.round_plan.refuse`)."""

NOT_BUILT: tuple[Refusal, ...] = (
    Refusal(
        "receivers",
        "sliced",
        "on_worker_failure",
        "drop",
        "a tracked fleet's sender does not read the workers' layouts yet "
        "(on_worker_failure='fail')",
    ),
)
"""Pairs a round plan can describe but no engine runs yet: an init info refuses them
too (`check_modes(..., built=True)`), a round plan (data) does not."""


def check_modes(modes: Mapping[str, Mode], *, built: bool = False) -> None:
    """Raise `ValueError` on the first pair of `modes` that `REFUSED` lists (and, for
    settings an engine is built from, `built`, that `NOT_BUILT` lists)."""
    for rule in REFUSED + NOT_BUILT if built else REFUSED:
        first, second = modes.get(rule.first), modes.get(rule.second)
        if first is None or second is None:
            continue
        if first.key == rule.first_key and second.key == rule.second_key:
            raise ValueError(
                f"{first.setting or rule.first}={first.shown} cannot be combined with "
                f"{second.setting or rule.second}={second.shown}: {rule.reason}; change one "
                f"of them"
            )
