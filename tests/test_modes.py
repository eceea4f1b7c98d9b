"""The refused combinations of fleet modes (`asyncwt/_core/modes.py`): every pair is
refused when the init info is built, naming both settings and their values."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from asyncwt import Chain, ShmTrainerInitInfo, Star, TcpTrainerInitInfo
from asyncwt._core.modes import REFUSED, Mode, check_modes
from asyncwt._core.round_plan import RoundChoices, choice_modes

_TCP_CHOICES: dict[str, list[Any]] = {
    "delta": [None, True],
    "senders": ["rank0", "owners"],
    "fanout": [Star(), Chain()],
    "on_worker_failure": ["fail", "drop"],
}


def _combinations(choices: dict[str, list[Any]]) -> list[dict[str, Any]]:
    return [dict(zip(choices, values)) for values in itertools.product(*choices.values())]


def _refused(cls: type, combination: dict[str, Any]) -> str | None:
    try:
        cls(rank=0, **combination)
    except ValueError as exc:
        return str(exc)
    return None


def test_tcp_refuses_ten_of_sixteen_combinations_at_construction() -> None:
    allowed = []
    for combination in _combinations(_TCP_CHOICES):
        message = _refused(TcpTrainerInitInfo, combination)
        if message is None:
            allowed.append(combination)
        else:
            assert " cannot be combined with " in message
    assert allowed == [
        {"delta": None, "senders": "rank0", "fanout": f, "on_worker_failure": w}
        for f, w in itertools.product([Star(), Chain()], ["fail", "drop"])
    ] + [
        {"delta": None, "senders": "owners", "fanout": Star(), "on_worker_failure": "fail"},
        {"delta": True, "senders": "rank0", "fanout": Star(), "on_worker_failure": "fail"},
    ]
    assert len(_combinations(_TCP_CHOICES)) - len(allowed) == 10


def test_shm_has_delta_and_senders_only_and_refuses_their_one_bad_pair() -> None:
    choices = {key: _TCP_CHOICES[key] for key in ("delta", "senders")}
    refused = [c for c in _combinations(choices) if _refused(ShmTrainerInitInfo, c)]
    assert refused == [{"delta": True, "senders": "owners"}]


@pytest.mark.parametrize(
    ("combination", "message"),
    [
        (
            {"delta": True, "fanout": Chain()},
            (
                r"^delta=Delta\(full_every=0, policy='auto'\) cannot be combined with "
                r"fanout=Chain\(\): a relay forwards"
            ),
        ),
        (
            {"delta": True, "on_worker_failure": "drop"},
            r"^delta=Delta\(.*\) cannot be combined with on_worker_failure='drop': ",
        ),
        (
            {"senders": "owners", "delta": True},
            (
                r"^senders='owners' cannot be combined with delta=Delta\(.*\): delta rounds "
                r"are encoded from rank 0's full tensors"
            ),
        ),
        (
            {"senders": "owners", "fanout": Chain()},
            r"^senders='owners' cannot be combined with fanout=Chain\(\): each owner rank",
        ),
        (
            {"senders": "owners", "on_worker_failure": "drop"},
            r"^senders='owners' cannot be combined with on_worker_failure='drop': ",
        ),
    ],
)
def test_each_refusal_names_both_settings_and_their_values(
    combination: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TcpTrainerInitInfo(rank=0, **combination)


def test_the_table_names_only_settings_the_infos_or_the_round_plan_describe() -> None:
    described = set(TcpTrainerInitInfo(rank=0).modes())
    assert described == set(_TCP_CHOICES) | {"receivers"}  # fanout=Star(slices=True)
    planned = set(choice_modes(RoundChoices()))
    assert planned == described
    for rule in REFUSED:
        assert {rule.first, rule.second} <= planned
        assert rule.first != rule.second
    assert len({(r.first, r.second) for r in REFUSED}) == len(REFUSED)


def test_a_setting_an_info_lacks_matches_no_rule() -> None:
    check_modes({"delta": Mode("on", "Delta()")})  # no fan-out: nothing to refuse
    with pytest.raises(ValueError, match=r"^delta=Delta\(\) cannot be combined with fanout=X: "):
        check_modes({"delta": Mode("on", "Delta()"), "fanout": Mode("chain", "X")})


def test_sliced_receivers_run_with_either_senders_over_the_star_raw_and_fail() -> None:
    """`fanout=Star(slices=True)`: Chain cannot carry it; delta and drop are refused,
    naming the setting as written; rank 0 and owner senders both run it."""
    choices = {**_TCP_CHOICES, "fanout": [Star(slices=True)]}
    allowed = [c for c in _combinations(choices) if _refused(TcpTrainerInitInfo, c) is None]
    assert allowed == [
        {
            "delta": None,
            "senders": senders,
            "fanout": Star(slices=True),
            "on_worker_failure": "fail",
        }
        for senders in ("rank0", "owners")
    ]
    message = _refused(TcpTrainerInitInfo, {"fanout": Star(slices=True), "delta": True})
    assert message is not None
    assert message.startswith("fanout=Star(slices=True) cannot be combined with delta=Delta(")
