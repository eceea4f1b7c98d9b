"""Delta rounds over `"shm"` (`delta=True`), across real processes.

A coded bucket goes inline on the link as a DELTA frame; a bucket that codes raw,
and every bucket of a full round, goes the shm way (the worker reads it from the
trainer's memory, or from the ring with `direct_reads=False`). As for tcp, two
workers serve every case: one whose base is its live weights, one with a
transform (its base a shadow copy); every round is checked bit-exact on both.
"""

from __future__ import annotations

import random
import socket
import subprocess
from collections.abc import Iterator

import _models
import anyio
import pytest
import torch
from _faults import (
    FaultySource,
    assert_worker_has,
    info_for,
    shm_leftovers,
    worker_env,
)
from test_delta import (
    both_workers,
    cancelled_rounds,
    delta_trajectory,
    digest_failure_then_full,
    is_delta,
    nudge,
    uvloop_only,
)

from asyncwt import (
    AsyncwtError,
    Delta,
    HttpClient,
    LocalClient,
    ModuleSource,
    ShmTrainerInitInfo,
    WeightTransferConfig,
    create_worker_engine,
    model_checksum,
    trainer_init,
)
from asyncwt._backends.shm.backend import ShmSender
from asyncwt._delta.links import DeltaLinks
from asyncwt._transports.link import Peer
from asyncwt._worker.launch import worker_process

SEED = 20261203

Workers = list[tuple[subprocess.Popen[bytes], str]]


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    yield from both_workers("shm")
    assert not shm_leftovers()


def shm_delta_info(
    full_every: int = 0, policy: str = "always", **kwargs: object
) -> ShmTrainerInitInfo:
    # policy "always" (the default here): every round that can be a delta is one
    info = info_for("shm", delta=Delta(full_every=full_every, policy=policy), **kwargs)
    assert isinstance(info, ShmTrainerInitInfo)
    return info


def _sender(engine: object) -> ShmSender:
    """The shm sender inside the delta layer that is the engine's transport."""
    return _inner(engine.transport)  # type: ignore[attr-defined]


def _inner(transport: object) -> ShmSender:
    assert isinstance(transport, DeltaLinks)
    assert isinstance(transport.inner, ShmSender)
    return transport.inner


@uvloop_only
@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "ring"])
async def test_shm_delta_rounds_are_bit_exact_and_small(
    workers: Workers, direct_reads: bool
) -> None:
    info = shm_delta_info(full_every=4, direct_reads=direct_reads)
    sender = _inner(await delta_trajectory([url for _, url in workers], info))
    assert isinstance(sender, ShmSender)
    assert [p.reads_directly for p in sender.links.peers] == [direct_reads] * 2


@uvloop_only
async def test_shm_auto_policy_rounds_are_bit_exact(workers: Workers) -> None:
    """On one host the encoder is slower than a memcpy: auto may send full rounds,
    and whatever it chooses, every round is bit-exact."""
    urls = [url for _, url in workers]
    async with HttpClient(urls) as client:
        model = _models.mixed()
        _models.randomize(model, seed=2)
        info = shm_delta_info(policy="auto")
        engine = await trainer_init(info, client=client, source=ModuleSource(model))
        async with engine:
            for i in range(4):
                nudge(model, seed=20 + i, fraction=0.01)
                stats = await engine.send_weights(weight_version=f"auto-{i}")
                assert 0 < stats.wire_bytes <= stats.bytes
                await assert_worker_has(client, model, f"auto-{i}")


@uvloop_only
@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "ring"])
async def test_a_shm_worker_whose_base_differs_fails_the_digest_then_gets_a_full_round(
    workers: Workers, direct_reads: bool
) -> None:
    info = shm_delta_info(direct_reads=direct_reads)
    await digest_failure_then_full([url for _, url in workers], info)


@uvloop_only
@pytest.mark.slow
async def test_shm_deltas_to_a_direct_reader_and_a_ring_reader() -> None:
    """A round with both kinds of worker packs every bucket into the ring: a coded
    bucket still goes inline to both, a raw one through the ring slot."""
    args = ("--backend", "shm", "--transform", "_models:identity_transform")
    with (
        worker_process("_models:mixed", *args, env=worker_env()) as direct_url,
        worker_process("_models:mixed_reading_the_ring", *args, env=worker_env()) as ring_url,
    ):
        async with HttpClient([direct_url, ring_url]) as client:
            model = _models.mixed()
            _models.randomize(model, seed=7)
            info = shm_delta_info(workers=2)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                kinds = []
                for i in range(4):
                    nudge(model, seed=70 + i, fraction=0.9 if i == 2 else 0.01)
                    stats = await engine.send_weights(weight_version=f"m{i}")
                    await assert_worker_has(client, model, f"m{i}")
                    kinds.append(is_delta(stats))
                sender = _sender(engine)
                assert not sender.direct
                assert sorted(p.reads_directly for p in sender.links.peers) == [False, True]
                assert kinds == [False, True, False, True]
    assert not shm_leftovers()


class CuttingSource(FaultySource):
    """`FaultySource` that cuts one worker's link (both ways) as it yields `cut_at`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.cut_at: str | None = None
        self.victim: Peer | None = None

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in super().iter_full():
            if name == self.cut_at and self.victim is not None:
                self.victim.sock.shutdown(socket.SHUT_RDWR)
            yield name, tensor


CUTS = 4


@uvloop_only
@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "ring"])
async def test_a_shm_delta_round_cut_at_seeded_points_publishes_nothing_and_recovers(
    workers: Workers, direct_reads: bool
) -> None:
    rng = random.Random(SEED + 2 + direct_reads)
    urls = [url for _, url in workers]
    model = _models.mixed()
    names = [name for name, _ in model.named_parameters()]
    source = CuttingSource(model)
    async with HttpClient(urls) as client:
        for i in range(CUTS):
            info = shm_delta_info(direct_reads=direct_reads)
            engine = await trainer_init(info, client=client, source=source)
            async with engine:
                _models.randomize(model, seed=100 + i)
                await engine.send_weights(weight_version=f"full-{i}")
                nudge(model, seed=200 + i, fraction=0.01)
                assert is_delta(await engine.send_weights(weight_version=f"good-{i}"))
                await assert_worker_has(client, model, f"good-{i}")
                source.cut_at = rng.choice(names)
                source.victim = rng.choice(_sender(engine).links.peers)
                nudge(model, seed=300 + i, fraction=0.01)
                try:
                    with anyio.fail_after(15), pytest.raises(AsyncwtError):
                        await engine.send_weights(weight_version=f"cut-{i}")
                finally:
                    source.cut_at = source.victim = None
                for status in await client.weights_status(checksum=True):
                    assert status["weight_version"] == f"good-{i}"
            # A new init (a link broke): its first round is full and bit-exact.
            engine = await trainer_init(info, client=client, source=source)
            async with engine:
                stats = await engine.send_weights(weight_version=f"after-{i}")
                assert stats.wire_bytes == stats.bytes
                await assert_worker_has(client, model, f"after-{i}")
                nudge(model, seed=400 + i, fraction=0.01)
                assert is_delta(await engine.send_weights(weight_version=f"next-{i}"))
                await assert_worker_has(client, model, f"next-{i}")
    assert not shm_leftovers()


CANCELS = 6


@uvloop_only
@pytest.mark.parametrize("direct_reads", [True, False], ids=["direct", "ring"])
async def test_a_shm_delta_round_cancelled_at_seeded_points_leaves_the_previous_version(
    workers: Workers, direct_reads: bool
) -> None:
    info = shm_delta_info(direct_reads=direct_reads)
    urls = [url for _, url in workers]
    kinds = await cancelled_rounds(urls, info, SEED + direct_reads, CANCELS)
    print(f"rounds after a cancel that went as deltas: {kinds}")
    assert not shm_leftovers()


@uvloop_only
async def test_a_ring_worker_keeps_its_base_in_its_parameters_where_they_hold_the_wire_bytes() -> (
    None
):
    """The ring lands nothing in place, yet a host parameter of the wire dtype holds the
    bytes once applied: only the rest is shadowed, and rounds stay bit-exact."""
    worker = create_worker_engine(WeightTransferConfig(backend="shm"), model=_models.mixed())
    model = _models.mixed()
    _models.randomize(model, seed=13)
    info = shm_delta_info(direct_reads=False)
    engine = await trainer_init(info, client=LocalClient([worker]), source=ModuleSource(model))
    try:
        kinds = []
        for i in range(3):
            nudge(model, seed=130 + i, fraction=0.01)
            kinds.append(is_delta(await engine.send_weights(weight_version=f"r{i}")))
            assert model_checksum(worker.model) == model_checksum(model)
        assert kinds == [False, True, True]
        assert not worker.receiver.reads_directly
        # Only bucket 0 holds a parameter the model does not keep as wire bytes (a
        # non-contiguous one): the big parameter's buckets need no shadow.
        assert worker._delta.shadow_bytes == engine.plan.buckets[0].buffer_bytes
        assert worker._delta.shadow_bytes < engine.plan.total_bytes / 10
    finally:
        await engine.shutdown()
        worker.shutdown()
