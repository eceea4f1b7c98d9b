"""What a worker tells its operator: INFO logs of each round, Prometheus metrics on
`GET /metrics`, a cheap `GET /weights_status`, and a failing transform's traceback.

One worker process (`asyncwt worker --log-level INFO`) with a transform that fails
once a marker file exists: a round that lands, then one that fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import _models
import aiohttp
import pytest
from _faults import info_for, worker_env

from asyncwt import (
    ControlPlaneError,
    HttpClient,
    ModuleSource,
    Timeouts,
    model_checksum,
    trainer_init,
)
from asyncwt._worker.launch import start_worker, stop_worker

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])


pytestmark = pytest.mark.slow


def metric(text: str, name: str) -> float:
    """The value of the sample `name` (with its labels, as exposed) in `text`."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match is not None, f"{name} not in\n{text}"
    return float(match.group(1))


@uvloop_only
async def test_a_worker_logs_and_counts_its_rounds_and_a_failing_transform(
    tmp_path: Path,
) -> None:
    fail = tmp_path / "fail"
    stderr_path = tmp_path / "worker.err"
    model = _models.mixed()
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with stderr_path.open("wb") as stderr:
        proc, url = start_worker(
            "_models:mixed",
            "--backend=tcp",
            "--transform=_models:failing_transform",
            "--log-level=INFO",
            env=worker_env(ASYNCWT_TEST_FAIL=str(fail)),
            stderr=stderr,
        )
    try:
        async with HttpClient(url) as client, aiohttp.ClientSession() as http:
            engine = await trainer_init(
                info_for("tcp", timeouts=Timeouts(recv=10.0)),
                client=client,
                source=ModuleSource(model),
            )
            async with engine:
                told: list[tuple[int, int]] = []
                stats = await engine.send_weights(
                    weight_version="v1", progress=lambda sent, total: told.append((sent, total))
                )
                assert len(told) == stats.buckets > 1
                assert told[-1] == (nbytes, nbytes)
                assert [sent for sent, _ in told] == sorted({sent for sent, _ in told})
                # Cheap by default: no checksum unless asked for.
                (status,) = await client.weights_status()
                assert (status["weight_version"], status["checksum"]) == ("v1", None)
                (status,) = await client.weights_status(checksum=True)
                assert status["checksum"] == model_checksum(model)
                async with http.get(url + "/weights_status?checksum=maybe") as response:
                    assert response.status == 400
                    assert (await response.json())["error"] == (
                        "?checksum= should be 1, true, 0 or false, got 'maybe'"
                    )

                fail.touch()
                with pytest.raises(
                    ControlPlaneError, match="quantisation of w16 failed on purpose"
                ):
                    await engine.send_weights(weight_version="v2")

            async with http.get(url + "/metrics") as response:
                assert response.status == 200
                assert response.content_type == "text/plain"
                text = await response.text()
    finally:
        stop_worker(proc)
    log = stderr_path.read_text()

    assert metric(text, "asyncwt_worker_rounds_total") == 1
    assert metric(text, "asyncwt_worker_received_bytes_total") == nbytes
    assert metric(text, "asyncwt_worker_apply_seconds_count") == 1
    assert metric(text, "asyncwt_worker_trainer_connects_total") == 1
    assert metric(text, 'asyncwt_worker_weight_version_info{version="v1"}') == 1
    assert metric(text, "asyncwt_worker_last_publish_timestamp_seconds") > 0
    # The round's apply failed; the finish that drains it reports it.
    assert metric(text, 'asyncwt_worker_round_failures_total{stage="finish"}') == 1

    assert re.search(r"INFO asyncwt\.worker: trainer \S+ connected: TcpWorkerEngine", log), log
    assert re.search(rf"INFO asyncwt\.worker: round 1 received: {nbytes} bytes in ", log), log
    assert re.search(
        rf"INFO asyncwt\.worker: round 1 published as version v1: {nbytes} bytes in ", log
    ), log
    # The user's transform: its own traceback, down to the line that raised.
    assert "Traceback (most recent call last)" in log
    assert re.search(r'in failing_transform\n\s+raise RuntimeError\("quantisation of w16', log), log
    assert "RuntimeError: quantisation of w16 failed on purpose" in log
