"""`asyncwt worker --ranks N` (issue 35): one command serves a model sharded over N
ranks, each a process holding its shard; a trainer sends each only its slices."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import _slice_models as sm
import pytest
from _faults import info_for, worker_env

from asyncwt import HttpClient, ModuleSource, Star, trainer_init
from asyncwt._cli.main import main
from asyncwt._core.checksum import model_checksum

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])


@contextlib.contextmanager
def worker_group(model: str, ranks: int) -> Iterator[tuple[subprocess.Popen[str], list[str]]]:
    """`asyncwt worker --model MODEL --ranks RANKS`: the process and its ranks' URLs."""
    command = [sys.executable, "-m", "asyncwt", "worker", "--model", model, "--ranks", str(ranks)]
    group = subprocess.Popen(
        command, stdout=subprocess.PIPE, env=worker_env(), text=True, start_new_session=True
    )
    try:
        assert group.stdout is not None
        lines = [group.stdout.readline() for _ in range(ranks)]
        found = [re.search(rf"rank (\d+) of {ranks} listening on (http://\S+)", x) for x in lines]
        assert all(found), lines
        by_rank = sorted((int(m.group(1)), m.group(2)) for m in found if m is not None)
        yield group, [url for _, url in by_rank]
    finally:
        if group.poll() is None:  # the ranks too: they share its process group
            os.killpg(group.pid, signal.SIGKILL)
            group.wait()
        if group.stdout is not None:
            group.stdout.close()


@uvloop_only
@pytest.mark.slow
async def test_a_group_of_two_ranks_serves_each_its_shard_and_stops_on_sigterm() -> None:
    with worker_group("_slice_models:tp_rank", 2) as (group, urls):
        model = sm.full(seed=4)
        async with HttpClient(urls, timeout=30) as client:
            info = info_for("tcp", fanout=Star(slices=True))
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                stats = await engine.send_weights(weight_version="v1")
            for index, status in enumerate(await client.weights_status(checksum=True)):
                assert status["checksum"] == model_checksum(sm.shard_of(model, index, 2))
            assert stats.wire_bytes < stats.bytes  # each rank its half, not the model
        group.send_signal(signal.SIGTERM)
        assert group.wait(timeout=60) == 0


def test_ranks_must_be_positive_and_a_rank_inside_them(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["worker", "--model", "_slice_models:tp_rank"]
    assert main([*base, "--ranks", "0"]) == 2
    assert "--ranks should be an int >= 1, got 0" in capsys.readouterr().err
    assert main([*base, "--ranks", "2", "--rank", "2"]) == 2
    assert "--rank should be in [0, 2), got 2" in capsys.readouterr().err


def test_a_factory_without_rank_arguments_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    assert (
        main(["worker", "--model", "_slice_models:rank0_of_2", "--ranks", "2", "--rank", "0"]) == 2
    )
    assert "the factory should accept rank= and world_size=" in capsys.readouterr().err
