"""asyncwt: move a trainer's weights into running inference workers, fast.

The public surface is vLLM's weight-transfer interface, asyncio-native on the trainer
side. Everything public is re-exported here; implementation lives in private modules.
"""

import inspect as _inspect
import types as _types
import typing as _typing
import warnings as _warnings

with _warnings.catch_warnings():
    # A CPU torch without numpy warns at import; asyncwt never needs numpy.
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch as _torch  # noqa: F401

from . import _backends  # noqa: F401  (registers the built-in backends by name)
from ._control.http import HttpClient as HttpClient
from ._control.local import LocalClient as LocalClient
from ._control.ray import RayClient as RayClient
from ._core.adapter import AdapterSource as AdapterSource
from ._core.checksum import model_checksum as model_checksum
from ._core.config import Chain as Chain
from ._core.config import Delta as Delta
from ._core.config import Listen as Listen
from ._core.config import Star as Star
from ._core.config import Timeouts as Timeouts
from ._core.config import Tuning as Tuning
from ._core.errors import ApplyError as ApplyError
from ._core.errors import AsyncwtError as AsyncwtError
from ._core.errors import AuthenticationError as AuthenticationError
from ._core.errors import ControlPlaneError as ControlPlaneError
from ._core.errors import PlanMismatchError as PlanMismatchError
from ._core.errors import ProtocolError as ProtocolError
from ._core.errors import RoundConflictError as RoundConflictError
from ._core.errors import SourceMismatchError as SourceMismatchError
from ._core.errors import StaleRoundError as StaleRoundError
from ._core.errors import TransferAbortedError as TransferAbortedError
from ._core.errors import TransferError as TransferError
from ._core.errors import TransferTimeoutError as TransferTimeoutError
from ._core.layerwise import layerwise_groups as layerwise_groups
from ._core.meta import ParamMeta as ParamMeta
from ._core.meta import Placement as Placement
from ._core.meta import Replicate as Replicate
from ._core.meta import Shard as Shard
from ._core.plan import TransferPlan as TransferPlan
from ._core.protocol import AsyncWeightSyncClient as AsyncWeightSyncClient
from ._core.protocol import VLLMWeightSyncClient as VLLMWeightSyncClient
from ._core.protocol import WeightTransferUpdatePayload as WeightTransferUpdatePayload
from ._core.registry import create_worker_engine as create_worker_engine
from ._core.registry import register_trainer_engine as register_trainer_engine
from ._core.registry import register_worker_engine as register_worker_engine
from ._core.registry import registered_backends as registered_backends
from ._core.registry import trainer_init as trainer_init
from ._core.settings import RoundUpdateInfo as RoundUpdateInfo
from ._core.source import ModuleSource as ModuleSource
from ._core.source import WeightSource as WeightSource
from ._core.source import materialize_full_tensor as materialize_full_tensor
from ._core.stats import RoundStats as RoundStats
from ._core.trainer_api import TrainerInitInfo as TrainerInitInfo
from ._core.trainer_api import TrainerWeightTransferEngine as TrainerWeightTransferEngine
from ._core.worker_api import WeightTransferConfig as WeightTransferConfig
from ._core.worker_api import WeightTransferEngine as WeightTransferEngine
from ._core.worker_api import WeightTransferInitInfo as WeightTransferInitInfo
from ._core.worker_api import WeightTransferInitRequest as WeightTransferInitRequest
from ._core.worker_api import WeightTransferUpdateInfo as WeightTransferUpdateInfo
from ._core.worker_api import WeightTransferUpdateRequest as WeightTransferUpdateRequest
from ._trainer.blocking import SyncTrainerEngine as SyncTrainerEngine
from ._worker.ray_actor import WorkerActor as WorkerActor
from ._worker.ray_actor import worker_actor as worker_actor
from ._worker.server import ServerLimits as ServerLimits
from ._worker.server import build_app as build_app
from ._worker.server import serve as serve

if _typing.TYPE_CHECKING:
    from ._backends.cuda_ipc import CudaIpcTrainerEngine as CudaIpcTrainerEngine
    from ._backends.cuda_ipc import CudaIpcTrainerInitInfo as CudaIpcTrainerInitInfo
    from ._backends.cuda_ipc import CudaIpcWorkerEngine as CudaIpcWorkerEngine
    from ._backends.cuda_ipc import CudaIpcWorkerInitInfo as CudaIpcWorkerInitInfo
    from ._backends.shm.backend import ShmTrainerEngine as ShmTrainerEngine
    from ._backends.shm.backend import ShmTrainerInitInfo as ShmTrainerInitInfo
    from ._backends.shm.backend import ShmWorkerEngine as ShmWorkerEngine
    from ._backends.shm.backend import ShmWorkerInitInfo as ShmWorkerInitInfo
    from ._backends.tcp.backend import TcpTrainerEngine as TcpTrainerEngine
    from ._backends.tcp.backend import TcpWorkerEngine as TcpWorkerEngine
    from ._backends.tcp.settings import TcpTrainerInitInfo as TcpTrainerInitInfo
    from ._backends.tcp.settings import TcpUpdateInfo as TcpUpdateInfo
    from ._backends.tcp.settings import TcpWorkerInitInfo as TcpWorkerInitInfo
    from ._backends.torch_dist import TorchDistTrainerEngine as TorchDistTrainerEngine
    from ._backends.torch_dist import TorchDistTrainerInitInfo as TorchDistTrainerInitInfo
    from ._backends.torch_dist import TorchDistWorkerEngine as TorchDistWorkerEngine
    from ._backends.torch_dist import TorchDistWorkerInitInfo as TorchDistWorkerInitInfo

_LAZY: dict[str, str] = {
    "CudaIpcTrainerEngine": "asyncwt._backends.cuda_ipc",
    "CudaIpcTrainerInitInfo": "asyncwt._backends.cuda_ipc",
    "CudaIpcWorkerEngine": "asyncwt._backends.cuda_ipc",
    "CudaIpcWorkerInitInfo": "asyncwt._backends.cuda_ipc",
    "ShmTrainerEngine": "asyncwt._backends.shm.backend",
    "ShmTrainerInitInfo": "asyncwt._backends.shm.backend",
    "ShmWorkerEngine": "asyncwt._backends.shm.backend",
    "ShmWorkerInitInfo": "asyncwt._backends.shm.backend",
    "TcpTrainerEngine": "asyncwt._backends.tcp.backend",
    "TcpTrainerInitInfo": "asyncwt._backends.tcp.settings",
    "TcpUpdateInfo": "asyncwt._backends.tcp.settings",
    "TcpWorkerEngine": "asyncwt._backends.tcp.backend",
    "TcpWorkerInitInfo": "asyncwt._backends.tcp.settings",
    "TorchDistTrainerEngine": "asyncwt._backends.torch_dist",
    "TorchDistTrainerInitInfo": "asyncwt._backends.torch_dist",
    "TorchDistWorkerEngine": "asyncwt._backends.torch_dist",
    "TorchDistWorkerInitInfo": "asyncwt._backends.torch_dist",
}
"""Public names of the built-in backends -> the module that defines each: imported on
first use (`__getattr__`), so that `import asyncwt` loads no backend module."""

__version__ = "0.1.0"

__all__ = [
    "AdapterSource",
    "ApplyError",
    "AsyncWeightSyncClient",
    "AsyncwtError",
    "AuthenticationError",
    "Chain",
    "ControlPlaneError",
    "CudaIpcTrainerEngine",
    "CudaIpcTrainerInitInfo",
    "CudaIpcWorkerEngine",
    "CudaIpcWorkerInitInfo",
    "Delta",
    "HttpClient",
    "Listen",
    "LocalClient",
    "ModuleSource",
    "ParamMeta",
    "Placement",
    "PlanMismatchError",
    "ProtocolError",
    "RayClient",
    "Replicate",
    "RoundConflictError",
    "RoundStats",
    "RoundUpdateInfo",
    "ServerLimits",
    "Shard",
    "ShmTrainerEngine",
    "ShmTrainerInitInfo",
    "ShmWorkerEngine",
    "ShmWorkerInitInfo",
    "SourceMismatchError",
    "StaleRoundError",
    "Star",
    "SyncTrainerEngine",
    "TcpTrainerEngine",
    "TcpTrainerInitInfo",
    "TcpUpdateInfo",
    "TcpWorkerEngine",
    "TcpWorkerInitInfo",
    "Timeouts",
    "TorchDistTrainerEngine",
    "TorchDistTrainerInitInfo",
    "TorchDistWorkerEngine",
    "TorchDistWorkerInitInfo",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "TransferAbortedError",
    "TransferError",
    "TransferPlan",
    "TransferTimeoutError",
    "Tuning",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdatePayload",
    "WeightTransferUpdateRequest",
    "WorkerActor",
    "build_app",
    "create_worker_engine",
    "layerwise_groups",
    "materialize_full_tensor",
    "model_checksum",
    "register_trainer_engine",
    "register_worker_engine",
    "registered_backends",
    "serve",
    "trainer_init",
    "worker_actor",
]


def _publish(obj: object) -> None:
    """Make `obj` report the path users import (anyio does the same), so reprs,
    tracebacks and the API reference say `asyncwt.X`, not the private module that
    defines it. Type aliases (`Placement`, say) have no module of their own.

    `typing.get_type_hints` reads a class's string annotations in the namespace of
    its `__module__`: a class's own annotations are resolved first, in the module
    that wrote them, so that tools that read them (config parsers) keep working.
    """
    if isinstance(obj, type):
        own = _inspect.get_annotations(obj)
        if own:
            hints = _typing.get_type_hints(obj, include_extras=True)
            obj.__annotations__ = {name: hints.get(name, value) for name, value in own.items()}
    if isinstance(obj, (type, _types.FunctionType)):
        obj.__module__ = __name__


for _name in __all__:
    if _name not in _LAZY:
        _publish(globals()[_name])
del _name


def __getattr__(name: str) -> object:
    """A built-in backend's public name, its module imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    obj: object = getattr(importlib.import_module(module), name)
    _publish(obj)
    globals()[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
