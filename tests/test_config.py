"""The grouped trainer settings (`asyncwt/_core/config.py`): each group checks its own
fields by their full name, each backend shows only the fields it supports, a 0.1 flat
name says where it moved, and what the workers receive is unchanged."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re

import pytest

from asyncwt import (
    Chain,
    CudaIpcTrainerInitInfo,
    Delta,
    Listen,
    ShmTrainerInitInfo,
    Star,
    TcpTrainerInitInfo,
    Timeouts,
    TorchDistTrainerInitInfo,
    TrainerInitInfo,
    Tuning,
)
from asyncwt._core.config import MOVED

_COMMON = ["rank", "bucket_bytes", "num_buffers", "device", "partial", "timeouts", "tuning"]
_LINK = [*_COMMON, "listen", "token"]


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_each_backend_shows_only_the_fields_it_supports() -> None:
    assert _fields(TcpTrainerInitInfo) == [
        *_LINK,
        "senders",
        "delta",
        "fanout",
        "on_worker_failure",
    ]
    assert len(_fields(TcpTrainerInitInfo)) <= 14
    assert _fields(ShmTrainerInitInfo) == [
        *_LINK,
        "senders",
        "delta",
        "direct_reads",
        "read_streams",
    ]
    assert _fields(TorchDistTrainerInitInfo) == [
        *_LINK,
        "num_workers",
        "store_port",
        "group_backend",
    ]
    assert _fields(CudaIpcTrainerInitInfo) == _LINK


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Timeouts(send=0), r"^timeouts\.send should be a positive float, got 0$"),
        (lambda: Timeouts(rpc=1e9), r"^timeouts\.rpc should be at most 604800, got 1000000000\.0$"),
        (lambda: Timeouts(handshake="5"), r"^timeouts\.handshake should be a positive float, got '5'$"),
        (lambda: Listen(host=""), r"^listen\.host should be a host name or address .*got ''$"),
        (lambda: Listen(port=70000), r"^listen\.port should be an int in \[0, 65535\], got 70000$"),
        (lambda: Listen(advertise_host=3), r"^listen\.advertise_host should be a host name .*got 3$"),
        (lambda: Listen(max_workers=0), r"^listen\.max_workers should be a positive int, got 0$"),
        (
            lambda: Listen(max_pending_handshakes=-1),
            r"^listen\.max_pending_handshakes should be a positive int, got -1$",
        ),
        (lambda: Tuning(alignment=0), r"^tuning\.alignment should be a positive int, got 0$"),
        (lambda: Tuning(zero_copy=1), r"^tuning\.zero_copy should be a bool, got 1$"),
        (lambda: Delta(policy="fast"), r"^delta\.policy should be one of \['auto', 'always'\], got 'fast'$"),
        (lambda: TcpTrainerInitInfo(rank=0, timeouts=30), r"^timeouts should be a Timeouts, got 30$"),
        (lambda: TcpTrainerInitInfo(rank=0, listen="0.0.0.0"), r"^listen should be a Listen, got '0\.0\.0\.0'$"),
        (lambda: TcpTrainerInitInfo(rank=0, tuning=None), r"^tuning should be a Tuning, got None$"),
        (lambda: TcpTrainerInitInfo(rank=0, fanout=Chain), r"^fanout should be a Star or Chain, got <class "),
    ],
)  # fmt: skip
def test_every_group_names_the_setting_the_expected_and_the_actual_value(
    build: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]


def test_groups_are_frozen_keyword_only_and_default_to_todays_values() -> None:
    assert Timeouts() == Timeouts(
        connect=60.0, send=300.0, ready=300.0, recv=300.0, drain=300.0, rpc=600.0, handshake=10.0
    )
    assert Listen().host == "127.0.0.1"  # loopback unless told otherwise
    assert (Listen().port, Listen().max_workers, Listen().max_pending_handshakes) == (0, 64, 16)
    assert Tuning() == Tuning(alignment=64, zero_copy=True, read_ahead=4)
    assert Delta() == Delta(full_every=0, policy="auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Timeouts().send = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        Timeouts(60.0)  # type: ignore[misc]
    info = TcpTrainerInitInfo(rank=0)
    assert (info.timeouts, info.listen, info.tuning) == (Timeouts(), Listen(), Tuning())
    assert (info.delta, info.fanout, info.senders, info.on_worker_failure) == (
        None,
        Star(),
        "rank0",
        "fail",
    )


def test_delta_true_is_shorthand_for_delta_and_false_for_none() -> None:
    for cls in (TcpTrainerInitInfo, ShmTrainerInitInfo):
        assert cls(rank=0, delta=True).delta == Delta()
        assert cls(rank=0, delta=False).delta is None
        assert cls(rank=0, delta=Delta(full_every=3)).delta == Delta(full_every=3)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_flat_name_of_0_1_says_where_it_moved(old: str) -> None:
    for cls in (TcpTrainerInitInfo, ShmTrainerInitInfo, TorchDistTrainerInitInfo):
        with pytest.raises(TypeError, match=rf"^{cls.__name__}\(\) got the asyncwt 0\.1 setting {old}=1; it moved to {re.escape(MOVED[old])}"):  # fmt: skip
            cls(rank=0, **{old: 1})  # type: ignore[arg-type]


def test_init_infos_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        TcpTrainerInitInfo(1 << 20, rank=0)  # type: ignore[misc]


def test_what_the_workers_receive_is_unchanged() -> None:
    """The wire (`worker_fields()`, JSON to the workers) keeps 0.1's names and values."""
    info = TcpTrainerInitInfo(
        rank=0, num_buffers=3, partial=True, timeouts=Timeouts(connect=5.0, recv=6.0, drain=7.0)
    )
    assert info.worker_fields() == {
        "num_buffers": 3,
        "connect_timeout": 5.0,
        "recv_timeout": 6.0,
        "drain_timeout": 7.0,
        "partial": True,
    }
    assert TcpTrainerInitInfo(rank=0, delta=Delta(policy="always")).worker_fields()["delta"] is True
    assert "delta" not in ShmTrainerInitInfo(rank=0).worker_fields()
    settings = TcpTrainerInitInfo(
        rank=0,
        token="t" * 32,
        listen=Listen(host="0.0.0.0", port=7, advertise_host="h", max_workers=2),
        timeouts=Timeouts(send=1.0, ready=2.0, handshake=3.0),
    ).link_settings()
    assert (settings.host, settings.port, settings.advertise_host, settings.max_workers) == (
        "0.0.0.0",
        7,
        "h",
        2,
    )
    assert (settings.send_timeout, settings.ready_timeout, settings.handshake_timeout) == (
        1.0,
        2.0,
        3.0,
    )


@pytest.mark.parametrize(
    "info",
    [
        TcpTrainerInitInfo(rank=1, delta=True, timeouts=Timeouts(send=2.0)),
        ShmTrainerInitInfo(rank=0, listen=Listen(port=9)),
        TorchDistTrainerInitInfo(rank=0, num_workers=2),
    ],
    ids=["tcp", "shm", "torch_dist"],
)
def test_init_infos_copy_pickle_and_replace(info: TrainerInitInfo) -> None:
    assert copy.deepcopy(info) == info
    assert pickle.loads(pickle.dumps(info)) == info
    assert dataclasses.replace(info, rank=3).rank == 3  # type: ignore[type-var]
