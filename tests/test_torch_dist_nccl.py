"""torch_dist over NCCL: what differs from gloo. NCCL needs a GPU per rank, so only
the checks that need no group run in CI; the rest are marked `cuda` (and the one
that forms a group needs two GPUs: NCCL refuses two ranks on one)."""

from __future__ import annotations

import os
from pathlib import Path

import _models
import pytest
import torch

from asyncwt import (
    ControlPlaneError,
    HttpClient,
    ModuleSource,
    TorchDistTrainerInitInfo,
    TorchDistWorkerInitInfo,
    trainer_init,
)
from asyncwt._backends import torch_dist as _torch_dist
from asyncwt._backends.torch_dist import gpu_uuid
from asyncwt._core.plan import TransferPlan
from asyncwt._worker.launch import worker_process

TESTS = Path(__file__).resolve().parent


def _worker_info(**overrides: object) -> TorchDistWorkerInitInfo:
    plan = TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=1 << 20)
    fields: dict[str, object] = {
        "plan": plan.to_wire(), "host": "127.0.0.1", "port": 1, "token": "t",
        "store_port": 2, "group_key": "k" * 32, "group_backend": "nccl",
    }  # fmt: skip
    fields.update(overrides)
    return TorchDistWorkerInitInfo(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [5, "", "u" * 65])
def test_trainer_gpu_is_checked_by_name(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"^trainer_gpu should be None or a GPU UUID of 1-64 characters"
    ):
        _worker_info(trainer_gpu=value)


def test_off_cuda_there_is_no_gpu_to_compare() -> None:
    assert gpu_uuid(torch.device("cpu")) is None


class _StreamOnlyWork:
    """What NCCL's `Work.wait` does: order the calling thread's current stream after
    the collective (here: whatever `producer` queued), without blocking the host."""

    def __init__(self, producer: torch.cuda.Stream, device: torch.device) -> None:
        self.producer, self.device = producer, device

    def wait(self) -> bool:
        torch.cuda.current_stream(self.device).wait_stream(self.producer)
        return True


@pytest.mark.cuda
def test_waiting_for_device_collectives_blocks_the_host_until_they_are_over() -> None:
    """A staging slot is packed again, and a receive buffer read by apply threads, on
    other streams than the one `wait` orders: `_wait_all` must return only once the
    collective is over on the device."""
    device = torch.device("cuda", torch.cuda.current_device())
    producer = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    for wait_for, over_on_return in ((None, False), (_torch_dist._side_stream(device), True)):
        with torch.cuda.stream(producer):
            torch.cuda._sleep(1 << 30)  # type: ignore[attr-defined] # a collective still running
        _torch_dist._wait_all([_StreamOnlyWork(producer, device)], wait_for)  # type: ignore[list-item]
        assert producer.query() is over_on_return
        producer.synchronize()


@pytest.mark.cuda
@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_a_worker_on_the_trainers_gpu_fails_its_init_saying_so() -> None:
    """NCCL would refuse the pair at the first round's group rendezvous, with an
    "invalid usage" error; the worker's init says what is wrong instead."""
    env = dict(os.environ, PYTHONPATH=str(TESTS))
    with worker_process("_models:mixed_cuda", "--backend", "torch_dist", env=env) as url:
        async with HttpClient(url) as client:
            model = _models.mixed_cuda()
            info = TorchDistTrainerInitInfo(
                rank=0, device="cuda", group_backend="nccl", bucket_bytes=_models.BUCKET_BYTES
            )
            with pytest.raises(ControlPlaneError, match=r"needs this worker on a GPU other than"):
                await trainer_init(info, client=client, source=ModuleSource(model))
