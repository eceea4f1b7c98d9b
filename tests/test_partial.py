"""A trainer whose model lacks some of the worker's parameters (issue 32, finding 7).

The worker is an `asyncwt worker` process holding `_models.mixed()`; the trainer's
model is the same without `tail`. Without an opt-in the init fails naming what
would stay stale; with `partial=True` rounds publish and the worker's status names
the parameters each version left as they were. `LocalClient` takes the same path.
"""

from __future__ import annotations

import re

import _models
import pytest
import torch
from _faults import info_for, worker_env

from asyncwt import (
    ControlPlaneError,
    HttpClient,
    LocalClient,
    ModuleSource,
    PlanMismatchError,
    WeightTransferConfig,
    create_worker_engine,
    trainer_init,
)
from asyncwt._core.checksum import model_checksum
from asyncwt._worker.launch import worker_process

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])

REFUSAL = (
    "the trainer never sends 1 of the worker's 8 parameters ('tail'): every version would "
    "leave them stale. Send them (is the trainer's model the worker's?), or opt in to "
    "updating part of the model with partial=True in the trainer's init info"
)


def without_tail(seed: int) -> torch.nn.Module:
    """`_models.mixed()` with random values and no `tail` parameter."""
    model = _models.mixed()
    _models.randomize(model, seed=seed)
    del model.tail
    return model


def with_worker_tail(model: torch.nn.Module) -> torch.nn.Module:
    """What the worker holds after `model` was sent: its values, and its own `tail`."""
    expected = _models.mixed()
    expected.load_state_dict(model.state_dict(), strict=False)
    return expected


@uvloop_only
@pytest.mark.slow
async def test_a_trainer_missing_a_worker_parameter_fails_its_init_naming_it() -> None:
    model = without_tail(seed=1)
    with worker_process("_models:mixed", env=worker_env()) as url:
        async with HttpClient(url, timeout=30) as client:
            with pytest.raises(ControlPlaneError) as refused:
                await trainer_init(info_for("tcp"), client=client, source=ModuleSource(model))
            (status,) = await client.weights_status()
    assert re.search(r"HTTP 409: PlanMismatchError: (.*)$", str(refused.value))
    assert str(refused.value).endswith(f"PlanMismatchError: {REFUSAL}")
    assert (status["initialized"], status["weight_version"]) == (False, None)


@uvloop_only
@pytest.mark.slow
async def test_with_partial_the_rounds_publish_and_status_names_what_they_left() -> None:
    model = without_tail(seed=2)
    with worker_process("_models:mixed", env=worker_env()) as url:
        async with HttpClient(url, timeout=30) as client:
            info = info_for("tcp", partial=True)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                for seed in (3, 4):
                    _models.randomize(model, seed=seed)
                    await engine.send_weights(weight_version=f"v{seed}")
                    (status,) = await client.weights_status(checksum=True)
                    assert status["weight_version"] == f"v{seed}"
                    assert status["untouched_params"] == ["tail"]
                    assert status["checksum"] == model_checksum(with_worker_tail(model))


@uvloop_only
async def test_a_local_client_refuses_a_trainer_missing_a_parameter_the_same_way() -> None:
    config = WeightTransferConfig(backend="tcp")
    worker = create_worker_engine(config, model=_models.mixed(), device=torch.device("cpu"))
    client = LocalClient([worker])
    try:
        with pytest.raises(PlanMismatchError, match=f"^{re.escape(REFUSAL)}$"):
            await trainer_init(info_for("tcp"), client=client, source=ModuleSource(without_tail(5)))
    finally:
        await client.shutdown()


def test_partial_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="^partial should be a bool, got 'yes'$"):
        info_for("tcp", partial="yes")
