"""The worker's round state machine: which control call may run now, and what it published.

Sans-I/O: plain synchronous transitions, no engine, no threads, no HTTP. The caller
(`RoundDriver`) asks before each engine call (`begin_*`, which raises
`RoundConflictError` and then changes nothing) and reports after it (`end_*`).
Called from one event loop, each transition is atomic.

The rules it keeps:

- A round is opened by `start` and closed by the `finish` that names it; a new
  `start` (or an init, or a shutdown) abandons the open round, which can then never
  publish.
- `finish` publishes its version only if the round it closes received at least one
  update, every update of it succeeded, and the engine's finish (its drain of
  background apply) succeeded. A round's failure is recorded on that round and is
  consumed by nothing else.
- A round id, where the calls carry one, binds the round: an update or finish for
  another round is refused, and round ids increase from one init to the next.
- A trainer id, where the calls carry one, must be the one the worker was
  initialised with.
- `weights_incomplete` becomes true when a failed round may have written into the
  weights and stays true, across engine shutdowns and inits, until a round publishes.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from .._core.errors import RoundConflictError

__all__ = ["Round", "RoundState", "UpdateTicket"]


@dataclass(eq=False)
class Round:
    """One round, from its `start` to the `finish` that closes it."""

    sequence: int
    """This worker's count of rounds opened, to name a round that carries no id."""
    round_id: int | None
    """The trainer's round id, from the start or bound by the first update."""
    named_at_start: bool
    """Whether the start carried the round id (then the finish must carry it too)."""
    trainer_id: str | None
    updates: int = 0
    """Updates of this round that succeeded."""
    in_flight: int = 0
    """Updates of this round still running."""
    error: str | None = None
    """The first failure of this round (an update, its start), if any."""
    finishing: bool = False

    @property
    def name(self) -> str:
        if self.round_id is not None:
            return f"round {self.round_id}"
        return f"round #{self.sequence} (started without a round id)"


@dataclass(eq=False)
class UpdateTicket:
    """An update admitted by `begin_update`, to be reported with `end_update`."""

    round: Round
    bound_id: bool
    """Whether this update bound the round's id (undone if the engine refuses it)."""
    previous_last_id: int


class RoundState:
    """The round state of one worker (see the module docstring for the rules)."""

    def __init__(self) -> None:
        self.initialized = False
        self.weight_version: str | None = None
        """The version the last published round carried."""
        self.weights_incomplete = False
        """Whether a failed round may have left the weights a mix of versions."""
        self.trainer_id: str | None = None
        """The trainer the worker was initialised with (None: the init named none)."""
        self.open_round: Round | None = None
        self._last_round_id = 0
        self._sequence = 0

    # -- the worker's life ----------------------------------------------------------

    def begin_init(self) -> None:
        """An init is running: the open round (of whatever trainer) is abandoned."""
        self.open_round = None

    def end_init(self, trainer_id: str | None) -> None:
        """An init succeeded: rounds now belong to `trainer_id`, ids count from 0."""
        self.initialized = True
        self.trainer_id = trainer_id or None
        self.open_round = None
        self._last_round_id = 0

    def shut_down(self) -> None:
        """The engine was shut down: no round is open; version and incompleteness stay."""
        self.initialized = False
        self.trainer_id = None
        self.open_round = None

    def note_incomplete(self, incomplete: bool) -> None:
        """The engine says its weights are a mix (sticky until a round publishes)."""
        self.weights_incomplete = self.weights_incomplete or incomplete

    # -- rounds -----------------------------------------------------------------------

    def start(self, *, round_id: int | None, trainer_id: str | None) -> Round:
        """Open a round, abandoning any open one."""
        self._check_trainer("start_weight_update", trainer_id)
        if round_id is not None and round_id <= self._last_round_id:
            raise RoundConflictError(
                f"start_weight_update for round {round_id} refused: round ids should "
                f"increase, and round {self._last_round_id} already started (a late or "
                f"replayed start)"
            )
        self._sequence += 1
        opened = Round(self._sequence, round_id, round_id is not None, trainer_id)
        if round_id is not None:
            self._last_round_id = round_id
        self.open_round = opened
        return opened

    def start_failed(self, round_: Round, error: str) -> None:
        """The engine's start failed: the round can never publish."""
        round_.error = round_.error or f"start_weight_update failed: {error}"

    def begin_update(
        self, *, round_id: int | None, trainer_id: str | None, carries_ids: bool = False
    ) -> UpdateTicket:
        """Admit an update into the open round.

        `carries_ids`: the engine's update infos name their round and trainer (asyncwt's
        do), so one that names none (None) is checked as naming none: it cannot join a
        round started with an id, nor a worker initialised with a trainer id. A round
        takes one update per round id (a second is a replay). Without `carries_ids`
        an update that names nothing joins whatever round is open.
        """
        what = "update_weights" + (f" for round {round_id}" if round_id is not None else "")
        self._check_trainer(what, trainer_id, required=carries_ids)
        current = self.open_round
        if current is None:
            raise RoundConflictError(
                f"{what} refused: no round is open; POST /start_weight_update first"
            )
        if current.finishing:
            raise RoundConflictError(f"{what} refused: {current.name} is finishing")
        if current.error is not None:
            raise RoundConflictError(
                f"{what} refused: {current.name} failed already ({current.error}); start "
                f"a new round"
            )
        bound, previous = False, self._last_round_id
        if round_id is not None or carries_ids:
            if current.round_id is not None and round_id != current.round_id:
                raise RoundConflictError(
                    f"{what} refused: the open round is {current.round_id} (a late update "
                    f"of an abandoned round, or another trainer's); {current.name} is not "
                    f"disturbed"
                )
            if round_id is not None and (current.updates or current.in_flight):
                raise RoundConflictError(
                    f"{what} refused: {current.name} already received its update_weights "
                    f"(a replayed update)"
                )
            if current.round_id is None and round_id is not None:
                if round_id <= self._last_round_id:
                    raise RoundConflictError(
                        f"{what} refused: round ids should increase, and round "
                        f"{self._last_round_id} already started (a late or replayed update)"
                    )
                current.round_id, self._last_round_id, bound = round_id, round_id, True
        current.in_flight += 1
        return UpdateTicket(current, bound, previous)

    def end_update(
        self, ticket: UpdateTicket, *, error: str | None = None, refused: bool = False
    ) -> None:
        """Report an admitted update: succeeded, failed (`error`), or `refused` by the
        engine before it changed anything (then it is as if it never came)."""
        round_ = ticket.round
        round_.in_flight -= 1
        if refused:
            # Undone only while its round is open: nothing started since, so the id it
            # bound is still the last one. An abandoned round's id stays spent (a start
            # since may have taken a later id, which must not be handed out again).
            undo = self.open_round is round_ and round_.updates == 0 and round_.in_flight == 0
            if ticket.bound_id and undo:
                round_.round_id, self._last_round_id = None, ticket.previous_last_id
        elif error is not None:
            round_.error = round_.error or f"update_weights failed: {error}"
        else:
            round_.updates += 1

    def begin_finish(self, *, round_id: int | None, trainer_id: str | None) -> Round:
        """Admit the finish that closes the open round."""
        what = "finish_weight_update" + (f" for round {round_id}" if round_id is not None else "")
        self._check_trainer(what, trainer_id)
        current = self.open_round
        if current is None:
            raise RoundConflictError(
                f"{what} refused: no round is open (it was finished already, abandoned by a "
                f"later start, or never started); nothing is published"
            )
        if round_id is not None and current.round_id != round_id:
            raise RoundConflictError(
                f"{what} refused: the open round is {current.name}; nothing is published"
            )
        if round_id is None and current.named_at_start:
            raise RoundConflictError(
                f"{what} refused: {current.name} was started with its round id, and a "
                f"finish that does not name it cannot close it"
            )
        if current.trainer_id is not None and not hmac.compare_digest(
            (trainer_id or "").encode(), current.trainer_id.encode()
        ):
            raise RoundConflictError(
                f"{what} refused: {current.name} was started by its trainer, and a finish "
                f"that does not name that trainer cannot close it; nothing is published"
            )
        if current.finishing:
            raise RoundConflictError(f"{what} refused: {current.name} is finishing already")
        if current.in_flight:
            raise RoundConflictError(
                f"{what} refused: {current.name} is still receiving "
                f"({current.in_flight} update_weights running)"
            )
        if current.updates == 0 and current.error is None:
            raise RoundConflictError(
                f"{what} refused: {current.name} received no update_weights, so it has no "
                f"weights to publish"
            )
        current.finishing = True
        return current

    def end_finish(self, round_: Round, version: str | None, *, error: str | None) -> str | None:
        """Close `round_`: publish `version` if the round and the engine's finish
        (`error` None) succeeded. Returns why nothing was published, or None."""
        if self.open_round is round_:
            self.open_round = None
        reason = round_.error or (f"finish_weight_update failed: {error}" if error else None)
        if reason is not None:
            return reason
        self.weight_version = version
        self.weights_incomplete = False
        return None

    def _check_trainer(self, what: str, trainer_id: str | None, *, required: bool = False) -> None:
        """Refuse a call naming another trainer than the init did (or, `required`, none)."""
        expected = self.trainer_id
        if expected is None or (trainer_id is None and not required):
            return
        if not hmac.compare_digest((trainer_id or "").encode(), expected.encode()):
            raise RoundConflictError(
                f"{what} refused: it names a trainer other than the one this worker was "
                f"initialised with (a stale trainer, or a stranger); run trainer_init to "
                f"take the worker over"
            )
