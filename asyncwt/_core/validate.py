"""Checks of user-given values, shared by every settings class and init info.

Each raises `ValueError` (a wrong type included: see `asyncwt._core.errors`) whose
message names the field, what it should be, and what it got:
"num_buffers should be a positive int, got 0". A `bool` is never taken for an int.
"""

from __future__ import annotations

import math

__all__ = [
    "MAX_TIMEOUT_S",
    "check_at_most",
    "check_bool",
    "check_host",
    "check_int_in",
    "check_non_negative",
    "check_port",
    "check_positive",
    "check_str",
    "check_timeout",
    "check_u64",
]

MAX_TIMEOUT_S = 7 * 24 * 3600
"""Upper bound on every timeout: a week is "no timeout" for a weight sync, and far
larger values overflow the sockets' and threads' own limits."""

MAX_HOST_CHARS = 253
"""The longest DNS name."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_bool(name: str, value: object) -> None:
    """`value` is a bool."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} should be a bool, got {value!r}")


def check_positive(name: str, value: object, kind: type = int) -> None:
    """`value` is a positive int (with `kind=float`: a positive finite int or float)."""
    allowed = (int, float) if kind is float else (int,)
    ok = isinstance(value, allowed) and not isinstance(value, bool)
    if not ok or not value > 0 or not math.isfinite(value):  # type: ignore[operator,arg-type]
        raise ValueError(f"{name} should be a positive {kind.__name__}, got {value!r}")


def check_non_negative(name: str, value: object) -> None:
    """`value` is an int >= 0."""
    if not _is_int(value) or value < 0:  # type: ignore[operator]
        raise ValueError(f"{name} should be a non-negative int, got {value!r}")


def check_at_most(name: str, value: float, limit: float) -> None:
    """`value` (already checked to be a number) does not exceed `limit`."""
    if value > limit:
        raise ValueError(f"{name} should be at most {limit}, got {value}")


def check_int_in(name: str, value: object, low: int, high: int | None = None) -> None:
    """`value` is an int in `[low, high]` (`high=None`: no upper bound)."""
    if _is_int(value) and low <= value and (high is None or value <= high):  # type: ignore[operator]
        return
    expected = f"in [{low}, {high}]" if high is not None else f">= {low}"
    raise ValueError(f"{name} should be an int {expected}, got {value!r}")


def check_u64(name: str, value: object) -> None:
    """`value` is an int that fits an unsigned 64-bit field: in `[0, 2**64)`."""
    if not _is_int(value) or not 0 <= value < 2**64:  # type: ignore[operator]
        raise ValueError(f"{name} should be an int in [0, 2**64), got {value!r}")


def check_timeout(name: str, value: object) -> None:
    """`value` is a number of seconds in `(0, MAX_TIMEOUT_S]`."""
    check_positive(name, value, float)
    check_at_most(name, value, MAX_TIMEOUT_S)  # type: ignore[arg-type]


def check_port(name: str, value: object, *, allow_zero: bool = False) -> None:
    """`value` is a TCP port: in `[1, 65535]`, or `[0, 65535]` where 0 means "any free"."""
    check_int_in(name, value, 0 if allow_zero else 1, 65535)


def check_host(name: str, value: object) -> None:
    """`value` is a host name or address a socket can take: a non-empty str of at
    most `MAX_HOST_CHARS` characters that IDNA encodes."""
    if not isinstance(value, str) or not value or len(value) > MAX_HOST_CHARS:
        raise ValueError(
            f"{name} should be a host name or address (1-{MAX_HOST_CHARS} characters), "
            f"got {value!r}"
        )
    try:
        value.encode("idna")
    except UnicodeError:
        raise ValueError(f"{name} should be a host name or address, got {value!r}") from None


def check_str(
    name: str,
    value: object,
    *,
    min_chars: int = 0,
    max_chars: int | None = None,
    secret: bool = False,
) -> None:
    """`value` is a str of `min_chars` to `max_chars` characters.

    A `secret` (a token), and a str too long to show, is reported by its length.
    """
    if isinstance(value, str) and min_chars <= len(value) <= (max_chars or len(value)):
        return
    if max_chars is None:
        expected = (
            "a non-empty str" if min_chars <= 1 else f"a str of at least {min_chars} characters"
        )
    elif min_chars == max_chars:
        expected = f"a {max_chars}-character str"
    elif min_chars == 0:
        expected = f"a str of at most {max_chars} characters"
    else:
        expected = f"a str of {min_chars}-{max_chars} characters"
    if isinstance(value, str) and (secret or len(value) > 80):
        shown = f"{len(value)} characters"
    elif secret:
        shown = type(value).__name__
    else:
        shown = repr(value)
    raise ValueError(f"{name} should be {expected}, got {shown}")
