"""The worker's round state machine (`_rounds.py`), alone and behind the worker server.

A version is published only by the finish that closes the round its start opened,
after every update and background apply of that round succeeded; calls out of order,
for another round or from another trainer are refused (409) and change nothing;
"incomplete" outlives engine shutdown and re-init. The end-to-end tests run a real
worker process over HTTP (issue 23, findings 1, 2, 3 and 7); the randomized test
drives an in-process server from two clients (a smoke test over HTTP: the state
machine's own search is tests/test_round_machine.py).
"""

from __future__ import annotations

import random
import re
import secrets
import time
from pathlib import Path
from typing import Any

import _models
import anyio
import pytest
import torch
from _faults import SMALL_TIMEOUTS, info_for, worker_env
from _server_models import NAIVE_DEFERRED_BACKEND, tiny
from aiohttp.test_utils import TestClient, TestServer

from asyncwt import (
    ApplyError,
    ControlPlaneError,
    HttpClient,
    LocalClient,
    ModuleSource,
    RoundConflictError,
    TransferError,
    WeightTransferConfig,
    create_worker_engine,
    model_checksum,
    trainer_init,
)
from asyncwt._worker.launch import worker_process
from asyncwt._worker.rounds import RoundState
from asyncwt._worker.server import build_app

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])


# -- the state machine alone --------------------------------------------------------------


def initialised(trainer_id: str | None = "T") -> RoundState:
    state = RoundState()
    state.begin_init()
    state.end_init(trainer_id)
    return state


def one_round(
    state: RoundState, round_id: int, version: str, *, trainer_id: str | None = "T"
) -> None:
    opened = state.start(round_id=round_id, trainer_id=trainer_id)
    state.end_update(state.begin_update(round_id=round_id, trainer_id=trainer_id))
    assert state.begin_finish(round_id=round_id, trainer_id=trainer_id) is opened
    assert state.end_finish(opened, version, error=None) is None


def test_round_state_publishes_a_complete_round() -> None:
    state = initialised()
    one_round(state, 1, "v1")
    assert (state.weight_version, state.weights_incomplete, state.open_round) == ("v1", False, None)


def test_round_state_refuses_a_second_finish_and_a_finish_without_update() -> None:
    state = initialised()
    one_round(state, 1, "v1")
    with pytest.raises(
        RoundConflictError, match=r"^finish_weight_update refused: no round is open"
    ):
        state.begin_finish(round_id=None, trainer_id=None)
    state.start(round_id=2, trainer_id="T")
    with pytest.raises(
        RoundConflictError,
        match=r"^finish_weight_update for round 2 refused: round 2 received no update_weights",
    ):
        state.begin_finish(round_id=2, trainer_id="T")
    assert state.weight_version == "v1"


def test_round_state_refuses_a_late_update_without_disturbing_the_open_round() -> None:
    state = initialised()
    state.start(round_id=1, trainer_id="T")  # cancelled before its update arrived
    state.start(round_id=2, trainer_id="T")
    with pytest.raises(
        RoundConflictError,
        match=r"^update_weights for round 1 refused: the open round is 2 \(a late update",
    ):
        state.begin_update(round_id=1, trainer_id="T")
    state.end_update(state.begin_update(round_id=2, trainer_id="T"))
    closing = state.begin_finish(round_id=2, trainer_id="T")
    assert state.end_finish(closing, "v2", error=None) is None
    assert state.weight_version == "v2"


def test_round_state_keeps_an_abandoned_rounds_refused_id_spent() -> None:
    """Found by tests/test_round_machine.py: an update that bound its id to a round
    started without one, refused by the engine after a later start, set the last
    round id back to 0, and a replayed start of round 1 was accepted."""
    state = initialised()
    state.start(round_id=None, trainer_id="T")
    ticket = state.begin_update(round_id=1, trainer_id="T")
    state.start(round_id=2, trainer_id="T")
    state.end_update(ticket, refused=True)
    with pytest.raises(
        RoundConflictError, match=r"^start_weight_update for round 1 refused: round ids"
    ):
        state.start(round_id=1, trainer_id="T")
    one_round(state, 3, "v3")


def test_round_state_keeps_a_failure_on_its_round() -> None:
    state = initialised()
    opened = state.start(round_id=1, trainer_id="T")
    state.end_update(state.begin_update(round_id=1, trainer_id="T"), error="ApplyError: boom")
    closing = state.begin_finish(round_id=1, trainer_id="T")
    assert state.end_finish(closing, "v1", error=None) == "update_weights failed: ApplyError: boom"
    assert closing is opened and state.weight_version is None


def test_round_state_refuses_another_trainer_and_a_finish_that_does_not_name_its_round() -> None:
    state = initialised("T")
    with pytest.raises(
        RoundConflictError, match=r"^start_weight_update refused: it names a trainer other"
    ):
        state.start(round_id=1, trainer_id="stranger")
    state.start(round_id=1, trainer_id="T")
    state.end_update(state.begin_update(round_id=1, trainer_id="T"))
    with pytest.raises(
        RoundConflictError, match=r"^finish_weight_update refused: round 1 was started"
    ):
        state.begin_finish(round_id=None, trainer_id=None)
    with pytest.raises(
        RoundConflictError, match=r"^start_weight_update for round 1 refused: round ids"
    ):
        state.start(round_id=1, trainer_id="T")


def test_round_state_incomplete_survives_shutdown_and_init() -> None:
    state = initialised()
    state.start(round_id=1, trainer_id="T")
    state.end_update(state.begin_update(round_id=1, trainer_id="T"), error="boom")
    state.note_incomplete(True)
    state.shut_down()
    state.begin_init()
    state.end_init("U")
    assert state.weights_incomplete is True
    one_round(state, 1, "fixed", trainer_id="U")
    assert state.weights_incomplete is False


# -- end to end, against a worker process (issue 23) --------------------------------------


def failing_worker(flag: Path, *extra: str) -> Any:
    env = worker_env(ASYNCWT_TEST_FAIL=str(flag))
    args = ("--backend", "tcp", "--transform", "_models:failing_transform", *extra)
    return worker_process("_models:mixed", *args, env=env)


async def status_of(client: HttpClient) -> tuple[Any, bool, str]:
    (status,) = await client.weights_status(checksum=True)
    return status["weight_version"], status["weights_incomplete"], status["checksum"]


@uvloop_only
@pytest.mark.slow
async def test_incomplete_survives_engine_shutdown_and_a_new_trainer_init(tmp_path: Path) -> None:
    """Finding 1: a failed round's mixed weights stay `weights_incomplete` after
    `/shutdown_weight_transfer_engine` and a new `trainer_init`."""
    flag = tmp_path / "fail"
    with failing_worker(flag) as url:
        async with HttpClient(url) as client:
            model = _models.mixed()
            engine = await trainer_init(info_for("tcp"), client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=1)
                await engine.send_weights(weight_version="good")
                flag.touch()
                _models.randomize(model, seed=2)
                with pytest.raises(ControlPlaneError, match=r"HTTP 500: ApplyError: round 2"):
                    await engine.send_weights(weight_version="bad")
            assert (await status_of(client))[:2] == ("good", True)
            await client.shutdown()
            assert (await status_of(client))[:2] == ("good", True)
            flag.unlink()
            engine = await trainer_init(info_for("tcp"), client=client, source=ModuleSource(model))
            async with engine:
                assert (await status_of(client))[:2] == ("good", True)
                _models.randomize(model, seed=3)
                await engine.send_weights(weight_version="fixed")
            assert await status_of(client) == ("fixed", False, model_checksum(model))


class IntrudingClient(HttpClient):
    """Lets a second client call `start_weight_update` between this client's
    `update_weights` and its `finish_weight_update` (a careless second trainer)."""

    intruder: HttpClient | None = None

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        await super().update_weights(update_info)
        if self.intruder is not None:
            await self.intruder.start_weight_update()


@uvloop_only
@pytest.mark.parametrize("staged", [False, True], ids=["unstaged", "staged"])
@pytest.mark.slow
async def test_an_extra_start_before_finish_cannot_swallow_the_apply_error(
    tmp_path: Path, staged: bool
) -> None:
    """Finding 2: a control call between `update_weights` and the trainer's finish
    does not consume the round's apply error; the failed round is never published."""
    flag = tmp_path / "fail"
    with failing_worker(flag, *(["--staged"] if staged else [])) as url:
        async with IntrudingClient(url) as client, HttpClient(url) as intruder:
            model = _models.mixed()
            engine = await trainer_init(info_for("tcp"), client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=1)
                await engine.send_weights(weight_version="good")
                good = model_checksum(model)
                flag.touch()
                client.intruder = intruder
                _models.randomize(model, seed=2)
                with pytest.raises(
                    ControlPlaneError,
                    match=r"HTTP 409: finish_weight_update for round 2 refused: the open round "
                    r"is round #\d+ \(started without a round id\); nothing is published$",
                ):
                    await engine.send_weights(weight_version="bad")
                version, incomplete, checksum = await status_of(client)
                assert (version, incomplete) == ("good", not staged)
                if staged:
                    assert checksum == good
                client.intruder = None
                flag.unlink()
                _models.randomize(model, seed=3)
                await engine.send_weights(weight_version="fixed")
            assert await status_of(client) == ("fixed", False, model_checksum(model))


@uvloop_only
@pytest.mark.parametrize("staged", [False, True], ids=["unstaged", "staged"])
async def test_a_drain_pending_caller_cannot_swallow_the_apply_error(staged: bool) -> None:
    """Finding 2, in process: `drain_pending()` raises the apply error, and the
    round's finish still fails with it."""
    failing = {"on": False}

    def transform(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name == "w16" and failing["on"]:
            raise RuntimeError("quantisation of w16 failed on purpose")
        return tensor

    config = WeightTransferConfig(backend="tcp", transform=transform, staged=staged)
    worker = create_worker_engine(config, model=_models.mixed())
    drained: list[BaseException] = []

    class DrainingClient(LocalClient):
        async def update_weights(self, update_info: dict[str, Any]) -> None:
            await super().update_weights(update_info)
            if failing["on"]:
                with pytest.raises(ApplyError) as info:
                    worker.drain_pending()
                drained.append(info.value)

    model = _models.mixed()
    try:
        engine = await trainer_init(
            info_for("tcp"), client=DrainingClient([worker]), source=ModuleSource(model)
        )
        async with engine:
            _models.randomize(model, seed=1)
            await engine.send_weights(weight_version="good")
            failing["on"] = True
            _models.randomize(model, seed=2)
            with pytest.raises(
                TransferError, match=r"^round 2 did not complete, so version 'bad' is not published"
            ):
                await engine.send_weights(weight_version="bad")
            assert len(drained) == 1
            assert (worker.weight_version, worker.weights_incomplete) == ("good", not staged)  # type: ignore[attr-defined]
    finally:
        worker.shutdown()


@uvloop_only
@pytest.mark.slow
async def test_finish_publishes_only_the_round_its_start_opened(tmp_path: Path) -> None:
    """Finding 3: a second finish cannot relabel the weights, and start + finish with
    no update publishes nothing."""
    with worker_process("_models:mixed", "--backend", "tcp", env=worker_env()) as url:
        async with HttpClient(url) as client:
            model = _models.mixed()
            engine = await trainer_init(info_for("tcp"), client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=1)
                await engine.send_weights(weight_version="v1")
                expected = ("v1", False, model_checksum(model))
                for version in ("step-999", None):
                    with pytest.raises(
                        ControlPlaneError,
                        match=r"HTTP 409: finish_weight_update refused: no round is open \(it "
                        r"was finished already",
                    ):
                        await client.finish_weight_update(version)
                    with pytest.raises(
                        ControlPlaneError,
                        match=r"HTTP 409: finish_weight_update for round 1 refused: no round is open",
                    ):
                        await client.finish_weight_update(
                            version, round_id=1, trainer_id=engine.trainer_id
                        )
                assert await status_of(client) == expected
                await client.start_weight_update()
                with pytest.raises(
                    ControlPlaneError,
                    match=r"HTTP 409: finish_weight_update refused: round #\d+ \(started without "
                    r"a round id\) received no update_weights, so it has no weights to publish$",
                ):
                    await client.finish_weight_update("never-sent")
                assert await status_of(client) == expected
                _models.randomize(model, seed=2)
                await engine.send_weights(weight_version="v2")
            assert await status_of(client) == ("v2", False, model_checksum(model))


class LateUpdateClient(HttpClient):
    """Holds back round 1's `update_weights` (its round is cancelled before it
    arrives), then delivers it right after round 2's start: a late update."""

    held: dict[str, Any] | None = None
    late_answer: str = ""
    starts = 0

    async def update_weights(self, update_info: dict[str, Any]) -> None:
        if update_info["round_id"] == 1:
            self.held = update_info
            await anyio.sleep_forever()
        await super().update_weights(update_info)

    async def start_weight_update(self, **ids: Any) -> None:
        await super().start_weight_update(**ids)
        self.starts += 1
        if self.held is not None and self.starts == 2:
            try:
                await super().update_weights(self.held)
            except ControlPlaneError as exc:
                self.late_answer = str(exc)
            else:
                self.late_answer = "accepted"


@uvloop_only
@pytest.mark.slow
async def test_a_late_update_of_a_cancelled_round_cannot_fail_the_next_round() -> None:
    """Finding 7: a cancelled round's `update_weights` arriving after the next
    round's start is refused (409 naming the round) and that round completes."""
    with worker_process("_models:mixed", "--backend", "tcp", env=worker_env()) as url:
        async with LateUpdateClient(url) as client:
            model = _models.mixed()
            info = info_for("tcp", timeouts=SMALL_TIMEOUTS)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=1)
                with anyio.move_on_after(1.0) as scope:
                    await engine.send_weights(weight_version="cancelled")
                assert scope.cancelled_caught and client.held is not None
                _models.randomize(model, seed=2)
                await engine.send_weights(weight_version="v2")
            assert re.search(
                r"HTTP 409: update_weights for round 1 refused: the open round is 2 \(a late "
                r"update of an abandoned round, or another trainer's\); round 2 is not disturbed$",
                client.late_answer,
            ), client.late_answer
            assert await status_of(client) == ("v2", False, model_checksum(model))


# -- randomized interleavings of two clients ----------------------------------------------

INTERLEAVINGS = 50
"""An HTTP smoke test: the bulk of the interleavings runs without a server, in
tests/test_round_machine.py (`test_round_driver_never_publishes_a_lie`)."""
FAIL_RATE = 0.3


def filled(value: float) -> str:
    model = tiny()
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(value)
    return model_checksum(model)


class Interleaving:
    """Two clients' control calls, interleaved at random against one worker.

    The trainer runs rounds by the protocol (start, update, finish, each naming its
    round and trainer id); the other client, which does not know the trainer's
    random id, calls anything in any order, with round ids or without, current,
    stale or ahead. Every version label names the fill its sender's last update
    sent (`expected`), so a published version's checksum is known.
    """

    def __init__(
        self, http: TestClient[Any, Any], rng: random.Random, index: int, expected: dict[str, float]
    ) -> None:
        self.http = http
        self.rng = rng
        self.index = index
        self.expected = expected
        self.trainer_id = secrets.token_hex(8)
        self.round_id = 0
        self.stage = "start"
        self.fill = 0.0
        self.other_fill = float("nan")
        self.answers: dict[int, int] = {}

    async def post(self, route: str, body: dict[str, Any]) -> int:
        async with self.http.post(route, json=body) as response:
            await response.read()
            self.answers[response.status] = self.answers.get(response.status, 0) + 1
            assert response.status in (200, 409, 500), (route, response.status)
            return response.status

    def label(self, who: str, fill: float) -> str:
        version = f"{who}-{self.index}-{len(self.expected)}"
        self.expected[version] = fill
        return version

    async def init(self) -> None:
        body = {"init_info": {"trainer_id": self.trainer_id}}
        assert await self.post("/init_weight_transfer_engine", body) == 200
        self.round_id, self.stage = 0, "start"

    async def trainer_step(self) -> None:
        if self.stage == "start":
            self.round_id += 1
        ids = {"round_id": self.round_id, "trainer_id": self.trainer_id}
        if self.stage == "start":
            ok = await self.post("/start_weight_update", ids) == 200
            self.stage = "update" if ok else "start"
        elif self.stage == "update":
            self.fill = float(self.index * 1000 + self.round_id)
            info = {"fill": self.fill, "fail_apply": self.rng.random() < FAIL_RATE, **ids}
            ok = await self.post("/update_weights", {"update_info": info}) == 200
            self.stage = "finish" if ok else "start"
        else:
            version = self.label("trainer", self.fill)
            await self.post("/finish_weight_update", {"weight_version": version, **ids})
            self.stage = "start"
            await self.check()

    async def other_step(self) -> None:
        rng = self.rng
        ids: dict[str, Any] = {}
        if rng.random() < 0.5:
            ids["round_id"] = max(1, self.round_id + rng.choice([-1, 0, 1, 2]))
        if rng.random() < 0.3:
            ids["trainer_id"] = "someone-else"
        action = rng.choice(["start", "update", "finish", "finish", "reinit"])
        if action == "start":
            await self.post("/start_weight_update", ids)
        elif action == "update":
            fill = -float(self.index * 1000 + rng.randrange(1000))
            info = {"fill": fill, "fail_apply": rng.random() < FAIL_RATE, **ids}
            if await self.post("/update_weights", {"update_info": info}) == 200:
                self.other_fill = fill
        elif action == "finish":
            version = rng.choice([self.label("other", self.other_fill), None])
            await self.post("/finish_weight_update", {"weight_version": version, **ids})
            await self.check()
        else:  # a restarted trainer: shutdown, then a new init (same id: the trainer's)
            assert await self.post("/shutdown_weight_transfer_engine", {}) == 200
            await self.check()
            await self.init()

    async def check(self) -> None:
        async with self.http.get("/weights_status?checksum=1") as response:
            status = await response.json()
        version = status["weight_version"]
        if version is None or status["weights_incomplete"]:
            return
        fill = self.expected[version]
        assert status["checksum"] == filled(fill), (
            f"interleaving {self.index}: version {version!r} is published as complete but "
            f"the weights are not the fill {fill} its round sent"
        )


@uvloop_only
@pytest.mark.slow
async def test_two_clients_interleaved_at_random_never_publish_a_lie() -> None:
    """50 random interleavings of a trainer and a careless second client against a
    worker whose background apply fails in about a third of the updates: a version
    shown as complete always has exactly its round's weights."""
    rng = random.Random(23)
    app = build_app(tiny(), config=WeightTransferConfig(backend=NAIVE_DEFERRED_BACKEND))
    started = time.perf_counter()
    answers: dict[int, int] = {}
    expected: dict[str, float] = {}
    async with TestClient(TestServer(app)) as http:
        for index in range(INTERLEAVINGS):
            run = Interleaving(http, rng, index, expected)
            await run.init()
            for _ in range(rng.randrange(6, 14)):
                await (run.trainer_step() if rng.random() < 0.6 else run.other_step())
            await run.check()
            for status, count in run.answers.items():
                answers[status] = answers.get(status, 0) + count
    elapsed = time.perf_counter() - started
    print(f"{INTERLEAVINGS} interleavings in {elapsed:.1f}s; answers by status: {answers}")
    assert answers.get(200, 0) > 0 and answers.get(409, 0) > 0 and answers.get(500, 0) > 0
