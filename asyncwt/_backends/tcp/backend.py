"""The `"tcp"` backend as the engines take it, and its engine classes.

Rank 0 listens during `trainer_init` only; each worker connects and proves the
token while its `init_weight_transfer_engine` call runs. Each round, every worker
receives every bucket over its own connection, all concurrently (`Star()`), or the
trainer sends each bucket once and the workers pass it on (`Chain()`, see
`chain` and `relay`). With `fanout=Chain()` or `on_worker_failure="drop"` the
workers are tracked one by one by the fleet layer (`fleet`).
"""

from __future__ import annotations

import torch

from ..._core.plan import TransferPlan
from ..._core.round_plan import BackendFeatures
from ..._trainer.engine import trainer_engine_class
from ..._transports.backend import TransportBackend
from ..._transports.base import SenderTransport
from ..._worker.engine import worker_engine_class
from .chain import SENDERS
from .fleet import open_fleet
from .sender import TcpSender
from .settings import TcpTrainerInitInfo, TcpWorkerInitInfo
from .worker import make_receiver

__all__ = ["TCP", "TcpTrainerEngine", "TcpWorkerEngine"]


def make_sender(
    info: TcpTrainerInitInfo, plan: TransferPlan, device: torch.device
) -> SenderTransport:
    """Rank 0's sender: one per tracked fleet's fan-out, or the plain star."""
    if info.tracks_members:
        return SENDERS[info.fanout.name](info, plan)
    return TcpSender(info, plan)


TCP = TransportBackend(
    name="tcp",
    trainer_info=TcpTrainerInitInfo,
    worker_info=TcpWorkerInitInfo,
    sender=make_sender,
    receiver=make_receiver,
    features=BackendFeatures(
        senders=("rank0", "owners"),
        routes=("star", "chain"),
        codecs=("raw", "delta"),
        receivers=("whole", "sliced"),
    ),
    fleet=open_fleet,
)

TcpTrainerEngine = trainer_engine_class(TCP, name="TcpTrainerEngine", module=__name__)
TcpWorkerEngine = worker_engine_class(TCP, name="TcpWorkerEngine", module=__name__)
