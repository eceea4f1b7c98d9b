"""The trainer side's base types: TrainerInitInfo, the engine base and the client protocols."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from asyncwt import (
    AsyncWeightSyncClient,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)
from asyncwt._core.protocol import call_client


@dataclass
class _FakeInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "fake"

    host: str
    port: int = 0


class _SyncClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], int]] = []

    def _record(self, method: str, *args: Any) -> None:
        self.calls.append((method, args, threading.get_ident()))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._record("init_weight_transfer_engine", init_info)

    def start_weight_update(self) -> None:
        self._record("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._record("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._record("finish_weight_update", weight_version)


class _AsyncClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], int]] = []

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init_weight_transfer_engine", (init_info,), threading.get_ident()))

    async def start_weight_update(self) -> None:
        self.calls.append(("start_weight_update", (), threading.get_ident()))

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        self.calls.append(("update_weights", (update_info,), threading.get_ident()))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish_weight_update", (weight_version,), threading.get_ident()))


class _Engine(TrainerWeightTransferEngine[_FakeInitInfo]):
    init_info_cls = _FakeInitInfo

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shutdowns = 0

    @classmethod
    async def trainer_init(
        cls,
        init_info: _FakeInitInfo,
        *,
        client: Any,
        source: WeightSource | None = None,
    ) -> _Engine:
        return cls(client=client, source=source, is_sender=init_info.is_sender, rank=init_info.rank)

    async def send_weights(self, **kwargs: Any) -> Any:
        return kwargs

    async def shutdown(self) -> None:
        self.shutdowns += 1


def test_trainer_init_info_subclass_without_backend_is_rejected_at_class_creation() -> None:
    with pytest.raises(
        TypeError,
        match=r"^NoBackend should set a class-level `backend` string \(its registry key\), "
        r"got None$",
    ):

        @dataclass
        class NoBackend(TrainerInitInfo):
            host: str = ""


@pytest.mark.parametrize(("backend", "shown"), [("", "''"), (3, "3"), (None, "None")])
def test_trainer_init_info_subclass_with_non_string_or_empty_backend_is_rejected(
    backend: object, shown: str
) -> None:
    with pytest.raises(
        TypeError,
        match=rf"^BadBackend should set a class-level `backend` string \(its registry key\), "
        rf"got {shown}$",
    ):
        type("BadBackend", (TrainerInitInfo,), {"backend": backend})


def test_trainer_init_info_backend_is_a_class_constant_not_a_field() -> None:
    info = _FakeInitInfo("localhost", rank=2)

    assert info.backend == "fake"
    assert _FakeInitInfo.backend == "fake"
    assert "backend" not in inspect.signature(_FakeInitInfo).parameters


def test_trainer_init_info_subclass_fields_are_positional_and_rank_keyword_only() -> None:
    info = _FakeInitInfo("localhost", 1234, rank=1)

    assert (info.host, info.port, info.rank) == ("localhost", 1234, 1)
    parameter = inspect.signature(_FakeInitInfo).parameters["rank"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY


def test_trainer_init_info_rank_passed_positionally_is_type_error() -> None:
    with pytest.raises(
        TypeError,
        match=r"^(_FakeInitInfo\.)?__init__\(\) takes from 2 to 3 positional arguments "
        r"but 4 were given$",
    ):
        _FakeInitInfo("localhost", 1234, 0)  # type: ignore[call-arg]
    with pytest.raises(
        TypeError,
        match=r"^(TrainerInitInfo\.)?__init__\(\) takes 1 positional argument but 2 were given$",
    ):
        TrainerInitInfo(0)  # type: ignore[call-arg]


def test_trainer_init_info_rank_is_required() -> None:
    with pytest.raises(
        TypeError,
        match=r"^(_FakeInitInfo\.)?__init__\(\) missing 1 required keyword-only argument: "
        r"'rank'$",
    ):
        _FakeInitInfo("localhost")  # type: ignore[call-arg]


@pytest.mark.parametrize(("rank", "is_sender"), [(0, True), (1, False), (7, False)])
def test_trainer_init_info_is_sender_only_on_rank_zero(rank: int, is_sender: bool) -> None:
    assert _FakeInitInfo("h", rank=rank).is_sender is is_sender


@pytest.mark.parametrize(
    ("rank", "shown"), [(-1, "-1"), (True, "True"), (False, "False"), (1.0, "1.0"), ("0", "'0'")]
)
def test_trainer_init_info_rejects_rank_that_is_not_a_non_negative_int(
    rank: object, shown: str
) -> None:
    with pytest.raises(ValueError, match=rf"^rank should be a non-negative int, got {shown}$"):
        _FakeInitInfo("h", rank=rank)  # type: ignore[arg-type]


def test_trainer_engine_trainer_init_is_an_async_classmethod() -> None:
    raw = inspect.getattr_static(TrainerWeightTransferEngine, "trainer_init")

    assert isinstance(raw, classmethod)
    assert inspect.iscoroutinefunction(raw.__func__)
    assert inspect.iscoroutinefunction(TrainerWeightTransferEngine.trainer_init)


def test_trainer_engine_send_weights_and_shutdown_are_coroutines() -> None:
    assert inspect.iscoroutinefunction(TrainerWeightTransferEngine.send_weights)
    assert inspect.iscoroutinefunction(TrainerWeightTransferEngine.shutdown)


def test_trainer_engine_requires_trainer_init_and_send_weights() -> None:
    assert TrainerWeightTransferEngine.__abstractmethods__ == frozenset(
        {"trainer_init", "send_weights"}
    )


def test_trainer_engine_stores_client_source_and_rank() -> None:
    client = _SyncClient()

    engine = _Engine(client=client, source=None, is_sender=False, rank=3)

    assert engine.client is client
    assert engine.source is None
    assert engine.is_sender is False
    assert engine.rank == 3


def test_trainer_engine_rejects_client_lacking_methods_naming_them() -> None:
    class HalfClient:
        def start_weight_update(self) -> None: ...

        update_weights = None

    with pytest.raises(
        TypeError,
        match=r"^client should implement VLLMWeightSyncClient or AsyncWeightSyncClient; "
        r"HalfClient lacks init_weight_transfer_engine, update_weights, finish_weight_update$",
    ):
        _Engine(client=HalfClient())


def test_trainer_engine_rejects_object_without_any_client_method() -> None:
    with pytest.raises(
        TypeError,
        match=r"^client should implement VLLMWeightSyncClient or AsyncWeightSyncClient; "
        r"object lacks init_weight_transfer_engine, start_weight_update, update_weights, "
        r"finish_weight_update$",
    ):
        _Engine(client=object())


@pytest.mark.parametrize("client_cls", [_SyncClient, _AsyncClient])
def test_trainer_engine_accepts_sync_and_async_clients(client_cls: type) -> None:
    client = client_cls()

    assert _Engine(client=client).client is client


def test_client_protocols_are_runtime_checkable_structurally() -> None:
    assert isinstance(_SyncClient(), VLLMWeightSyncClient)
    assert isinstance(_AsyncClient(), AsyncWeightSyncClient)
    assert not isinstance(object(), VLLMWeightSyncClient)
    assert not isinstance(object(), AsyncWeightSyncClient)

    class ThreeMethods:
        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

        def start_weight_update(self) -> None: ...

        def update_weights(self, update_info: dict[str, Any]) -> None: ...

    assert not isinstance(ThreeMethods(), VLLMWeightSyncClient)


@pytest.mark.asyncio
async def test_trainer_engine_trainer_init_builds_a_ready_engine() -> None:
    client = _AsyncClient()

    engine = await _Engine.trainer_init(_FakeInitInfo("h", rank=0), client=client)

    assert isinstance(engine, _Engine)
    assert engine.is_sender is True
    assert engine.rank == 0
    assert await engine.send_weights(step=3) == {"step": 3}


@pytest.mark.asyncio
async def test_trainer_engine_async_context_manager_shuts_down_on_exit() -> None:
    engine = _Engine(client=_SyncClient())

    async with engine as entered:
        assert entered is engine
        assert engine.shutdowns == 0

    assert engine.shutdowns == 1


@pytest.mark.asyncio
async def test_trainer_engine_async_context_manager_shuts_down_on_error() -> None:
    engine = _Engine(client=_SyncClient())

    with pytest.raises(RuntimeError, match=r"^boom$"):
        async with engine:
            raise RuntimeError("boom")

    assert engine.shutdowns == 1


@pytest.mark.asyncio
async def test_trainer_engine_default_shutdown_does_nothing() -> None:
    class Minimal(TrainerWeightTransferEngine[_FakeInitInfo]):
        init_info_cls = _FakeInitInfo

        @classmethod
        async def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> Any:
            return cls(client=client)

        async def send_weights(self, **kwargs: Any) -> None:
            return None

    engine = await Minimal.trainer_init(_FakeInitInfo("h", rank=0), client=_SyncClient())

    assert await engine.shutdown() is None
    assert await engine.shutdown() is None


@pytest.mark.asyncio
async def test_call_client_runs_sync_method_in_a_worker_thread() -> None:
    client = _SyncClient()
    loop_thread = threading.get_ident()

    await call_client(client, "init_weight_transfer_engine", {"host": "h"})
    await call_client(client, "start_weight_update")
    await call_client(client, "update_weights", {"names": ["w"]})
    await call_client(client, "finish_weight_update", "v1")

    assert [(method, args) for method, args, _ in client.calls] == [
        ("init_weight_transfer_engine", ({"host": "h"},)),
        ("start_weight_update", ()),
        ("update_weights", ({"names": ["w"]},)),
        ("finish_weight_update", ("v1",)),
    ]
    assert all(thread != loop_thread for _, _, thread in client.calls)


@pytest.mark.asyncio
async def test_call_client_keeps_the_loop_responsive_while_a_sync_call_blocks() -> None:
    class SlowClient(_SyncClient):
        def update_weights(self, update_info: dict[str, Any]) -> None:
            time.sleep(0.3)
            super().update_weights(update_info)

    client = SlowClient()
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    async def call() -> None:
        try:
            await call_client(client, "update_weights", {"names": []})
        finally:
            done.set()

    started = time.monotonic()
    await asyncio.gather(ticker(), call())
    elapsed = time.monotonic() - started

    assert elapsed >= 0.3
    assert ticks >= 5
    assert [method for method, _, _ in client.calls] == ["update_weights"]


@pytest.mark.asyncio
async def test_call_client_awaits_async_method_on_the_loop_thread() -> None:
    client = _AsyncClient()
    loop_thread = threading.get_ident()

    await call_client(client, "update_weights", {"names": ["w"]})
    await call_client(client, "finish_weight_update", None)

    assert client.calls == [
        ("update_weights", ({"names": ["w"]},), loop_thread),
        ("finish_weight_update", (None,), loop_thread),
    ]


@pytest.mark.asyncio
async def test_call_client_awaits_an_awaitable_returned_by_a_sync_callable() -> None:
    awaited = []

    async def finish(version: str | None) -> None:
        awaited.append(version)

    class WrapperClient(_SyncClient):
        def finish_weight_update(self, weight_version: str | None = None) -> Any:
            return finish(weight_version)

    await call_client(WrapperClient(), "finish_weight_update", "v2")

    assert awaited == ["v2"]


@pytest.mark.asyncio
async def test_call_client_propagates_the_clients_exception() -> None:
    class FailingClient(_SyncClient):
        def start_weight_update(self) -> None:
            raise ConnectionError("worker gone")

    class FailingAsyncClient(_AsyncClient):
        async def start_weight_update(self) -> None:
            raise ConnectionError("worker gone (async)")

    with pytest.raises(ConnectionError, match=r"^worker gone$"):
        await call_client(FailingClient(), "start_weight_update")
    with pytest.raises(ConnectionError, match=r"^worker gone \(async\)$"):
        await call_client(FailingAsyncClient(), "start_weight_update")


def test_round_summary_names_wire_bytes_and_dropped_workers_only_when_they_say_something() -> None:
    from asyncwt import RoundStats

    full = RoundStats(
        round_id=3, weight_version="v3", bytes=4 << 20, wire_bytes=4 << 20, buckets=1,
        workers=2, wall_s=0.5,
    )  # fmt: skip
    assert "on the wire" not in full.summary() and "dropped" not in full.summary()
    assert full.summary().startswith("round 3 (version v3): 4.0 MiB in 1 buckets to 2 worker(s)")
    delta = dataclasses.replace(full, wire_bytes=1 << 19, dropped=("http://10.0.0.2:8000",))
    assert delta.summary().startswith("round 3 (version v3): 4.0 MiB (0.5 MiB on the wire) in 1")
    assert delta.summary().endswith("; dropped http://10.0.0.2:8000")


@pytest.mark.asyncio
async def test_an_engine_class_without_a_backend_says_how_to_make_one() -> None:
    """`PipelinedTrainerEngine` takes a transport from a backend; alone it has none."""
    from asyncwt import TcpTrainerInitInfo
    from asyncwt._trainer.engine import PipelinedTrainerEngine

    with pytest.raises(TypeError, match=r"has no backend: .*trainer_engine_class\(backend\)"):
        await PipelinedTrainerEngine.trainer_init(TcpTrainerInitInfo(rank=0), client=object())
