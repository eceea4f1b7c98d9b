"""`--log-level` and `ASYNCWT_LOG_LEVEL`: one logging setup for every command line."""

from __future__ import annotations

import argparse
import logging
import os

__all__ = ["LOG_LEVELS", "LOG_LEVEL_ENV", "add_log_level_option", "configure_logging"]

LOG_LEVEL_ENV = "ASYNCWT_LOG_LEVEL"
"""The environment variable giving the default of `--log-level` on every command."""
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _level(text: str) -> str:
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"should be one of {', '.join(LOG_LEVELS)} (any case), got {text!r}"
        )
    return level


def add_log_level_option(parser: argparse.ArgumentParser) -> None:
    """Add `--log-level LEVEL` to `parser`, its default read from `ASYNCWT_LOG_LEVEL`.

    The default stays the raw text of the variable; `configure_logging` checks it, so a
    bad value in the environment is reported as the variable's, not the option's.
    """
    parser.add_argument(
        "--log-level",
        type=_level,
        default=None,
        metavar="LEVEL",
        help=(
            f"{', '.join(LOG_LEVELS)}: what asyncwt logs on stderr (default: ${LOG_LEVEL_ENV}, "
            "else WARNING; INFO shows each round)"
        ),
    )


def configure_logging(level: str | None) -> None:
    """Log asyncwt's records at `level` (`--log-level`), else at `$ASYNCWT_LOG_LEVEL`,
    else at WARNING; other libraries' at WARNING.

    Raises:
        ValueError: `$ASYNCWT_LOG_LEVEL` names no level (the message says which are).
    """
    if level is None:
        text = os.environ.get(LOG_LEVEL_ENV, "").strip() or "WARNING"
        try:
            level = _level(text)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"${LOG_LEVEL_ENV} {exc}") from None
    # asyncwt's loggers at `level`; the others (aiohttp's access log, torch's) stay at
    # WARNING unless asked for less, so that INFO is the story of the rounds.
    chosen = getattr(logging, level)
    logging.basicConfig(level=max(chosen, logging.WARNING), format=_FORMAT)
    logging.getLogger("asyncwt").setLevel(chosen)
