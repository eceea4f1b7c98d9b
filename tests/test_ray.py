"""RayClient and the worker actor, through real Ray actors on a local Ray cluster.

One Ray instance serves the module (2 CPUs, a small object store); the actors take no
CPU of it, so that several fit. The weights go over asyncwt's tcp transport, never
through Ray. Marked `ray`: they need Ray (`pip install 'asyncwt[ray]'`); without it
they are skipped, unless `ASYNCWT_REQUIRE_RAY=1` (as in CI), where they fail.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import _models
import anyio
import pytest
import torch
from _faults import SMALL_TIMEOUTS, TESTS, wait_until

import asyncwt
from asyncwt import (
    ControlPlaneError,
    ModuleSource,
    ParamMeta,
    RayClient,
    SyncTrainerEngine,
    TcpTrainerInitInfo,
    WeightSource,
    model_checksum,
    trainer_init,
)
from asyncwt._worker.ray_actor import WorkerActor, worker_actor

pytestmark = pytest.mark.ray

needs_ray = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None and os.environ.get("ASYNCWT_REQUIRE_RAY") != "1",
    reason="Ray is not installed (pip install 'asyncwt[ray]'); ASYNCWT_REQUIRE_RAY=1 fails instead",
)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    import ray

    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 << 20,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},  # the actors import tests/_models
    )
    try:
        yield ray
    finally:
        ray.shutdown()


def spawn_workers(count: int) -> list[Any]:
    """`count` worker actors, started (their model built) before this returns."""
    import ray

    actors = [worker_actor(num_cpus=0).remote(_models.mixed) for _ in range(count)]
    ray.get([actor.get_weight_version.remote() for actor in actors], timeout=60)
    return actors


def info(**kwargs: Any) -> TcpTrainerInitInfo:
    return TcpTrainerInitInfo(rank=0, bucket_bytes=_models.BUCKET_BYTES, **kwargs)


def perturb(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            param.copy_(torch.full_like(param, step + index / 8))


async def statuses(client: RayClient) -> list[tuple[Any, ...]]:
    return [
        (s["weight_version"], s["checksum"], s["weights_incomplete"])
        for s in await client.weights_status(checksum=True)
    ]


@pytest.fixture(scope="module")
def two_workers(ray_cluster: Any) -> list[Any]:
    return spawn_workers(2)


@needs_ray
@pytest.mark.asyncio
async def test_ray_client_pushes_bit_exact_rounds_to_two_worker_actors(
    two_workers: list[Any],
) -> None:
    client = RayClient(two_workers, timeout=60)
    assert isinstance(client, asyncwt.AsyncWeightSyncClient)
    model = _models.mixed()
    engine = await trainer_init(info(), client=client, source=ModuleSource(model))
    async with engine:
        for step in (1, 2, 3):
            perturb(model, step)
            await engine.send_weights(weight_version=f"step-{step}")
            expected = (f"step-{step}", model_checksum(model), False)
            assert await statuses(client) == [expected, expected]
    await client.shutdown()
    assert [s["initialized"] for s in await client.weights_status(checksum=True)] == [False, False]


@needs_ray
def test_sync_trainer_engine_pushes_through_ray_client(two_workers: list[Any]) -> None:
    client = RayClient(two_workers, timeout=60)
    model = _models.mixed()
    perturb(model, 7)
    with SyncTrainerEngine(info(), client=client, source=ModuleSource(model)) as engine:
        engine.send_weights(weight_version="sync-1")
    expected = ("sync-1", model_checksum(model), False)
    assert anyio.run(statuses, client) == [expected, expected]


class GatedSource(WeightSource):
    """`ModuleSource` that stops before its second tensor until `gate` opens: a round
    held open midway, with every worker in `update_weights`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.inner = ModuleSource(model)
        self.gated = False
        self.reached = threading.Event()
        self.gate = threading.Event()

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, pair in enumerate(self.inner.iter_full()):
            if self.gated and index == 1:
                self.reached.set()
                self.gate.wait(timeout=30)
            yield pair


class WatchedClient(RayClient):
    """Says when the trainer engine called `update_weights`: every actor started the
    round, and the updates are in flight."""

    def __init__(self, actors: list[Any]) -> None:
        super().__init__(actors, timeout=60)
        self.updating = threading.Event()

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        self.updating.set()
        await super().update_weights(update_info)


@needs_ray
@pytest.mark.asyncio
async def test_ray_actor_killed_mid_round_fails_the_round_naming_it_and_publishes_nothing(
    ray_cluster: Any,
) -> None:
    ray = ray_cluster
    doomed, survivor = spawn_workers(2)
    client = WatchedClient([doomed, survivor])
    model = _models.mixed()
    source = GatedSource(model)
    engine = await trainer_init(info(timeouts=SMALL_TIMEOUTS), client=client, source=source)
    async with engine:
        perturb(model, 1)
        await engine.send_weights(weight_version="v1")
        published = await statuses(client)

        perturb(model, 2)
        source.gated = True
        client.updating.clear()

        # Ray tells the trainer of the death within this time; the data plane is idle
        # meanwhile, so the control plane is the one to notice.
        reopen = threading.Timer(3.0, source.gate.set)

        def kill_mid_round() -> None:
            wait_until(source.reached.is_set, 30, "the round to reach its second tensor")
            wait_until(client.updating.is_set, 30, "the round's update_weights")
            time.sleep(0.2)  # let the calls reach the actors
            ray.kill(doomed)
            reopen.start()

        killer = threading.Thread(target=kill_mid_round)
        killer.start()
        try:
            with pytest.raises(ControlPlaneError) as failure:
                await engine.send_weights(weight_version="v2")
        finally:
            source.gate.set()
            killer.join()
            reopen.cancel()
    actor_id = doomed._actor_id.hex()
    assert f"update_weights on WorkerActor actor {actor_id} failed: ActorDiedError: " in str(
        failure.value
    )
    [(version, checksum, incomplete)] = await statuses(RayClient(survivor))
    assert version == "v1"  # nothing published
    assert incomplete or checksum == published[1][1]
    ray.kill(survivor)


@needs_ray
@pytest.mark.asyncio
async def test_ray_client_sends_vllm_actors_the_payloads_of_vllms_ray_client(
    ray_cluster: Any,
) -> None:
    ray = ray_cluster

    class VLLMLike:
        """Records calls as vLLM's `LLM` takes them (request objects, no round ids)."""

        def __init__(self) -> None:
            self.calls: list[tuple[str, Any]] = []

        def init_weight_transfer_engine(self, request: Any) -> None:
            self.calls.append(("init", request.init_info))

        def start_weight_update(self) -> None:
            self.calls.append(("start", None))

        def update_weights(self, request: Any) -> None:
            self.calls.append(("update", request.update_info))

        def finish_weight_update(self, weight_version: str | None = None) -> None:
            self.calls.append(("finish", weight_version))

        def update_weight_version(self, version: str) -> None:
            self.calls.append(("version", version))

        def shutdown_weight_transfer_engine(self) -> None:
            self.calls.append(("shutdown", None))

        def recorded(self) -> list[tuple[str, Any]]:
            return self.calls

    actor = ray.remote(num_cpus=0)(VLLMLike).remote()
    client = RayClient(actor)
    await client.init_weight_transfer_engine({"host": "h"})
    await client.start_weight_update(round_id=1, trainer_id="t")
    await client.update_weights({"round_id": 1})
    await client.finish_weight_update("v1", round_id=1, trainer_id="t")
    await client.shutdown()
    assert await actor.recorded.remote() == [
        ("init", {"host": "h"}),
        ("start", None),
        ("update", {"round_id": 1}),
        ("finish", None),
        ("version", "v1"),
        ("shutdown", None),
    ]
    with pytest.raises(TypeError, match=r"^VLLMLike actor \w+ has no weights_status method"):
        await client.weights_status(checksum=True)
    ray.kill(actor)


@needs_ray
@pytest.mark.asyncio
async def test_ray_client_pauses_vllm_actors_around_a_round_and_resumes_after_a_failure(
    ray_cluster: Any,
) -> None:
    ray = ray_cluster

    class PausableVLLM:
        """vLLM's `AsyncLLM` as far as pausing goes; `update_weights` fails when told."""

        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []

        def pause_generation(self, *, mode: str, clear_cache: bool) -> None:
            self.calls.append(("pause", mode, clear_cache))

        def resume_generation(self) -> None:
            self.calls.append(("resume",))

        def start_weight_update(self) -> None:
            self.calls.append(("start",))

        def update_weights(self, request: Any) -> None:
            self.calls.append(("update",))
            if request.update_info.get("fail"):
                raise RuntimeError("boom")

        def finish_weight_update(self) -> None:
            self.calls.append(("finish",))

        def update_weight_version(self, version: str) -> None:
            self.calls.append(("version", version))

        def recorded(self) -> list[tuple[Any, ...]]:
            return self.calls

    actor = ray.remote(num_cpus=0)(PausableVLLM).remote()
    client = RayClient(actor, pause="keep")
    await client.start_weight_update()
    await client.update_weights({})
    await client.finish_weight_update("v1")
    assert client.paused_s is not None and client.paused_s > 0
    await client.start_weight_update()
    with pytest.raises(ControlPlaneError, match=r"update_weights on PausableVLLM .*boom"):
        await client.update_weights({"fail": True})
    round_trip = [("pause", "keep", True), ("start",), ("update",)]
    assert await actor.recorded.remote() == [
        *round_trip,
        ("finish",),
        ("version", "v1"),
        ("resume",),
        *round_trip,
        ("resume",),
    ]
    ray.kill(actor)


@needs_ray
def test_ray_client_refuses_what_is_not_an_actor_handle(ray_cluster: Any) -> None:
    with pytest.raises(TypeError, match=r"^actors should be Ray actor handles .* got WorkerActor$"):
        RayClient(WorkerActor.__new__(WorkerActor))
    with pytest.raises(ValueError, match=r"^actors should hold at least one Ray actor handle"):
        RayClient([])


def test_ray_client_without_ray_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees when it is absent
    with pytest.raises(ImportError, match=r"pip install 'asyncwt\[ray\]'$"):
        RayClient([])
