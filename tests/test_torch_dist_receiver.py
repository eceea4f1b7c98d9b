"""torch_dist's receiver loop on its own: an ABORT read while a bucket is in flight.

The receiver watches the link for the next header while the oldest bucket's
broadcasts run, and lends itself a receive buffer before reading it. The collective
and the link are stand-ins here, so the abort can arrive at exactly that point; the
multi-process suites (`test_backends`, `test_faults`) run the real group.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncwt._backends import torch_dist as _torch_dist
from asyncwt._core.errors import TransferAbortedError
from asyncwt._core.plan import TransferPlan
from asyncwt._core.source import ModuleSource
from asyncwt._transports.pool import ReceivePool

BUFFERS = 2


class _PendingWork:
    """A broadcast that stays in flight until waited for."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: object = None) -> bool:
        return True


class _AbortingLink:
    """Announces bucket 0, then the trainer's ABORT; its socket always has bytes."""

    def __init__(self) -> None:
        self.sock, self._peer = socket.socketpair()
        self._peer.send(b"x")

    def frames(self, round_id: int, after_ready: Any = None) -> Iterator[Any]:
        yield SimpleNamespace(index=0)
        raise TransferAbortedError("the trainer aborted", buckets_received=1)

    def close(self) -> None:
        self.sock.close()
        self._peer.close()


def _receiver(plan: TransferPlan, pool: ReceivePool) -> _torch_dist.TorchDistReceiver:
    receiver = object.__new__(_torch_dist.TorchDistReceiver)
    receiver.info = SimpleNamespace(direct_bytes=None, recv_timeout=5.0, group_backend="gloo")  # type: ignore[assignment]
    receiver.plan = plan
    receiver.pool = pool
    receiver.group = object()  # type: ignore[assignment]
    receiver.store = object()  # type: ignore[assignment]
    receiver._side = None  # gloo: no device stream to wait on
    return receiver


def test_an_abort_read_ahead_returns_every_receive_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=4096)
    assert len(plan.buckets) >= 2
    monkeypatch.setattr(
        _torch_dist, "_start_all", lambda group, tensors, side: [_PendingWork() for _ in tensors]
    )
    pool = ReceivePool(BUFFERS, plan.bucket_bytes, torch.device("cpu"), 5.0, on_device=False)
    receiver = _receiver(plan, pool)
    target = SimpleNamespace(direct=[False] * len(plan.params))
    link = _AbortingLink()
    try:
        with pytest.raises(TransferAbortedError):
            list(receiver._receive(link, 1, target))  # type: ignore[arg-type]
    finally:
        link.close()
    assert receiver.group is not None, "an abort keeps the group: the two sides are in step"
    taken = [pool.try_take() for _ in range(BUFFERS)]
    assert all(t is not None for t in taken), "a receive buffer was not returned"
