"""Registers the backends that ship with asyncwt (imported by the package).

`cuda_ipc` is registered only where CUDA is available; elsewhere asking for it
explains why it is missing.
"""

from __future__ import annotations

import torch

from ._registry import mark_unavailable, register_trainer_engine, register_worker_engine
from ._shm import ShmTrainerEngine, ShmWorkerEngine
from ._tcp_trainer import TcpTrainerEngine
from ._tcp_worker import TcpWorkerEngine
from ._torch_dist import TorchDistTrainerEngine, TorchDistWorkerEngine

register_trainer_engine("tcp", TcpTrainerEngine)
register_worker_engine("tcp", TcpWorkerEngine)
register_trainer_engine("shm", ShmTrainerEngine)
register_worker_engine("shm", ShmWorkerEngine)
register_trainer_engine("torch_dist", TorchDistTrainerEngine)
register_worker_engine("torch_dist", TorchDistWorkerEngine)

if torch.cuda.is_available():
    from ._cuda_ipc import CudaIpcTrainerEngine, CudaIpcWorkerEngine

    register_trainer_engine("cuda_ipc", CudaIpcTrainerEngine)
    register_worker_engine("cuda_ipc", CudaIpcWorkerEngine)
else:
    mark_unavailable("cuda_ipc", "it needs a CUDA GPU and torch.cuda.is_available() is False here")
