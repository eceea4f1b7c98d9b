"""The worker side's base types: WeightTransferEngine, its config and request types."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch

from asyncwt import (
    WeightTransferConfig,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
)


@dataclass
class _InitInfo(WeightTransferInitInfo):
    host: str
    port: int


@dataclass
class _UpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    version: int = 0


class _RecordingEngine(WeightTransferEngine[_InitInfo, _UpdateInfo]):
    init_info_cls = _InitInfo
    update_info_cls = _UpdateInfo

    def __init__(self, *args: Any, events: list[str] | None = None) -> None:
        super().__init__(*args)
        self.events = [] if events is None else events
        self.received: list[_UpdateInfo] = []

    def init_transfer_engine(self, init_info: _InitInfo) -> None:
        self.events.append("init")

    def start_weight_update(self) -> None:
        self.events.append("start")

    def finish_weight_update(self) -> None:
        self.events.append("finish")

    def receive_weights(self, update_info: _UpdateInfo) -> None:
        self.events.append("receive")
        self.received.append(update_info)

    def shutdown(self) -> None:
        self.events.append("shutdown")


class _DeferringEngine(_RecordingEngine):
    defers_processing: ClassVar[bool] = True


def _engine(cls: type[_RecordingEngine] = _RecordingEngine, **kwargs: Any) -> _RecordingEngine:
    return cls(WeightTransferConfig(), None, torch.device("cpu"), torch.nn.Linear(2, 2), **kwargs)


@pytest.fixture
def sync_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace `torch.accelerator.synchronize` with a recorder; returns its call log."""
    calls: list[str] = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: calls.append("sync"))
    return calls


def test_weight_transfer_engine_without_vllm_config() -> None:
    config = WeightTransferConfig(backend="fake", apply_threads=3)
    model = torch.nn.Linear(2, 2)

    engine = _RecordingEngine(config, None, torch.device("cpu"), model)

    assert engine.config is config
    assert engine.vllm_config is None
    assert engine.parallel_config is None
    assert engine.model_config is None
    assert engine.device == torch.device("cpu")
    assert engine.model is model


def test_weight_transfer_engine_reads_parallel_and_model_config_from_vllm_config() -> None:
    parallel_config, model_config = object(), object()
    vllm_config = SimpleNamespace(parallel_config=parallel_config, model_config=model_config)

    engine = _RecordingEngine(
        WeightTransferConfig(), vllm_config, torch.device("cpu"), torch.nn.Linear(2, 2)
    )

    assert engine.vllm_config is vllm_config
    assert engine.parallel_config is parallel_config
    assert engine.model_config is model_config


def test_weight_transfer_engine_base_is_abstract() -> None:
    assert WeightTransferEngine.__abstractmethods__ == frozenset(
        {
            "init_transfer_engine",
            "start_weight_update",
            "finish_weight_update",
            "receive_weights",
            "shutdown",
        }
    )
    with pytest.raises(TypeError, match=r"^Can't instantiate abstract class WeightTransferEngine"):
        WeightTransferEngine(
            WeightTransferConfig(),
            None,
            torch.device("cpu"),  # type: ignore[abstract]
            torch.nn.Linear(2, 2),
        )


def test_weight_transfer_engine_class_defaults() -> None:
    assert WeightTransferEngine.supports_draft_weight_update is True
    assert WeightTransferEngine.defers_processing is False
    assert _DeferringEngine.defers_processing is True


def test_parse_init_info_builds_the_typed_info() -> None:
    assert _engine().parse_init_info({"host": "10.0.0.1", "port": 29500}) == _InitInfo(
        "10.0.0.1", 29500
    )


def test_parse_update_info_builds_the_typed_info() -> None:
    engine = _engine()

    assert engine.parse_update_info({"names": ["w"], "version": 2}) == _UpdateInfo(["w"], 2)
    assert engine.parse_update_info({"names": []}) == _UpdateInfo([], 0)


def test_parse_init_info_rejects_unknown_key() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Invalid init_info for _RecordingEngine: (_InitInfo\.)?__init__\(\) got an "
        r"unexpected keyword argument 'bogus'$",
    ) as excinfo:
        _engine().parse_init_info({"host": "h", "port": 1, "bogus": True})

    assert isinstance(excinfo.value.__cause__, TypeError)


def test_parse_init_info_rejects_missing_key() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Invalid init_info for _RecordingEngine: (_InitInfo\.)?__init__\(\) missing 1 "
        r"required positional argument: 'port'$",
    ) as excinfo:
        _engine().parse_init_info({"host": "h"})

    assert isinstance(excinfo.value.__cause__, TypeError)


@pytest.mark.parametrize(
    ("value", "type_name"), [(["w"], "list"), (None, "NoneType"), ('{"names": []}', "str")]
)
def test_parse_init_info_rejects_non_dict(value: object, type_name: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^Invalid init_info for _RecordingEngine: expected a dict, got {type_name}$",
    ):
        _engine().parse_init_info(value)  # type: ignore[arg-type]


def test_parse_update_info_rejects_unknown_key() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Invalid update_info for _RecordingEngine: (_UpdateInfo\.)?__init__\(\) got an "
        r"unexpected keyword argument 'dtype_names'$",
    ):
        _engine().parse_update_info({"names": [], "dtype_names": []})


def test_parse_update_info_rejects_missing_key() -> None:
    with pytest.raises(
        ValueError,
        match=r"^Invalid update_info for _RecordingEngine: (_UpdateInfo\.)?__init__\(\) missing 1 "
        r"required positional argument: 'names'$",
    ):
        _engine().parse_update_info({"version": 1})


def test_parse_update_info_rejects_non_dict() -> None:
    with pytest.raises(
        ValueError, match=r"^Invalid update_info for _RecordingEngine: expected a dict, got list$"
    ):
        _engine().parse_update_info([("names", [])])  # type: ignore[arg-type]


def test_parse_init_info_error_names_the_concrete_engine_class() -> None:
    with pytest.raises(
        ValueError, match=r"^Invalid init_info for _DeferringEngine: expected a dict, got int$"
    ):
        _engine(_DeferringEngine).parse_init_info(3)  # type: ignore[arg-type]


def test_set_and_reset_weight_update_target() -> None:
    vllm_config = SimpleNamespace(parallel_config=None, model_config="main-config")
    main = torch.nn.Linear(2, 2)
    draft = torch.nn.Linear(2, 2)
    engine = _RecordingEngine(WeightTransferConfig(), vllm_config, torch.device("cpu"), main)

    engine.set_weight_update_target(draft, "draft-config")

    assert engine.model is draft
    assert engine.model_config == "draft-config"

    engine.reset_weight_update_target()

    assert engine.model is main
    assert engine.model_config == "main-config"


def test_reset_weight_update_target_without_a_prior_set_keeps_the_model() -> None:
    engine = _engine()
    model = engine.model

    engine.reset_weight_update_target()

    assert engine.model is model
    assert engine.model_config is None


def test_drain_pending_is_an_idempotent_no_op_by_default() -> None:
    engine = _engine()

    engine.drain_pending()
    engine.drain_pending()
    assert engine.events == []
    assert engine.received == []


def test_update_weights_parses_and_receives_with_the_real_torch_accelerator() -> None:
    # Unpatched: on a CPU-only torch, torch.accelerator.synchronize() raises RuntimeError,
    # so this passing there shows update_weights does not call it without an accelerator.
    engine = _engine()

    engine.update_weights({"names": ["a", "b"], "version": 4})

    assert engine.events == ["receive"]
    assert engine.received == [_UpdateInfo(["a", "b"], 4)]


def test_update_weights_does_not_synchronize_without_an_accelerator(
    monkeypatch: pytest.MonkeyPatch, sync_calls: list[str]
) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    engine = _engine()

    engine.update_weights({"names": ["a"]})

    assert engine.received == [_UpdateInfo(["a"], 0)]
    assert sync_calls == []


def test_update_weights_synchronizes_the_engines_device_after_receiving(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.accelerator, "synchronize", lambda device=None: events.append(f"sync {device}")
    )
    engine = _RecordingEngine(
        WeightTransferConfig(), None, torch.device("cuda", 1), torch.nn.Linear(2, 2), events=events
    )

    engine.update_weights({"names": ["a"]})

    # Its own GPU, not the thread's current one (an apply or RPC thread sits on GPU 0).
    assert events == ["receive", "sync cuda:1"]


def test_update_weights_with_deferred_processing_does_not_synchronize(
    monkeypatch: pytest.MonkeyPatch, sync_calls: list[str]
) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    engine = _engine(_DeferringEngine)

    engine.update_weights({"names": ["a"]})

    assert engine.received == [_UpdateInfo(["a"], 0)]
    assert sync_calls == []


def test_update_weights_with_bad_info_raises_before_receiving(
    monkeypatch: pytest.MonkeyPatch, sync_calls: list[str]
) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    engine = _engine()

    with pytest.raises(
        ValueError,
        match=r"^Invalid update_info for _RecordingEngine: (_UpdateInfo\.)?__init__\(\) got an "
        r"unexpected keyword argument 'extra'$",
    ):
        engine.update_weights({"names": [], "extra": 1})

    assert engine.received == []
    assert sync_calls == []


def test_weight_transfer_config_defaults() -> None:
    config = WeightTransferConfig()

    assert config.backend == "tcp"
    assert config.apply_threads == 2


def test_weight_transfer_config_is_frozen_and_keyword_only() -> None:
    config = WeightTransferConfig(backend="nccl", apply_threads=4)

    with pytest.raises(dataclasses.FrozenInstanceError):
        config.backend = "tcp"  # type: ignore[misc]
    with pytest.raises(
        TypeError,
        match=r"^(WeightTransferConfig\.)?__init__\(\) takes 1 positional argument but 2 were "
        r"given$",
    ):
        WeightTransferConfig("tcp")  # type: ignore[call-arg]


@pytest.mark.parametrize(("backend", "shown"), [("", "''"), (None, "None"), (3, "3")])
def test_weight_transfer_config_rejects_bad_backend(backend: object, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"^backend should be a non-empty str, got {shown}$"):
        WeightTransferConfig(backend=backend)  # type: ignore[arg-type]


@pytest.mark.parametrize(("threads", "shown"), [(0, "0"), (-2, "-2"), (1.5, "1.5"), ("2", "'2'")])
def test_weight_transfer_config_rejects_bad_apply_threads(threads: object, shown: str) -> None:
    with pytest.raises(ValueError, match=rf"^apply_threads should be an int >= 1, got {shown}$"):
        WeightTransferConfig(apply_threads=threads)  # type: ignore[arg-type]


def test_weight_transfer_requests_default_to_fresh_empty_dicts() -> None:
    first, second = WeightTransferInitRequest(), WeightTransferInitRequest()
    update_first, update_second = WeightTransferUpdateRequest(), WeightTransferUpdateRequest()

    assert first.init_info == {}
    assert update_first.update_info == {}
    assert first.init_info is not second.init_info
    assert update_first.update_info is not update_second.update_info


def test_weight_transfer_requests_carry_their_payload() -> None:
    assert WeightTransferInitRequest({"host": "h"}).init_info == {"host": "h"}
    assert WeightTransferUpdateRequest(update_info={"names": ["w"]}).update_info == {"names": ["w"]}


def test_worker_info_bases_are_dataclass_markers() -> None:
    assert dataclasses.is_dataclass(WeightTransferInitInfo)
    assert dataclasses.is_dataclass(WeightTransferUpdateInfo)
    assert dataclasses.fields(WeightTransferInitInfo) == ()
    assert [f.name for f in dataclasses.fields(_UpdateInfo)] == ["names", "version"]


def test_weight_transfer_config_accepts_a_callable_transform() -> None:
    def to_half(name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.half()

    assert WeightTransferConfig().transform is None
    assert WeightTransferConfig(transform=to_half).transform is to_half


def test_weight_transfer_config_rejects_a_non_callable_transform() -> None:
    with pytest.raises(ValueError, match=r"^transform should be callable or None, got 'half'$"):
        WeightTransferConfig(transform="half")  # type: ignore[arg-type]
