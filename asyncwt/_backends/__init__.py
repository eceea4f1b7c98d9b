"""Registers the backends that ship with asyncwt (imported by the package).

Nothing here asks torch about the machine: `torch.cuda.is_available()` at import
would initialise CUDA in every process that imports asyncwt, vLLM's included,
and a process that forks after that hands its children a CUDA they cannot use.
`cuda_ipc` is registered everywhere; asking for it where CUDA is missing says why.
"""

from __future__ import annotations

import torch

from .._core.registry import register_trainer_engine, register_worker_engine, require
from .cuda_ipc import CudaIpcTrainerEngine, CudaIpcWorkerEngine
from .shm.backend import ShmTrainerEngine, ShmWorkerEngine
from .tcp.trainer import TcpTrainerEngine
from .tcp.worker import TcpWorkerEngine
from .torch_dist import TorchDistTrainerEngine, TorchDistWorkerEngine

register_trainer_engine("tcp", TcpTrainerEngine)
register_worker_engine("tcp", TcpWorkerEngine)
register_trainer_engine("shm", ShmTrainerEngine)
register_worker_engine("shm", ShmWorkerEngine)
register_trainer_engine("torch_dist", TorchDistTrainerEngine)
register_worker_engine("torch_dist", TorchDistWorkerEngine)

register_trainer_engine("cuda_ipc", CudaIpcTrainerEngine)
register_worker_engine("cuda_ipc", CudaIpcWorkerEngine)


def _cuda_missing() -> str | None:
    if torch.cuda.is_available():
        return None
    return "it needs a CUDA GPU and torch.cuda.is_available() is False here"


require("cuda_ipc", _cuda_missing)
