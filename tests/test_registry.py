"""Backend registries: registering engines and dispatching on the backend name."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

import asyncwt
from asyncwt import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferConfig,
    WeightTransferEngine,
    create_worker_engine,
    register_trainer_engine,
    register_worker_engine,
    registered_backends,
    trainer_init,
)
from asyncwt._core import registry as _registry


@pytest.fixture(autouse=True)
def isolated_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Give each test copies of the registries, so test backends never leak."""
    monkeypatch.setattr(_registry, "_TRAINER_ENGINES", dict(_registry._TRAINER_ENGINES))
    monkeypatch.setattr(_registry, "_WORKER_ENGINES", dict(_registry._WORKER_ENGINES))


@dataclass
class _FakeInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "test-registry-fake"

    endpoint: str = "tcp://127.0.0.1:0"


@dataclass
class _OtherInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "test-registry-other"


class _Client:
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


class _FakeTrainerEngine(TrainerWeightTransferEngine[_FakeInitInfo]):
    init_info_cls = _FakeInitInfo

    def __init__(self, init_info: _FakeInitInfo, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init_info = init_info

    @classmethod
    async def trainer_init(
        cls, init_info: _FakeInitInfo, *, client: Any, source: WeightSource | None = None
    ) -> _FakeTrainerEngine:
        return cls(
            init_info,
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            rank=init_info.rank,
        )

    async def send_weights(self, **kwargs: Any) -> None:
        return None


class _OtherTrainerEngine(_FakeTrainerEngine):
    pass


class _FakeWorkerEngine(WeightTransferEngine[Any, Any]):
    init_info_cls = dict
    update_info_cls = dict

    def init_transfer_engine(self, init_info: Any) -> None: ...

    def start_weight_update(self) -> None: ...

    def finish_weight_update(self) -> None: ...

    def receive_weights(self, update_info: Any) -> None: ...

    def shutdown(self) -> None: ...


class _OtherWorkerEngine(_FakeWorkerEngine):
    pass


class _Source(WeightSource):
    @cached_property
    def metadata(self) -> list[asyncwt.ParamMeta]:
        return []


def _known(registry: dict[str, Any]) -> str:
    return re.escape(", ".join(repr(b) for b in sorted(registry)) or "none")


def test_register_trainer_engine_adds_the_backend() -> None:
    register_trainer_engine("test-registry-fake", _FakeTrainerEngine)

    assert _registry._TRAINER_ENGINES["test-registry-fake"] is _FakeTrainerEngine
    assert "test-registry-fake" in registered_backends()["trainer"]
    assert "test-registry-fake" not in registered_backends()["worker"]


def test_register_worker_engine_adds_the_backend() -> None:
    register_worker_engine("test-registry-worker", _FakeWorkerEngine)

    assert _registry._WORKER_ENGINES["test-registry-worker"] is _FakeWorkerEngine
    assert "test-registry-worker" in registered_backends()["worker"]
    assert "test-registry-worker" not in registered_backends()["trainer"]


def test_registered_backends_are_sorted() -> None:
    register_worker_engine("test-registry-b", _FakeWorkerEngine)
    register_worker_engine("test-registry-a", _OtherWorkerEngine)

    backends = registered_backends()

    assert backends["worker"] == sorted(backends["worker"])
    assert backends["trainer"] == sorted(backends["trainer"])
    assert {"test-registry-a", "test-registry-b"} <= set(backends["worker"])


def test_registries_are_isolated_between_tests() -> None:
    assert "test-registry-fake" not in _registry._TRAINER_ENGINES
    assert "test-registry-worker" not in _registry._WORKER_ENGINES


def test_register_trainer_engine_twice_is_value_error() -> None:
    register_trainer_engine("test-registry-fake", _FakeTrainerEngine)

    with pytest.raises(
        ValueError,
        match=r"^trainer engine backend 'test-registry-fake' is already registered "
        r"\(to _FakeTrainerEngine\); got _OtherTrainerEngine for it too$",
    ):
        register_trainer_engine("test-registry-fake", _OtherTrainerEngine)

    assert _registry._TRAINER_ENGINES["test-registry-fake"] is _FakeTrainerEngine


def test_register_worker_engine_twice_is_value_error() -> None:
    register_worker_engine("test-registry-worker", _FakeWorkerEngine)

    with pytest.raises(
        ValueError,
        match=r"^worker engine backend 'test-registry-worker' is already registered "
        r"\(to _FakeWorkerEngine\); got _FakeWorkerEngine for it too$",
    ):
        register_worker_engine("test-registry-worker", _FakeWorkerEngine)


def test_same_name_may_register_once_on_each_side() -> None:
    register_trainer_engine("test-registry-both", _FakeTrainerEngine)
    register_worker_engine("test-registry-both", _FakeWorkerEngine)

    assert _registry._TRAINER_ENGINES["test-registry-both"] is _FakeTrainerEngine
    assert _registry._WORKER_ENGINES["test-registry-both"] is _FakeWorkerEngine


@pytest.mark.parametrize(("backend", "shown"), [("", "''"), (None, "None"), (7, "7")])
def test_register_rejects_backend_that_is_not_a_non_empty_str(backend: object, shown: str) -> None:
    pattern = rf"^backend should be a non-empty str, got {shown}$"
    with pytest.raises(ValueError, match=pattern):
        register_trainer_engine(backend, _FakeTrainerEngine)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=pattern):
        register_worker_engine(backend, _FakeWorkerEngine)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_trainer_init_dispatches_on_init_info_backend() -> None:
    register_trainer_engine("test-registry-fake", _FakeTrainerEngine)
    register_trainer_engine("test-registry-other", _OtherTrainerEngine)
    info = _FakeInitInfo("tcp://127.0.0.1:1234", rank=1)
    client = _Client()
    source = _Source()

    engine = await trainer_init(info, client=client, source=source)

    assert type(engine) is _FakeTrainerEngine
    assert isinstance(engine, _FakeTrainerEngine)
    assert engine.init_info is info
    assert engine.client is client
    assert engine.source is source
    assert engine.rank == 1
    assert engine.is_sender is False

    other = await trainer_init(_OtherInitInfo(rank=0), client=client)

    assert type(other) is _OtherTrainerEngine
    assert other.source is None
    assert other.is_sender is True


@pytest.mark.asyncio
async def test_trainer_init_unknown_backend_lists_registered_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_registry, "_TRAINER_ENGINES", {})
    register_trainer_engine("test-registry-other", _OtherTrainerEngine)
    register_trainer_engine("test-registry-another", _OtherTrainerEngine)

    with pytest.raises(
        ValueError,
        match=r"^unknown trainer backend 'test-registry-fake'; registered backends: "
        r"'test-registry-another', 'test-registry-other'$",
    ):
        await trainer_init(_FakeInitInfo(rank=0), client=_Client())


@pytest.mark.asyncio
async def test_trainer_init_unknown_backend_lists_every_registered_one() -> None:
    register_trainer_engine("test-registry-other", _OtherTrainerEngine)
    known = _known(_registry._TRAINER_ENGINES)

    with pytest.raises(
        ValueError,
        match=rf"^unknown trainer backend 'test-registry-fake'; registered backends: {known}$",
    ):
        await trainer_init(_FakeInitInfo(rank=0), client=_Client())


@pytest.mark.asyncio
async def test_trainer_init_unknown_backend_with_empty_registry_says_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_registry, "_TRAINER_ENGINES", {})

    with pytest.raises(
        ValueError,
        match=r"^unknown trainer backend 'test-registry-fake'; registered backends: none$",
    ):
        await trainer_init(_FakeInitInfo(rank=0), client=_Client())


@pytest.mark.asyncio
async def test_trainer_init_rejects_an_init_info_that_is_not_a_trainer_init_info() -> None:
    info = SimpleNamespace(backend="test-registry-fake", rank=0)

    with pytest.raises(
        TypeError,
        match=r"^init_info should be a TrainerInitInfo subclass instance, got SimpleNamespace$",
    ):
        await trainer_init(info, client=_Client())  # type: ignore[arg-type]


def test_create_worker_engine_dispatches_on_config_backend() -> None:
    register_worker_engine("test-registry-worker", _FakeWorkerEngine)
    register_worker_engine("test-registry-other", _OtherWorkerEngine)
    config = WeightTransferConfig(backend="test-registry-other", apply_threads=3)
    model = torch.nn.Linear(2, 2)
    vllm_config = SimpleNamespace(parallel_config="pc", model_config="mc")

    engine = create_worker_engine(config, model=model, device="cpu", vllm_config=vllm_config)

    assert type(engine) is _OtherWorkerEngine
    assert engine.config is config
    assert engine.model is model
    assert engine.device == torch.device("cpu")
    assert engine.vllm_config is vllm_config
    assert engine.parallel_config == "pc"
    assert engine.model_config == "mc"


def test_create_worker_engine_defaults_device_to_the_models_parameter_device() -> None:
    register_worker_engine("test-registry-worker", _FakeWorkerEngine)
    config = WeightTransferConfig(backend="test-registry-worker")

    on_meta = create_worker_engine(config, model=torch.nn.Linear(2, 2, device="meta"))
    on_cpu = create_worker_engine(config, model=torch.nn.Linear(2, 2))

    assert on_meta.device == torch.device("meta")
    assert on_cpu.device == torch.device("cpu")
    assert on_cpu.vllm_config is None


def test_create_worker_engine_defaults_to_cpu_for_a_model_without_parameters() -> None:
    register_worker_engine("test-registry-worker", _FakeWorkerEngine)

    engine = create_worker_engine(
        WeightTransferConfig(backend="test-registry-worker"), model=torch.nn.ReLU()
    )

    assert engine.device == torch.device("cpu")


def test_create_worker_engine_explicit_device_wins_over_the_models() -> None:
    register_worker_engine("test-registry-worker", _FakeWorkerEngine)

    engine = create_worker_engine(
        WeightTransferConfig(backend="test-registry-worker"),
        model=torch.nn.Linear(2, 2, device="meta"),
        device=torch.device("cpu"),
    )

    assert engine.device == torch.device("cpu")


def test_create_worker_engine_unknown_backend_lists_registered_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_registry, "_WORKER_ENGINES", {})
    register_worker_engine("test-registry-worker", _FakeWorkerEngine)
    register_worker_engine("test-registry-b", _FakeWorkerEngine)

    with pytest.raises(
        ValueError,
        match=r"^unknown worker backend 'test-registry-missing'; registered backends: "
        r"'test-registry-b', 'test-registry-worker'$",
    ):
        create_worker_engine(
            WeightTransferConfig(backend="test-registry-missing"), model=torch.nn.Linear(2, 2)
        )


def test_create_worker_engine_unknown_backend_lists_every_registered_one() -> None:
    register_worker_engine("test-registry-worker", _FakeWorkerEngine)
    known = _known(_registry._WORKER_ENGINES)

    with pytest.raises(
        ValueError,
        match=rf"^unknown worker backend 'test-registry-missing'; registered backends: {known}$",
    ):
        create_worker_engine(
            WeightTransferConfig(backend="test-registry-missing"), model=torch.nn.Linear(2, 2)
        )


def test_create_worker_engine_unknown_backend_with_empty_registry_says_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_registry, "_WORKER_ENGINES", {})

    with pytest.raises(
        ValueError,
        match=r"^unknown worker backend 'test-registry-missing'; registered backends: none$",
    ):
        create_worker_engine(
            WeightTransferConfig(backend="test-registry-missing"), model=torch.nn.Linear(2, 2)
        )


def test_a_lazily_registered_backend_is_imported_when_first_asked_for() -> None:
    _registry.register_lazy(
        "test-registry-lazy",
        trainer="asyncwt._backends.tcp.backend:TcpTrainerEngine",
        worker="asyncwt._backends.tcp.backend:TcpWorkerEngine",
    )
    assert _registry._WORKER_ENGINES["test-registry-lazy"] == (
        "asyncwt._backends.tcp.backend:TcpWorkerEngine"
    )
    assert "test-registry-lazy" in registered_backends()["worker"]

    assert _registry.worker_engine_class("test-registry-lazy") is asyncwt.TcpWorkerEngine
    assert _registry._WORKER_ENGINES["test-registry-lazy"] is asyncwt.TcpWorkerEngine


def test_a_lazy_registration_names_module_and_class() -> None:
    with pytest.raises(ValueError, match="'module:Class', got 'TcpTrainerEngine'"):
        _registry.register_lazy("test-registry-lazy", trainer="TcpTrainerEngine", worker="m:C")


def test_registering_a_lazily_registered_name_again_names_its_class() -> None:
    with pytest.raises(ValueError, match=r"already registered \(to TcpTrainerEngine\)"):
        register_trainer_engine("tcp", _FakeTrainerEngine)
