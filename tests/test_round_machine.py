"""The round state machine (`asyncwt._worker.rounds.RoundState`), driven directly by
hypothesis's stateful testing: no server, no sockets, no engine.

A rule-based machine calls init, start, update (admitted, then reported as succeeded,
failed or refused by the engine, in any order with the other calls), finish
(admitted, then reported), shutdown and the engine's incompleteness in any order,
with round and trainer ids that are current, stale, ahead, missing or a stranger's.
A small model says what each call should do; after every step the state must match
it, a refused call must have changed nothing, and a fresh round must still be able
to start, receive and publish (an abandoned or failed round never blocks the next).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from _server_models import NAIVE_DEFERRED_BACKEND, tiny
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from asyncwt import (
    ApplyError,
    RoundConflictError,
    TransferError,
    WeightTransferConfig,
    create_worker_engine,
)
from asyncwt._worker.round_driver import RoundDriver
from asyncwt._worker.rounds import Round, RoundState, UpdateTicket

INIT_TRAINERS = st.sampled_from(["T", "T", "U", None])
"""The trainer id an init names (None: an init that names none)."""
TRAINERS = st.sampled_from(["own", "own", "own", "none", "stranger"])
"""Whose trainer id a call names: the init's (mostly), none, or a stranger's."""
ROUND_IDS = st.sampled_from(["open", "open", "open", "next", "next", "none", "stale", "ahead"])
"""Which round id a call names: the open round's (mostly), the next, none, a stale
one, or one ahead."""
START_IDS = st.sampled_from(["next", "next", "next", "none", "none", "open", "stale", "ahead"])
"""Which round id a start names: the next (mostly), none, a replayed, stale or ahead one."""
CARRIES = st.sampled_from([True, True, False])
"""Whether an update's info names its round and trainer (asyncwt's do), or may name none."""
OUTCOMES = st.sampled_from(["ok", "ok", "ok", "error", "refused", "in flight"])
"""How the engine's update ends: received, failed, refused, or not yet (still running)."""
FAILS = st.sampled_from([False, False, False, True])
"""Whether the engine's call fails (a quarter of them)."""


def machine_settings(max_examples: int) -> settings:
    """Repeatable in CI: derandomized, no example database, no deadline."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


@dataclass(eq=False)
class ModelRound:
    """What the model knows of one round."""

    real: Round
    round_id: int | None
    named: bool
    trainer_id: str | None
    updates: int = 0
    in_flight: int = 0
    failed: bool = False
    finishing: bool = False


@dataclass(eq=False)
class ModelTicket:
    """An admitted update, still running in the (imagined) engine."""

    real: UpdateTicket
    round: ModelRound
    bound: int | None
    """The round id this update bound to its round, if it did."""


@dataclass
class Model:
    """The expected state, kept by simpler rules than `RoundState`'s own."""

    initialized: bool = False
    trainer_id: str | None = None
    ids: set[int] = field(default_factory=set)
    """Round ids accepted since the last init (by a start, or bound by an update)."""
    version: str | None = None
    incomplete: bool = False
    open: ModelRound | None = None

    @property
    def last(self) -> int:
        return max(self.ids, default=0)

    def stranger(self, trainer_id: str | None, *, required: bool = False) -> bool:
        """Whether a call naming `trainer_id` is refused as another trainer's."""
        if self.trainer_id is None or (trainer_id is None and not required):
            return False
        return trainer_id != self.trainer_id


def snapshot(state: RoundState) -> tuple[object, ...]:
    """Everything a refused call must leave as it was."""
    current = state.open_round
    fields = None
    if current is not None:
        fields = (
            current.round_id,
            current.named_at_start,
            current.updates,
            current.in_flight,
            current.error,
            current.finishing,
        )
    return (
        state.initialized,
        state.weight_version,
        state.weights_incomplete,
        state.trainer_id,
        current,
        fields,
        state._last_round_id,
        state._sequence,
    )


class RoundMachine(RuleBasedStateMachine):
    """`RoundState` against `Model`, one call at a time."""

    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.state = RoundState()
        self.model = Model()
        self.closing: tuple[Round, ModelRound] | None = None
        """A finish admitted and not yet reported (the engine's drain is running)."""
        self.versions = 0
        self.published_before: str | None = None
        self.publishes = 0
        self.publishes_seen = 0

    # -- helpers ----------------------------------------------------------------------

    def round_id(self, which: str) -> int | None:
        model = self.model
        if which == "open" and model.open is not None:
            # The open round's id; an update naming a round started without one binds
            # the next id (a trainer's round id naming that round).
            return model.last + 1 if model.open.round_id is None else model.open.round_id
        offsets = {"open": 0, "next": 1, "stale": -1, "ahead": 2}
        return None if which == "none" else max(0, model.last + offsets[which])

    def trainer_id(self, whose: str) -> str | None:
        own = self.model.trainer_id
        return {"own": own, "none": None, "stranger": "U" if own == "T" else "T"}[whose]

    def refused(self, call: str, phrase: str | None) -> bool:
        """Record that the next call should be refused with `phrase` (or admitted)."""
        self.expect = (call, phrase)
        self.before = snapshot(self.state)
        return phrase is not None

    def check_refusal(self, exc: RoundConflictError) -> None:
        call, phrase = self.expect
        message = str(exc)
        assert phrase is not None, f"{call} was refused, the model admits it: {message}"
        assert message.startswith(call) and " refused: " in message, message
        assert phrase in message, f"{call}: expected {phrase!r} in {message!r}"
        assert snapshot(self.state) == self.before, f"refused {call} changed the state"

    # -- the worker's life ------------------------------------------------------------

    @initialize(trainer_id=INIT_TRAINERS)
    def first_init(self, trainer_id: str | None) -> None:
        """Every run starts with a worker a trainer initialised (the common case)."""
        self.init(trainer_id, shut_down_first=False, engine_fails=False)

    @precondition(lambda self: self.closing is None)
    @rule(trainer_id=INIT_TRAINERS, shut_down_first=st.booleans(), engine_fails=FAILS)
    def init(self, trainer_id: str | None, shut_down_first: bool, engine_fails: bool) -> None:
        """A re-init (after a shutdown, or not) abandons the open round; the engine's
        init may fail, and then the worker is left as the shutdown left it."""
        if shut_down_first:
            self.shutdown()
        self.state.begin_init()
        self.model.open = None
        if engine_fails:
            return
        self.state.end_init(trainer_id)
        self.model.initialized, self.model.trainer_id = True, trainer_id
        self.model.ids = set()

    @precondition(lambda self: self.closing is not None)
    @rule()
    def shutdown(self) -> None:
        """A shutdown: it takes no lock, so it may come while a finish drains."""
        self.state.shut_down()
        self.model.initialized, self.model.trainer_id, self.model.open = False, None, None

    def engine_says(self, incomplete: bool) -> None:
        """The driver reports the engine's own `weights_incomplete` after a call."""
        self.state.note_incomplete(incomplete)
        self.model.incomplete = self.model.incomplete or incomplete

    # -- rounds -----------------------------------------------------------------------

    @precondition(lambda self: self.model.initialized and self.closing is None)
    @rule(which=START_IDS, whose=TRAINERS, engine_fails=FAILS)
    def start(self, which: str, whose: str, engine_fails: bool) -> None:
        if self.model.open is None:
            # An update and a finish with no round open (never started, finished, or
            # abandoned) are refused; they are tried here, not as rules of their own,
            # so that the search spends its steps on rounds.
            assert self.begin_update(which, whose, True) is None
            self.begin_finish(which, whose)
        model, round_id, trainer_id = self.model, self.round_id(which), self.trainer_id(whose)
        phrase = None
        if model.stranger(trainer_id):
            phrase = "names a trainer other than the one this worker was initialised with"
        elif round_id is not None and round_id <= model.last:
            phrase = f"round ids should increase, and round {model.last} already started"
        self.refused("start_weight_update", phrase)
        try:
            opened = self.state.start(round_id=round_id, trainer_id=trainer_id)
        except RoundConflictError as exc:
            self.check_refusal(exc)
            return
        assert phrase is None, f"start {round_id} admitted; the model says {phrase!r}"
        model.open = ModelRound(opened, round_id, round_id is not None, trainer_id)
        if round_id is not None:
            model.ids.add(round_id)
        if engine_fails:
            self.state.start_failed(opened, "RuntimeError: start failed on purpose")
            model.open.failed = True

    def update_refusal(
        self, round_id: int | None, trainer_id: str | None, carries_ids: bool
    ) -> str | None:
        model, current = self.model, self.model.open
        if model.stranger(trainer_id, required=carries_ids):
            return "names a trainer other than the one this worker was initialised with"
        if current is None:
            return "no round is open"
        if current.finishing:
            return "is finishing"
        if current.failed:
            return "failed already"
        if round_id is not None or carries_ids:
            if current.round_id is not None and round_id != current.round_id:
                return f"the open round is {current.round_id} (a late update"
            if round_id is not None and (current.updates or current.in_flight):
                return "already received its update_weights (a replayed update)"
            if current.round_id is None and round_id is not None and round_id <= model.last:
                return f"round ids should increase, and round {model.last} already started"
        return None

    @precondition(lambda self: self.model.initialized and self.model.open is not None)
    @rule(
        target=tickets,
        which=ROUND_IDS,
        whose=TRAINERS,
        carries_ids=CARRIES,
        outcome=OUTCOMES,
        engine_incomplete=st.booleans(),
    )
    def update(
        self, which: str, whose: str, carries_ids: bool, outcome: str, engine_incomplete: bool
    ) -> ModelTicket | None:
        """An update; the engine's call returns at once, or stays in flight (its ticket
        goes to `tickets`, for `end_update` to report later, among other calls)."""
        ticket = self.begin_update(which, whose, carries_ids)
        if ticket is None or outcome == "in flight":
            return ticket
        self.end_update(ticket, outcome, engine_incomplete)
        return None

    def begin_update(self, which: str, whose: str, carries_ids: bool) -> ModelTicket | None:
        round_id, trainer_id = self.round_id(which), self.trainer_id(whose)
        phrase = self.update_refusal(round_id, trainer_id, carries_ids)
        self.refused("update_weights", phrase)
        try:
            ticket = self.state.begin_update(
                round_id=round_id, trainer_id=trainer_id, carries_ids=carries_ids
            )
        except RoundConflictError as exc:
            self.check_refusal(exc)
            return None
        current = self.model.open
        assert phrase is None and current is not None, f"update admitted; model: {phrase!r}"
        assert ticket.round is current.real
        bound = None
        if current.round_id is None and round_id is not None:
            current.round_id, bound = round_id, round_id
            self.model.ids.add(round_id)
        current.in_flight += 1
        return ModelTicket(ticket, current, bound)

    @rule(
        ticket=consumes(tickets),
        outcome=OUTCOMES.filter(lambda outcome: outcome != "in flight"),
        engine_incomplete=st.booleans(),
    )
    def end_update(self, ticket: ModelTicket | None, outcome: str, engine_incomplete: bool) -> None:
        """The engine's update returns: received, failed, or refused before changing
        anything; then the engine says whether its weights are a mix."""
        if ticket is None:
            return
        self.engine_says(engine_incomplete)
        round_ = ticket.round
        round_.in_flight -= 1
        if outcome == "refused":
            self.state.end_update(ticket.real, refused=True)
            still_open = self.model.open is round_
            if ticket.bound is not None and still_open and not (round_.updates or round_.in_flight):
                # As if it never came: the round is unnamed again, the id unused. (An
                # abandoned round's id stays spent: later starts took greater ones.)
                round_.round_id = None
                self.model.ids.discard(ticket.bound)
        elif outcome == "error":
            self.state.end_update(ticket.real, error="ApplyError: failed on purpose")
            round_.failed = True
        else:
            self.state.end_update(ticket.real)
            round_.updates += 1

    @precondition(
        lambda self: self.model.initialized and self.model.open is not None and not self.closing
    )
    @rule(which=ROUND_IDS, whose=TRAINERS, drain=st.sampled_from(["ok", "ok", "fails", "held"]))
    def finish(self, which: str, whose: str, drain: str) -> None:
        """A finish; the engine's drain returns at once, or is held (then updates and a
        shutdown may come before `end_finish` reports it)."""
        self.begin_finish(which, whose)
        if self.closing is not None and drain != "held":
            self.end_finish(drain == "fails")

    def begin_finish(self, which: str, whose: str) -> None:
        model, current = self.model, self.model.open
        round_id, trainer_id = self.round_id(which), self.trainer_id(whose)
        phrase = None
        if model.stranger(trainer_id):
            phrase = "names a trainer other than the one this worker was initialised with"
        elif current is None:
            phrase = "no round is open"
        elif round_id is not None and current.round_id != round_id:
            phrase = "the open round is"
        elif round_id is None and current.named:
            phrase = "was started with its round id"
        elif current.trainer_id is not None and trainer_id != current.trainer_id:
            phrase = "was started by its trainer"
        elif current.in_flight:
            phrase = f"is still receiving ({current.in_flight} update_weights running)"
        elif current.updates == 0 and not current.failed:
            phrase = "received no update_weights"
        self.refused("finish_weight_update", phrase)
        try:
            closing = self.state.begin_finish(round_id=round_id, trainer_id=trainer_id)
        except RoundConflictError as exc:
            self.check_refusal(exc)
            return
        assert phrase is None and current is not None, f"finish admitted; model: {phrase!r}"
        assert closing is current.real
        current.finishing = True
        self.closing = (closing, current)

    @precondition(lambda self: self.closing is not None)
    @rule(engine_fails=FAILS)
    def end_finish(self, engine_fails: bool) -> None:
        """The engine's finish (its drain) returns or fails; the round publishes or not."""
        assert self.closing is not None
        closing, current = self.closing
        self.closing = None
        self.versions += 1
        version = f"v{self.versions}"
        error = "ApplyError: drain failed on purpose" if engine_fails else None
        reason = self.state.end_finish(closing, version, error=error)
        if self.model.open is current:
            self.model.open = None
        if current.failed or engine_fails:
            assert reason is not None, f"{version} of a failed round was published"
            return
        assert reason is None, f"a complete round did not publish: {reason}"
        self.model.version, self.model.incomplete = version, False
        self.publishes += 1

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def matches_the_model(self) -> None:
        state, model = self.state, self.model
        assert state.initialized == model.initialized
        assert state.trainer_id == (model.trainer_id or None)
        assert state.weight_version == model.version
        assert state.weights_incomplete == model.incomplete
        assert state._last_round_id == model.last, (state._last_round_id, sorted(model.ids))
        if model.open is None:
            assert state.open_round is None, state.open_round
            return
        current = state.open_round
        assert current is model.open.real
        assert current.round_id == model.open.round_id
        assert current.updates == model.open.updates
        assert current.in_flight == model.open.in_flight
        assert (current.error is not None) == model.open.failed
        assert current.finishing == model.open.finishing

    @invariant()
    def the_version_changes_only_on_a_successful_finish(self) -> None:
        changed = self.state.weight_version != self.published_before
        assert changed == (self.publishes == self.publishes_seen + 1), "published off a finish"
        self.published_before, self.publishes_seen = self.state.weight_version, self.publishes

    @invariant()
    def a_fresh_round_can_always_start_and_publish(self) -> None:
        """Whatever came before (abandoned, failed, refused rounds), the trainer's next
        round (a new id, its trainer) starts, receives and publishes."""
        if not self.state.initialized or self.closing is not None:
            return
        probe = copy.deepcopy(self.state)
        trainer_id, round_id = probe.trainer_id, probe._last_round_id + 1
        opened = probe.start(round_id=round_id, trainer_id=trainer_id)
        probe.end_update(probe.begin_update(round_id=round_id, trainer_id=trainer_id))
        assert probe.begin_finish(round_id=round_id, trainer_id=trainer_id) is opened
        assert probe.end_finish(opened, "probe", error=None) is None
        assert (probe.weight_version, probe.weights_incomplete) == ("probe", False)
        assert probe.open_round is None


RoundMachine.TestCase.settings = machine_settings(200)
test_round_state_against_its_model = RoundMachine.TestCase


# -- the driver and a deferred engine, no server ---------------------------------------


class DriverMachine(RuleBasedStateMachine):
    """`RoundDriver` (the server's path to an engine) with the naive deferred engine of
    the live interleaving test in tests/test_rounds.py, called in any order by a
    trainer and a careless second client: a version shown as complete always has
    exactly the weights of the last update admitted before its finish (the bulk of
    that test, without HTTP). The engine applies in the background and keeps no
    round state: its failures surface at whichever drain comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.portal_cm = start_blocking_portal()
        self.portal = self.portal_cm.__enter__()
        self.model = tiny()
        config = WeightTransferConfig(backend=NAIVE_DEFERRED_BACKEND)
        self.driver = RoundDriver(
            None, create=lambda: create_worker_engine(config, model=self.model)
        )
        self.fills: dict[str, float] = {}
        """Each version label's fill: that of the last update admitted before its finish."""
        self.last_fill = float("nan")
        self.round_id = 0
        self.versions = 0
        self.published: str | None = None
        self.answers: dict[str, int] = {}

    def call(self, fn: Callable[[], Awaitable[None]]) -> bool:
        """Run one control call; True if it succeeded, False if refused or failed."""
        try:
            self.portal.call(fn)
        except (RoundConflictError, TransferError, ApplyError) as exc:
            self.answers[type(exc).__name__] = self.answers.get(type(exc).__name__, 0) + 1
            return False
        self.answers["ok"] = self.answers.get("ok", 0) + 1
        return True

    def ids(self, which: str, whose: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        offsets = {"open": 0, "next": 1, "stale": -1, "ahead": 2}
        if which != "none":
            out["round_id"] = max(1, self.round_id + offsets[which])
        out["trainer_id"] = {"own": "T", "none": None, "stranger": "U"}[whose]
        return out

    @initialize()
    def first_init(self) -> None:
        assert self.call(functools.partial(self.driver.init, {"trainer_id": "T"}))

    @rule(shut_down_first=st.booleans())
    def reinit(self, shut_down_first: bool) -> None:
        """A restarted trainer (same id), with or without a shutdown first."""
        if shut_down_first:
            self.portal.call(functools.partial(self.driver.shutdown, drop=True))
        self.first_init()
        self.round_id = 0

    @rule(which=START_IDS, whose=TRAINERS)
    def start(self, which: str, whose: str) -> None:
        ids = self.ids(which, whose)
        if self.call(functools.partial(self.driver.start, **ids)) and "round_id" in ids:
            self.round_id = ids["round_id"]

    @rule(which=ROUND_IDS, whose=TRAINERS, fill=st.integers(1, 9), fail_apply=FAILS)
    def update(self, which: str, whose: str, fill: int, fail_apply: bool) -> None:
        info = {"fill": float(fill), "fail_apply": fail_apply, **self.ids(which, whose)}
        info["trainer_id"] = info["trainer_id"] or ""
        if self.call(functools.partial(self.driver.update, info)):
            self.last_fill = float(fill)

    @rule(which=ROUND_IDS, whose=TRAINERS, labelled=st.sampled_from([True, True, False]))
    def finish(self, which: str, whose: str, labelled: bool) -> None:
        version = None
        if labelled:
            self.versions += 1
            version = f"v{self.versions}"
            self.fills[version] = self.last_fill
        before = self.driver.state.weight_version
        ok = self.call(functools.partial(self.driver.finish, version, **self.ids(which, whose)))
        after = self.driver.state.weight_version
        assert after == (version if ok else before), (ok, before, after, version)
        if ok:
            self.published = version

    @invariant()
    def a_complete_version_has_its_rounds_weights(self) -> None:
        state = self.driver.state
        assert state.weight_version == self.published, "published off a successful finish"
        if state.weight_version is None or self.driver.weights_incomplete:
            return
        fill = self.fills[state.weight_version]
        for name, param in self.model.named_parameters():
            assert torch.all(param == fill), (
                f"version {state.weight_version!r} is published as complete but {name} is "
                f"not the fill {fill} its round sent"
            )

    def teardown(self) -> None:
        try:
            self.portal.call(functools.partial(self.driver.shutdown, drop=True))
        finally:
            self.portal_cm.__exit__(None, None, None)


DriverMachine.TestCase.settings = machine_settings(60)
test_round_driver_never_publishes_a_lie = DriverMachine.TestCase
