"""`python -m asyncwt._bench._child ROLE JSON_ARGS`: the benchmark's helper processes.

Roles: `raw-send` (the raw loopback sender), `peer-naive`, `peer-gloo`,
`peer-packed` (the worker side of a peer approach) and `trainer-BACKEND` (an
asyncwt trainer running measured jobs). The asyncwt worker is not here: the
benchmark runs the real `asyncwt worker` command for it.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print("usage: python -m asyncwt._bench._child ROLE JSON_ARGS", file=sys.stderr)
        return 2
    role, payload = args[0], json.loads(args[1])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
        import torch  # noqa: F401
    if role == "raw-send":
        from ._limits import raw_sender

        raw_sender(**payload)
    elif role.startswith("trainer-"):
        from ._engines import trainer_process

        trainer_process(**payload)
    elif role.startswith("peer-"):
        from ._peers import peer_worker

        peer_worker(**payload)
    else:
        print(f"unknown role {role!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
