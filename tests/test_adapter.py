"""Adapter-only rounds (`AdapterSource`) into asyncwt's own worker, in another process.

The worker (tests/_adapter_models.py) serves a small base model; the trainer holds a
PEFT-shaped LoRA model over it. After each adapter round the worker's output must
equal the merged model's (W + scale * B @ A), twice, and still after a base round.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import _adapter_models as am
import aiohttp
import pytest
import torch

from asyncwt import (
    AdapterSource,
    ControlPlaneError,
    HttpClient,
    ModuleSource,
    TcpTrainerInitInfo,
    trainer_init,
)
from asyncwt._core.adapter import AdapterConfig

TESTS = Path(__file__).resolve().parent


@pytest.fixture
def worker_url() -> Iterator[str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    )
    proc = subprocess.Popen(
        [sys.executable, str(TESTS / "_adapter_models.py")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("URL "), f"worker did not start: {line!r}"
        yield line.split()[1]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


async def served(url: str) -> torch.Tensor:
    async with aiohttp.ClientSession() as session, session.get(url + "/probe") as response:
        assert response.status == 200
        return torch.tensor(await response.json())


def expected(model: am.PeftLike, base: am.Base) -> torch.Tensor:
    with torch.no_grad():
        return am.merged(model, base)(am.PROBE)


@pytest.mark.asyncio
@pytest.mark.parametrize("delta", [False, True])
async def test_adapter_rounds_serve_the_merged_model_twice_and_after_a_base_round(
    worker_url: str, delta: bool
) -> None:
    peft = am.peft_like(seed=1)
    source = AdapterSource(peft, name="policy")
    assert all(".lora_" in m.name and ".default." not in m.name for m in source.metadata)
    adapter_bytes = sum(m.nbytes for m in source.metadata)
    base = am.base(0)
    before = await served(worker_url)
    torch.testing.assert_close(before, base(am.PROBE).detach())
    async with HttpClient(worker_url) as client:
        info = TcpTrainerInitInfo(rank=0, delta=delta)
        engine = await trainer_init(info, client=client, source=source)
        async with engine:
            stats = await engine.send_weights(weight_version="a1")
            assert stats.bytes == adapter_bytes  # only the adapter travels
            first = expected(peft, base)
            torch.testing.assert_close(await served(worker_url), first)
            assert not torch.allclose(first, before, atol=1e-3)

            am.reseed_adapter(peft, seed=2)
            await engine.send_weights(weight_version="a2")
            second = expected(peft, base)
            torch.testing.assert_close(await served(worker_url), second)
            assert not torch.allclose(first, second, atol=1e-3)

        new_base = am.base(seed=7)
        base_engine = await trainer_init(
            TcpTrainerInitInfo(rank=0), client=client, source=ModuleSource(new_base)
        )
        async with base_engine:
            await base_engine.send_weights(weight_version="b1")
        # the adapter stays applied, on top of the new base
        torch.testing.assert_close(await served(worker_url), expected(peft, new_base))


@pytest.mark.asyncio
async def test_an_adapter_that_does_not_fit_the_model_fails_the_init(worker_url: str) -> None:
    peft = am.peft_like(seed=1)
    source = AdapterSource(peft, name="policy")
    source.config = AdapterConfig("policy", r=8, lora_alpha=8.0, target_modules=("q_proj",))
    async with HttpClient(worker_url) as client:
        with pytest.raises(ControlPlaneError, match=r"PlanMismatchError: .*rank 8"):
            await trainer_init(TcpTrainerInitInfo(rank=0), client=client, source=source)


def test_adapter_source_refuses_a_model_without_that_adapter() -> None:
    with pytest.raises(ValueError, match=r"adapter 'other' in its peft_config"):
        AdapterSource(am.peft_like(seed=1), name="policy", adapter="other")
    with pytest.raises(ValueError, match=r"peft_config"):
        AdapterSource(am.base(), name="policy")
    with pytest.raises(ValueError, match=r"r should be a positive int, got 0"):
        AdapterConfig("x", r=0, lora_alpha=1.0, target_modules=("q_proj",))


def test_the_collected_adapter_is_a_copy_of_what_arrived() -> None:
    from asyncwt._core.plan import TransferPlan
    from asyncwt._worker.adapters import AdapterCollector

    source = AdapterSource(am.peft_like(seed=1), name="policy")
    collector = AdapterCollector(TransferPlan.build(source.metadata))
    arrived = [(name, tensor.clone()) for name, tensor in source.iter_full()]
    collector.load_weights(arrived)
    for _, tensor in arrived:  # the receive buffer is reused by the next round
        tensor.zero_()
    collected = collector.take()
    for name, tensor in source.iter_full():
        torch.testing.assert_close(collected[name], tensor)
    with pytest.raises(ValueError, match=r"lacks 8 tensors"):
        collector.take()  # a round hands over its tensors once
