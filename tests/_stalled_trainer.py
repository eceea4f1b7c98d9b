"""`python -m _stalled_trainer BACKEND`: a trainer that stops in the middle of its init.

It starts `trainer_init` against a client that prints the worker init info as one
line of JSON and then waits (up to a minute) instead of calling any worker: the
trainer is listening, with its transport's resources made, until it is killed.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import _models
import anyio
from _faults import info_for

from asyncwt import HttpClient, ModuleSource, trainer_init


class StallingClient(HttpClient):
    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        print(json.dumps({k: v for k, v in init_info.items() if k != "plan"}), flush=True)
        await anyio.sleep(60)


async def main(backend: str) -> None:
    info = info_for(backend, direct_reads=False) if backend == "shm" else info_for(backend)
    await trainer_init(
        info, client=StallingClient("http://127.0.0.1:9"), source=ModuleSource(_models.mixed())
    )


if __name__ == "__main__":
    anyio.run(main, sys.argv[1])
