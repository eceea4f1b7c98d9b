"""The benchmark (`asyncwt bench`): a smoke run across real processes, no timing asserts.

The `--quick` run starts every child the full benchmark starts (raw sender, peer
workers, `asyncwt worker` servers, trainer processes) on a 64 MiB model and checks
that the report is complete and that every transfer arrived bit-exact. Speed is
reported by the benchmark, never asserted here: CI machines vary.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncwt._bench._cli import _settings, build_parser, main
from asyncwt._bench._cpu import CpuMeter, median_cores
from asyncwt._bench._floors import gather_wire_floors, transform_floor
from asyncwt._bench._limits import MemcpyLimit
from asyncwt._bench._memory import MemoryProbe
from asyncwt._bench._model import LlamaShape, SyntheticLlama, fill_random, worker_model_for
from asyncwt._bench._overlap import TransformConfig, set_transform_delay
from asyncwt._bench._paired import PairedBaselines, headline_limits
from asyncwt._bench._run import BALANCE_WITHIN, PAIR_ATTEMPTS, _summarize_sweep
from asyncwt._bench._util import Rounds
from asyncwt._core.checksum import model_checksum
from asyncwt._core.meta import ParamMeta
from asyncwt._core.plan import TransferPlan

SECTIONS = ["meta", "limits", "peers", "asyncwt", "overlap", "memory", "sweep", "bars", "chart"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "asyncwt", "bench", "--quick", "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads((out / "bench.json").read_text()), proc.stdout


@pytest.mark.timeout(600)
def test_bench_tiny_report_has_every_section(tiny_run: tuple[dict[str, Any], str]) -> None:
    report, _ = tiny_run
    assert list(report) == SECTIONS
    assert set(report["limits"]) == {"memcpy", "memcpy_2cores", "raw_loopback"}
    assert set(report["peers"]) == {"naive", "gloo", "packed"}
    assert report["meta"]["backends"] == ["tcp"]
    assert set(report["asyncwt"]["tcp"]) == {"direct", "staged"}
    for section in ("overlap", "memory", "sweep"):
        assert set(report[section]) == {"tcp"}
    overlap = report["overlap"]["tcp"]
    assert set(overlap["stage_alone_s"]) == {"gather", "wire", "transform"}
    assert {"gather", "send", "transform"} <= set(overlap["timeline"])
    pairs = overlap["pairs"]
    assert set(pairs) == {"gather+wire", "wire+transform"}
    assert set(pairs["gather+wire"]["stage_alone_s"]) == {"gather", "wire"}
    assert set(pairs["wire+transform"]["stage_alone_s"]) == {"wire", "transform"}
    for pair in pairs.values():  # the wire alone came from rounds interleaved with the pair
        alone = pair["overlapped"]["alone"]
        assert len(alone["rounds_s"]) == len(pair["overlapped"]["rounds_s"]) >= 5
        assert pair["stage_alone_s"]["wire"] == alone["median_s"]
        assert pair["timeline"] is not None and pair["floor"]
        # Calibrated again while off balance; the attempt closest to balance is kept.
        attempts = pair["attempts"]
        assert 1 <= len(attempts) <= PAIR_ATTEMPTS
        assert [a["kept"] for a in attempts].count(True) == 1
        kept = next(a for a in attempts if a["kept"])
        assert kept["off_balance"] == min(a["off_balance"] for a in attempts)
        assert kept["median_s"] == pair["overlapped"]["median_s"]
        assert all(a["off_balance"] > BALANCE_WITHIN for a in attempts[:-1])
    assert set(report["memory"]["tcp"]) == {"model_bytes", "direct", "staged"}
    assert {r["mode"] for r in report["sweep"]["tcp"]["rows"]} == {"direct", "staged"}


@pytest.mark.timeout(600)
def test_bench_tiny_every_transfer_is_bit_exact(tiny_run: tuple[dict[str, Any], str]) -> None:
    report, _ = tiny_run
    expected = report["meta"]["trainer_checksum"]
    for name, record in report["peers"].items():
        assert record["bit_exact"], name
    for path, record in report["asyncwt"]["tcp"].items():
        assert record["bit_exact"], path
        assert record["worker_checksum"] == expected, path
    assert report["overlap"]["tcp"]["overlapped"]["bit_exact"]
    assert report["overlap"]["tcp"]["more_buffers"]["bit_exact"]
    for name, pair in report["overlap"]["tcp"]["pairs"].items():
        assert pair["overlapped"]["bit_exact"], name
        assert pair["more_buffers"]["bit_exact"], name


@pytest.mark.timeout(600)
def test_bench_tiny_reports_ratios_and_bars(tiny_run: tuple[dict[str, Any], str]) -> None:
    report, stdout = tiny_run
    direct = report["asyncwt"]["tcp"]["direct"]
    assert set(direct["vs"]) == {
        "raw_loopback", "memcpy", "memcpy_2cores", "naive", "gloo", "packed"
    }  # fmt: skip
    assert {"iterate", "pack", "send"} <= set(direct["stage_busy_s"])
    # Cores each process kept busy (CPU seconds per wall second), on both ends.
    limit = 1.5 * (os.cpu_count() or 1) + 1  # a round of a few ticks rounds up
    assert set(direct["cores_busy"]) == {"trainer", "worker"}
    assert set(report["limits"]["raw_loopback"]["cores_busy"]) == {"sender", "receiver"}
    for busy in (direct["cores_busy"], report["limits"]["raw_loopback"]["cores_busy"]):
        assert all(0.0 <= v <= limit for v in busy.values()), busy
    assert "cores busy: trainer" in stdout and "cores busy: sender" in stdout
    # Paired in blocks of 2 (see the next test): 6 blocks, the first one's rounds warm-up.
    assert len(direct["rounds_s"]) == 11 and len(direct["warmup_s"]) == 1
    assert report["bars"] and all(
        b["status"] in {"PASS", "FAIL", "N/A", "INFO"} for b in report["bars"]
    )
    # 64 MiB: the speed bars (set for 1 GiB) are figures, not verdicts.
    assert [b["status"] for b in report["bars"] if "end-to-end" in b["bar"]] == ["INFO"]
    assert "(INFO: a speed bar set for the 1 GiB model" in stdout
    bit_exact_bar = [b for b in report["bars"] if "bit-exact" in b["bar"]]
    assert [b["status"] for b in bit_exact_bar] == ["PASS"]
    assert "BARS" in stdout and "TRANSFER" in stdout and "SWEEP" in stdout
    assert "paired with the baselines run right before it" in stdout
    chart = report["chart"]
    assert (chart["path"] is None) == ("skipped" in chart["note"])


@pytest.mark.timeout(600)
def test_bench_tiny_pairs_each_headline_round_with_the_baselines_before_it(
    tiny_run: tuple[dict[str, Any], str],
) -> None:
    report, _ = tiny_run
    direct = report["asyncwt"]["tcp"]["direct"]
    paired = direct["paired"]
    assert set(paired["baselines"]) == {"raw_loopback"}
    # tcp's limit, one raw loopback stream, pairs with the headline's own rounds, in
    # blocks of 2 rounds, the second of each block counting.
    assert paired["block"] == 2
    assert paired["asyncwt_s"]["raw_loopback"] == (direct["warmup_s"] + direct["rounds_s"])[3::2]
    for name, base in paired["baselines"].items():
        # One counted baseline round per block of asyncwt rounds, warm-up included.
        mine = paired["asyncwt_s"][name]
        assert len(base["rounds_s"]) == len(mine) == 5, name
        assert len(base["warmup_s"]) == len(direct["warmup_s"]), name
        expected = [b / a for b, a in zip(base["rounds_s"], mine, strict=True)]
        assert paired["ratios"][name] == pytest.approx(expected), name
        assert sorted(expected)[len(expected) // 2] == pytest.approx(paired["vs"][name]), name
    # The raw rounds use the chunk size that won the raw loopback figure at the start.
    start_variant = report["limits"]["raw_loopback"]["start"]["variant"]
    assert f"{paired['baselines']['raw_loopback']['chunk_bytes'] >> 20}MiB" == start_variant
    bars = {b["bar"]: b for b in report["bars"]}
    raw_bar = bars["asyncwt tcp end-to-end >= 0.9x one raw loopback TCP stream"]
    assert raw_bar["value"] == pytest.approx(paired["vs"]["raw_loopback"])
    assert not [name for name in bars if "naive" in name]  # that bar is retired


def test_shm_pairs_its_headline_with_one_and_two_cores_memcpy(tmp_path: Path) -> None:
    """The baselines of a shm headline are memcpy rounds in this process, one block
    of each before each block of asyncwt rounds; the bar's limit is one core's."""
    assert headline_limits("shm") == ("memcpy", "memcpy_2cores")
    assert headline_limits("tcp") == ("raw_loopback",)
    model = SyntheticLlama(LlamaShape.for_mib(4))
    rounds = Rounds(rounds=3, warmup=1)
    paired = PairedBaselines(
        model, LlamaShape.for_mib(4), rounds=rounds, raw_chunk=1 << 20,
        jobs={"direct": headline_limits("shm")}, log_dir=tmp_path,
    )  # fmt: skip
    with paired:
        every = [0.01 * (i + 1) for i in range(paired.job_rounds + rounds.warmup)]
        for i in range(len(every)):
            paired.between("direct", i)
            paired.between("another job", i)  # not paired: nothing runs
        record = {"warmup_s": every[:1], "rounds_s": every[1:]}
        result = paired.result({"direct": record}, "")
    assert set(result["vs"]) == {"memcpy", "memcpy_2cores"}
    for name, base in result["baselines"].items():
        assert len(base["rounds_s"]) == len(result["asyncwt_s"][name]) == rounds.rounds
        assert result["asyncwt_s"][name] == every[1::2][1:]
        expected = [b / a for b, a in zip(base["rounds_s"], every[1::2][1:], strict=True)]
        assert result["ratios"][name] == pytest.approx(expected)
    with pytest.raises(ValueError, match="each baseline to one job only"):
        PairedBaselines(
            model, LlamaShape.for_mib(4), rounds=rounds, raw_chunk=1,
            jobs={"a": ("memcpy",), "b": ("memcpy",)}, log_dir=tmp_path,
        )  # fmt: skip


def test_memcpy_on_two_cores_copies_every_byte_once() -> None:
    model = SyntheticLlama(LlamaShape.for_mib(4))
    fill_random(model, 3)
    limit = MemcpyLimit(model)
    for cores in (1, 2, 3):
        limit._dst.zero_()
        assert limit.round_s(cores) > 0
        flat = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in model.parameters()])
        assert torch.equal(limit._dst, flat), cores


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_overlap_pairs_script_runs_each_pair(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_pairs.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--preset", "tiny", "--reps", "1", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "tcp rep 0 gather+wire",
        "tcp rep 0 wire+transform",
    ]
    assert all("x the slower alone" in line for line in lines)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_shm_streams_script_pairs_each_count_with_memcpy(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "shm_streams.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--preset", "tiny", "--reps", "1", "--rounds", "3",
         "--streams", "3", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["shm rep 0 read_streams 3"]
    assert all("x one core's memcpy" in line and "bit-exact yes" in line for line in lines)


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_the_tcp_cpu_script_accounts_each_side_of_both_streams(tmp_path: Path) -> None:
    """Every side's CPU per round is read from /proc: each sender did system work
    (its copies into the socket), and the trainer's event loop is told apart."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "tcp_cpu.py"
    out = tmp_path / "cpu.json"
    proc = subprocess.run(
        [sys.executable, str(script), "--model-mib", "64", "--rounds", "3",
         "--out", str(tmp_path), "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    report = json.loads(out.read_text())
    assert len(report["vs_raw_rounds"]) == 3 and report["vs_raw"] > 0
    cpu = report["cpu_s_per_round"]
    assert set(cpu) >= {
        "raw sender", "raw receiver", "asyncwt worker", "asyncwt trainer, event loop",
    }  # fmt: skip
    # 64 MiB crossed the socket each round: the kernel's copies are system time on
    # both senders (ticks of 10 ms, so summed over both they cannot all read 0).
    assert cpu["raw sender"]["system"] + cpu["asyncwt trainer, event loop"]["system"] > 0
    assert "asyncwt against the raw stream" in proc.stdout


@pytest.mark.slow
def test_the_overlap_pairs_script_names_a_pair_it_does_not_know() -> None:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "overlap_pairs.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--pairs", "gather+wire,gather+transform"],
        check=False, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1].endswith(
        "--pairs should name pairs of ('gather+wire', 'wire+transform'), got 'gather+transform'"
    )


def test_llama_shape_for_mib_lands_near_the_target() -> None:
    for mib in (8, 64, 1024):
        shape = LlamaShape.for_mib(mib)
        assert 0.85 < shape.nbytes / (mib << 20) < 1.15, (mib, shape)


def test_llama_shape_round_trips_through_json() -> None:
    shape = LlamaShape.for_mib(64)
    assert LlamaShape.from_json(shape.to_json()) == shape
    with pytest.raises(ValueError, match=r"^a LlamaShape should be a JSON object"):
        LlamaShape.from_json('{"hidden": 1}')


def test_synthetic_llama_has_llama_names_in_order() -> None:
    shape = LlamaShape(hidden=32, intermediate=64, kv_dim=16, vocab=100, layers=2)
    model = SyntheticLlama(shape)
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in shape.param_shapes()]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    assert "model.layers.1.mlp.down_proj.weight" in names
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.nbytes == shape.nbytes


def test_fill_random_is_deterministic_and_differs_from_the_worker_model() -> None:
    shape = LlamaShape(hidden=64, intermediate=128, kv_dim=16, vocab=300, layers=2)
    a, b = SyntheticLlama(shape), SyntheticLlama(shape)
    fill_random(a, seed=3)
    fill_random(b, seed=3)
    assert model_checksum(a) == model_checksum(b)
    assert model_checksum(a) != model_checksum(worker_model_for(shape))


def test_rounds_require_a_median_of_at_least_three() -> None:
    with pytest.raises(ValueError, match=r"^rounds should be an int >= 3"):
        Rounds(rounds=2)
    record = Rounds(rounds=3, warmup=1).measure(iter([4.0, 1.0, 3.0, 2.0]).__next__, 10**9)
    assert record["warmup_s"] == [4.0] and record["median_s"] == 2.0 and record["gbps"] == 0.5


def test_cli_rejects_fewer_than_three_rounds() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--tiny", "--rounds", "2"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["--tiny", "--headline-rounds", "2"])
    assert exc.value.code == 2


def test_the_headline_pairs_more_rounds_than_a_figure_takes() -> None:
    """The 1 GiB run pairs 15 headline rounds by default (its bar is a median of
    per-round ratios that spread widely); CI-sized presets keep 5; the option wins."""
    parser = build_parser()
    assert _settings(parser.parse_args([]), parser).headline_rounds == 15
    assert _settings(parser.parse_args(["--tiny"]), parser).headline_rounds == 5
    args = parser.parse_args(["--headline-rounds", "7"])
    assert _settings(args, parser).headline_rounds == 7


def test_memory_probe_sees_a_touched_allocation() -> None:
    probe = MemoryProbe()
    probe.start()
    # Above glibc's largest mmap threshold (32 MiB), so the pages are fresh: a smaller
    # block may reuse heap pages an earlier test left resident, which RSS never shows.
    buffer = torch.ones(64 << 20, dtype=torch.uint8)
    window = probe.stop()
    del buffer
    assert window.extra_bytes >= 60 << 20


@pytest.mark.slow
def test_cpu_meter_tells_a_busy_process_from_a_sleeping_one() -> None:
    """Load-proof: this process spins until it has had 0.3 s of CPU (however long that
    takes on a busy machine), and the meter's reading is held to the process's own
    CPU clock, not to the wall clock (0.48 of 0.6 expected cores under load)."""
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        meter = CpuMeter({"this": None, "sleeper": sleeper.pid, "gone": 2**22 + 1})
        mark = meter.mark()
        start, cpu_start = time.perf_counter(), time.process_time()
        while time.process_time() - cpu_start < 0.3:  # spin: one core busy
            pass
        wall = time.perf_counter() - start
        busy = meter.cores_busy(mark, wall)
        used = time.process_time() - cpu_start
    finally:
        sleeper.kill()
        sleeper.wait()
    assert set(busy) == {"this", "sleeper"}  # a pid /proc does not know is left out
    # /proc counts in clock ticks (10 ms): the meter's CPU seconds match the process's.
    assert abs(busy["this"] * wall - used) <= 0.03 + 0.1 * used, (busy, wall, used)
    assert busy["sleeper"] * wall <= 0.02, (busy, wall)
    assert median_cores([busy, {"this": 0.0}, {"this": 4.0}]) == {
        "this": busy["this"],
        "sleeper": busy["sleeper"],
    }


RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


@pytest.mark.parametrize(
    ("run", "speed_statuses"),
    [("model-256mib", {"INFO"}), ("run-4a1fd38", {"PASS", "FAIL"})],
    ids=["256MiB", "1GiB"],
)
def test_speed_bars_are_informational_below_the_model_they_are_set_for(
    run: str, speed_statuses: set[str]
) -> None:
    """A run on another model than 1 GiB labels its speed bars INFO (no FAIL that only
    applies to 1 GiB); memory and bit-exactness stay verdicts at any size."""
    from asyncwt._bench._report import evaluate_bars, format_table

    report = json.loads((RESULTS / run / "bench.json").read_text())
    report["bars"] = evaluate_bars(report)
    speed = [b for b in report["bars"] if "memory" not in b["bar"] and "bit-exact" not in b["bar"]]
    others = [b for b in report["bars"] if b not in speed]
    assert speed and {b["status"] for b in speed} == speed_statuses
    assert others and {b["status"] for b in others} == {"PASS"}
    legend = "(INFO: a speed bar set for the 1 GiB model" in format_table(report)
    assert legend == (speed_statuses == {"INFO"})


def test_sweep_recommends_least_memory_within_five_percent_of_fastest() -> None:
    def row(bucket: int, buffers: int, median: float) -> dict[str, Any]:
        return {
            "mode": "direct",
            "config": {
                "bucket_bytes": bucket,
                "num_buffers": buffers,
                "budget_bytes": bucket * buffers,
            },
            "median_s": median,
            "rounds_s": [median] * 3,
            "gbps": 1 / median,
            "buckets": 1,
            "stage_busy_s": {},
            "memory": {"trainer": {"extra_bytes": 0}, "worker": {"extra_bytes": 0}},
        }

    summary = _summarize_sweep([row(64, 4, 1.00), row(16, 2, 1.04), row(4, 1, 1.50)])
    assert summary["fastest"]["direct"]["bucket_bytes"] == 64
    assert summary["recommended"]["direct"]["bucket_bytes"] == 16


def _two_tensor_plan(bucket_bytes: int) -> TransferPlan:
    metas = [ParamMeta("a", torch.uint8, (100,)), ParamMeta("b", torch.uint8, (100,))]
    return TransferPlan.build(metas, bucket_bytes=bucket_bytes, alignment=16)


def test_gather_wire_floor_waits_for_a_buckets_last_tensor() -> None:
    # Each tensor takes 1 s to gather and 1 s to send. Apart, b's gather overlaps a's
    # send (3 s); in one bucket, nothing is sent before b is gathered (2 + 2 s).
    assert gather_wire_floors(_two_tensor_plan(128), 2.0, 2.0) == {"bucket": 3.0, "tensor": 3.0}
    assert gather_wire_floors(_two_tensor_plan(256), 2.0, 2.0) == {"bucket": 4.0, "tensor": 3.0}


def test_transform_floor_runs_jobs_on_the_first_free_thread_once_their_bucket_arrived() -> None:
    plan = _two_tensor_plan(128)  # bucket 0 arrives at 1 s, bucket 1 at 2 s
    jobs = [(0, [("a", 128)]), (1, [("b", 64)]), (1, [("b", 64)])]  # 1 s, 0.5 s, 0.5 s
    assert transform_floor(plan, jobs, 2.0, 1.0, threads=1) == 3.0
    assert transform_floor(plan, jobs, 2.0, 1.0, threads=2) == 2.5
    assert transform_floor(plan, jobs[:1] + [(1, [("b", 128)])], 2.0, 1.0, threads=2) == 3.0


def test_the_bench_transform_follows_its_control_file(tmp_path: Path) -> None:
    control = str(tmp_path / "control")
    config = TransformConfig(s_per_bucket=0.5, bucket_bytes=100, control_path=control)
    assert config.delay_for(50) == 0.25  # no file yet: the configured delay
    for s_per_bucket in (0.0, 2.0, 0.0):
        set_transform_delay(control, s_per_bucket)
        assert config.delay_for(50) == s_per_bucket / 2
