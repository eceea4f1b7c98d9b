"""The backends that ship with asyncwt, registered by name and imported on first use.

Each built-in backend is registered by where its engine classes live; its module
is imported when the backend is first asked for (vLLM's weight-transfer factory and
anyio's backends do the same), so `import asyncwt` loads no backend module. A
third-party backend registers its classes with `register_trainer_engine` and
`register_worker_engine` as before.

Nothing here asks torch about the machine: `torch.cuda.is_available()` at import
would initialise CUDA in every process that imports asyncwt, vLLM's included,
and a process that forks after that hands its children a CUDA they cannot use.
`cuda_ipc` is registered everywhere; asking for it where CUDA is missing says why.
"""

from __future__ import annotations

import torch

from .._core.registry import register_lazy, require

__all__ = ["BUILT_IN"]

BUILT_IN: dict[str, tuple[str, str]] = {
    "tcp": (
        "asyncwt._backends.tcp.backend:TcpTrainerEngine",
        "asyncwt._backends.tcp.backend:TcpWorkerEngine",
    ),
    "shm": (
        "asyncwt._backends.shm.backend:ShmTrainerEngine",
        "asyncwt._backends.shm.backend:ShmWorkerEngine",
    ),
    "torch_dist": (
        "asyncwt._backends.torch_dist:TorchDistTrainerEngine",
        "asyncwt._backends.torch_dist:TorchDistWorkerEngine",
    ),
    "cuda_ipc": (
        "asyncwt._backends.cuda_ipc:CudaIpcTrainerEngine",
        "asyncwt._backends.cuda_ipc:CudaIpcWorkerEngine",
    ),
}
"""Backend name -> where its trainer and worker engine classes live (`module:Class`)."""

for _backend, (_trainer, _worker) in BUILT_IN.items():
    register_lazy(_backend, trainer=_trainer, worker=_worker)
del _backend, _trainer, _worker


def _cuda_missing() -> str | None:
    if torch.cuda.is_available():
        return None
    return "it needs a CUDA GPU and torch.cuda.is_available() is False here"


require("cuda_ipc", _cuda_missing)
