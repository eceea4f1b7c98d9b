"""asyncwt: move a trainer's weights into running inference workers, fast.

The public surface is vLLM's weight-transfer interface, asyncio-native on the trainer
side. Everything public is re-exported here; implementation lives in private modules.
"""

import warnings as _warnings

with _warnings.catch_warnings():
    # A CPU torch without numpy warns at import; asyncwt never needs numpy.
    _warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch as _torch  # noqa: F401

from . import _backends  # noqa: F401  (registers the built-in backends)
from ._checksum import model_checksum as model_checksum
from ._client import AsyncWeightSyncClient as AsyncWeightSyncClient
from ._client import VLLMWeightSyncClient as VLLMWeightSyncClient
from ._client import WeightTransferUpdatePayload as WeightTransferUpdatePayload
from ._exceptions import ApplyError as ApplyError
from ._exceptions import AsyncwtError as AsyncwtError
from ._exceptions import AuthenticationError as AuthenticationError
from ._exceptions import ControlPlaneError as ControlPlaneError
from ._exceptions import PlanMismatchError as PlanMismatchError
from ._exceptions import ProtocolError as ProtocolError
from ._exceptions import RoundConflictError as RoundConflictError
from ._exceptions import SourceMismatchError as SourceMismatchError
from ._exceptions import StaleRoundError as StaleRoundError
from ._exceptions import TransferAbortedError as TransferAbortedError
from ._exceptions import TransferError as TransferError
from ._exceptions import TransferTimeoutError as TransferTimeoutError
from ._http_client import HttpClient as HttpClient
from ._layerwise import layerwise_groups as layerwise_groups
from ._local_client import LocalClient as LocalClient
from ._meta import ParamMeta as ParamMeta
from ._meta import Placement as Placement
from ._meta import Replicate as Replicate
from ._meta import Shard as Shard
from ._plan import TransferPlan as TransferPlan
from ._registry import create_worker_engine as create_worker_engine
from ._registry import register_trainer_engine as register_trainer_engine
from ._registry import register_worker_engine as register_worker_engine
from ._registry import registered_backends as registered_backends
from ._registry import trainer_init as trainer_init
from ._settings import RoundUpdateInfo as RoundUpdateInfo
from ._shm import ShmTrainerInitInfo as ShmTrainerInitInfo
from ._source import ModuleSource as ModuleSource
from ._source import WeightSource as WeightSource
from ._source import materialize_full_tensor as materialize_full_tensor
from ._stats import RoundStats as RoundStats
from ._sync import SyncTrainerEngine as SyncTrainerEngine
from ._tcp_info import TcpTrainerInitInfo as TcpTrainerInitInfo
from ._tcp_info import TcpUpdateInfo as TcpUpdateInfo
from ._tcp_info import TcpWorkerInitInfo as TcpWorkerInitInfo
from ._tcp_trainer import TcpTrainerEngine as TcpTrainerEngine
from ._tcp_worker import TcpWorkerEngine as TcpWorkerEngine
from ._torch_dist import TorchDistTrainerInitInfo as TorchDistTrainerInitInfo
from ._trainer import TrainerInitInfo as TrainerInitInfo
from ._trainer import TrainerWeightTransferEngine as TrainerWeightTransferEngine
from ._worker import WeightTransferConfig as WeightTransferConfig
from ._worker import WeightTransferEngine as WeightTransferEngine
from ._worker import WeightTransferInitInfo as WeightTransferInitInfo
from ._worker import WeightTransferInitRequest as WeightTransferInitRequest
from ._worker import WeightTransferUpdateInfo as WeightTransferUpdateInfo
from ._worker import WeightTransferUpdateRequest as WeightTransferUpdateRequest

__version__ = "0.1.0"

__all__ = [
    "ApplyError",
    "AsyncWeightSyncClient",
    "AsyncwtError",
    "AuthenticationError",
    "ControlPlaneError",
    "HttpClient",
    "LocalClient",
    "ModuleSource",
    "ParamMeta",
    "Placement",
    "PlanMismatchError",
    "ProtocolError",
    "Replicate",
    "RoundConflictError",
    "RoundStats",
    "RoundUpdateInfo",
    "Shard",
    "ShmTrainerInitInfo",
    "SourceMismatchError",
    "StaleRoundError",
    "SyncTrainerEngine",
    "TcpTrainerEngine",
    "TcpTrainerInitInfo",
    "TcpUpdateInfo",
    "TcpWorkerEngine",
    "TcpWorkerInitInfo",
    "TorchDistTrainerInitInfo",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "TransferAbortedError",
    "TransferError",
    "TransferPlan",
    "TransferTimeoutError",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdatePayload",
    "WeightTransferUpdateRequest",
    "create_worker_engine",
    "layerwise_groups",
    "materialize_full_tensor",
    "model_checksum",
    "register_trainer_engine",
    "register_worker_engine",
    "registered_backends",
    "trainer_init",
]
