"""Registers the backends that ship with asyncwt (imported by the package)."""

from __future__ import annotations

from ._registry import register_trainer_engine, register_worker_engine
from ._shm import ShmTrainerEngine, ShmWorkerEngine
from ._tcp_trainer import TcpTrainerEngine
from ._torch_dist import TorchDistTrainerEngine, TorchDistWorkerEngine
from ._tcp_worker import TcpWorkerEngine

register_trainer_engine("tcp", TcpTrainerEngine)
register_worker_engine("tcp", TcpWorkerEngine)
register_trainer_engine("shm", ShmTrainerEngine)
register_worker_engine("shm", ShmWorkerEngine)
register_trainer_engine("torch_dist", TorchDistTrainerEngine)
register_worker_engine("torch_dist", TorchDistWorkerEngine)
