"""The cluster bench (`asyncwt bench --cluster`): a CI-sized run, its cleanup on signals,
its refusal without root, and the pieces it is built from. No timing asserts.

The runs need root and network namespaces. They are not skipped without them: the
bench then exits with its own message (status 4), and these tests fail showing it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from asyncwt._bench.cluster.cli import EXIT_UNSUPPORTED, main, parse_rates
from asyncwt._bench.cluster.hosts import (
    Cluster,
    ClusterError,
    check_support,
    stale_namespaces,
    tbf_args,
)
from asyncwt._bench.cluster.signals import deferred_signals, interrupts_unwind

ROOT = Path(__file__).resolve().parent.parent


def _bench(out: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "asyncwt", "bench", "--cluster", "--quick", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )


def _namespaces(tag: str) -> list[str]:
    listing = subprocess.run(
        ["ip", "netns", "list"], check=False, capture_output=True, text=True
    ).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(f"{tag}-")]


def _root_links(tag: str) -> list[str]:
    listing = subprocess.run(
        ["ip", "-o", "link"], check=False, capture_output=True, text=True
    ).stdout
    return [line for line in listing.splitlines() if tag in line]


def _descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc's parent links)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# -- the CI-sized run -------------------------------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.slow
def test_cluster_quick_run_is_bit_exact_and_leaves_nothing(tmp_path: Path) -> None:
    proc = _bench(tmp_path)
    stdout, stderr = proc.communicate(timeout=540)
    assert proc.returncode == 0, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    report = json.loads((tmp_path / "cluster.json").read_text())
    rows = [
        (r["kind"], r["workers"], r["ranks"], r["rate"], r.get("senders"), r.get("topology"))
        for r in report["rows"]
    ]
    assert rows == [
        ("workers", 1, 1, "1 Gbit/s", None, "star"),
        ("workers", 2, 1, "1 Gbit/s", None, "star"),
        ("workers", 1, 1, "1 Gbit/s", None, "chain"),
        ("workers", 2, 1, "1 Gbit/s", None, "chain"),
        ("ranks", 2, 2, "1 Gbit/s", "rank0", "star"),
        ("ranks", 2, 2, "1 Gbit/s", "owners", "star"),
        ("layouts", 2, 2, "1 Gbit/s", "owners", "star"),
        ("layouts", 2, 2, "1 Gbit/s", "owners", "star"),
    ]
    model_bytes = report["meta"]["model"]["bytes"]
    sliced, whole = [r for r in report["rows"] if r["kind"] == "layouts"]
    assert (sliced["layout"], sliced["sliced"], whole["layout"]) == ("tp2", True, "whole")
    for row in (sliced, whole):  # every rank checked against its own shard's checksum
        assert row["bit_exact"] is True and len(row["rounds_s"]) == 3
        assert row["ideal_s"] == pytest.approx(max(row["plan_received"]) * 8 / 1e9)
        # Each host's link, counted by its interface: at least the plan's payload, and
        # little more (frame headers, the control plane).
        for i, planned in enumerate(row["plan_sent"]):
            assert planned <= row["link_bytes"][f"trainer rank {i}"] < planned * 1.1 + 2**20
        for i, planned in enumerate(row["plan_received"]):
            assert planned <= row["link_bytes"][f"worker {i}"] < planned * 1.1 + 2**20
    # Sliced ranks receive about half the model each; whole receivers all of it.
    assert max(sliced["plan_received"]) < 0.55 * model_bytes
    assert whole["plan_received"] == [model_bytes, model_bytes]
    assert "sliced rows within 1.25x of their ideal:" in stdout
    for row in report["rows"]:
        if row["kind"] == "layouts":
            continue
        assert row["bit_exact"] is True
        assert len(row["rounds_s"]) == 3 and len(row["warmup_s"]) == 1
        assert row["bytes_per_round"] == model_bytes
        assert row["ideal_s"] == pytest.approx(model_bytes * 8 / 1e9)
        one_copy = row.get("senders") == "owners" or row["topology"] == "chain"
        copies = 1 if one_copy else row["workers"]
        assert row["star_bound_s"] == pytest.approx(row["ideal_s"] * copies)
        if row["kind"] == "workers":  # counted on the trainer's link, frame headers included
            sent = row["trainer_link_bytes"]
            assert copies * model_bytes <= sent < copies * model_bytes * 1.1, row
        workers = {f"worker {i}" for i in range(row["workers"])}
        ranks = {f"trainer rank {i}" for i in range(row["ranks"])}
        assert set(row["cores_busy"]) == workers | ranks
        assert isinstance(row["cpu_bound"], bool)
    tag = report["meta"]["tag"]
    assert report["meta"]["cleanup"] == {"left_behind": []}
    assert _namespaces(tag) == [] and _root_links(tag) == []
    assert "cleanup: every namespace, link and queue removed" in stdout
    assert "owners / gathered, 1 Gbit/s M = 2:" in stdout
    assert (tmp_path / "cluster.md").read_text().startswith("Cluster bench:")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "chart skipped" in stdout
    else:
        assert (tmp_path / "cluster.png").stat().st_size > 0


# -- cleanup on signals -------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("signum", "when"),
    [
        (signal.SIGINT, "namespaces exist"),
        (signal.SIGINT, "a scenario runs"),
        (signal.SIGTERM, "a scenario runs"),
    ],
)
@pytest.mark.slow
def test_cluster_interrupted_leaves_no_namespace_link_or_process(
    tmp_path: Path, signum: int, when: str
) -> None:
    proc = _bench(tmp_path)
    tag = f"awt{proc.pid}"
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"the bench ended early:\n{proc.communicate()}"
            assert time.monotonic() < deadline, f"not reached within 180 s: {when}"
            if when == "namespaces exist":
                ready = bool(_namespaces(tag))
            else:  # the trainer rank of the first scenario has started
                ready = any(
                    p.name.startswith("workers-") for p in (tmp_path / "logs").glob("*.log")
                )
            if ready:
                break
            time.sleep(0.05)
        if when != "namespaces exist":
            time.sleep(1.0)  # into its rounds
        assert _namespaces(tag), "the bench made no namespace"
        children = _descendants(proc.pid)
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, f"stdout:\n{stdout}\nstderr:\n{stderr}"
    assert "interrupted" in stderr
    assert f"cluster {tag}: every namespace, link and queue removed" in stderr, stderr
    assert _namespaces(tag) == []
    assert _root_links(tag) == []
    assert [pid for pid in children if _alive(pid)] == []


# -- without root -------------------------------------------------------------------------


@pytest.mark.slow
def test_cluster_without_root_says_so_and_exits_nonzero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def not_root() -> None:
        check_support(geteuid=lambda: 1000)

    status = main(["--quick", "--out", str(tmp_path)], check=not_root)

    assert status == EXIT_UNSUPPORTED != 0
    err = capsys.readouterr().err
    assert err.startswith(
        "asyncwt bench --cluster: error: cannot emulate a cluster on this machine: it needs root"
    )
    assert "never falls back to uncapped loopback" in err
    assert not (tmp_path / "cluster.json").exists()
    assert _namespaces(f"awt{os.getpid()}") == []


def test_check_support_names_every_missing_piece() -> None:
    with pytest.raises(ClusterError) as info:
        check_support(geteuid=lambda: 1000, which=lambda _: None, netns_path="/nonexistent")
    message = str(info.value)
    for piece in ("root", "the `ip` command", "the `tc` command", "network namespaces"):
        assert piece in message
    check_support(geteuid=lambda: 0, which=lambda tool: f"/sbin/{tool}", netns_path="/")


# -- pieces -------------------------------------------------------------------------------


class _Recorder:
    """A runner that records commands and fails the `fail_at`-th one (from 0)."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.commands: list[list[str]] = []
        self.fail_at = fail_at

    def __call__(self, cmd: Sequence[str]) -> None:
        self.commands.append(list(cmd))
        if self.fail_at is not None and len(self.commands) - 1 == self.fail_at:
            raise ClusterError(f"`{' '.join(cmd)}` failed")


def test_cluster_names_carry_the_tag_and_fit_interface_names() -> None:
    runner = _Recorder()
    cluster = Cluster({"t0": 1, "w0": 101, "w7": 108}, tag="awt4194304", runner=runner)
    with cluster:
        cluster.set_rate(10**9)
        cluster.set_rate(None)
    for host in cluster.hosts.values():
        assert len(host.ifname) <= 15 and len(host.port) <= 15
    assert len(cluster.bridge) <= 15
    for cmd in runner.commands:
        tool, rest = cmd[0], cmd[1:]
        assert tool in ("ip", "tc")
        if rest[0] == "netns":  # netns add/del NAME
            assert rest[2].startswith("awt4194304-"), cmd
        else:  # every other command runs inside one of the run's own namespaces
            assert rest[0] == "-n" and rest[1].startswith("awt4194304-"), cmd
            names = [a for a in rest[2:] if a.startswith("awt")]
            assert all(n.startswith("awt4194304") for n in names), cmd
    adds = [c for c in runner.commands if c[1:3] == ["netns", "add"]]
    dels = [c for c in runner.commands if c[1:3] == ["netns", "del"]]
    assert sorted(c[3] for c in adds) == sorted(c[3] for c in dels)
    shaped = [c[5] for c in runner.commands if "tbf" in c]  # tc -n NS qdisc replace dev DEV
    unshaped = [c[5] for c in runner.commands if c[3:5] == ["qdisc", "del"]]
    assert len(shaped) == 6 and sorted(shaped) == sorted(unshaped)


@pytest.mark.parametrize("fail_at", [0, 1, 5, 9])
def test_cluster_failing_midway_removes_what_it_made(fail_at: int) -> None:
    runner = _Recorder(fail_at=fail_at)
    with pytest.raises(ClusterError), Cluster({"t0": 1, "w0": 101}, tag="awt1", runner=runner):
        pass
    made = runner.commands[: fail_at + 1]
    cleanup = runner.commands[fail_at + 1 :]
    created = [c[3] for c in made if c[1:3] == ["netns", "add"]]
    removed = [c[3] for c in cleanup if c[1:3] == ["netns", "del"]]
    assert sorted(removed) == sorted(created)  # including the one whose add failed
    ports = [c[5] for c in made if "veth" in c]  # ip -n BR link add PORT ... type veth ...
    assert sorted(c[5] for c in cleanup if c[3:5] == ["link", "del"]) == sorted(ports)


def test_stale_namespaces_are_those_of_dead_runs() -> None:
    dead = 4194303
    while os.path.exists(f"/proc/{dead}"):
        dead -= 1
    listing = f"awt{dead}-br\nawt{os.getpid()}-t0 (id: 3)\nother-ns\nawtx-br\n"
    assert stale_namespaces(listing) == [f"awt{dead}-br"]


def test_tbf_caps_with_a_bucket_for_two_gso_packets_or_a_millisecond() -> None:
    assert tbf_args(250 * 10**6) == [
        "tbf", "rate", "250000000bit", "burst", "131072", "latency", "20ms",
    ]  # fmt: skip
    assert tbf_args(10 * 10**9)[4] == "1250000"


def test_parse_rates() -> None:
    assert parse_rates("250M,1G,10g,none") == (250 * 10**6, 10**9, 10 * 10**9, None)
    assert parse_rates("1.5Gbit") == (1_500_000_000,)
    with pytest.raises(Exception, match=r"^rates should be like"):
        parse_rates("fast")


def test_senders_option_and_owner_ratios() -> None:
    from asyncwt._bench.cluster.cli import build_parser
    from asyncwt._bench.cluster.report import owners_ratios

    parser = build_parser()
    assert parser.parse_args(["--senders", "rank0,owners"]).senders == ("rank0", "owners")
    with pytest.raises(SystemExit):
        parser.parse_args(["--senders", "everyone"])
    row = {"rate_bps": 10**9, "rate": "1 Gbit/s", "ranks": 4}
    rows = [
        {**row, "senders": "rank0", "median_s": 4.0},
        {**row, "senders": "owners", "median_s": 1.0},
    ]
    (line, _) = owners_ratios(rows)
    assert line == (
        "- owners / gathered, 1 Gbit/s M = 4: 1.000 / 4.000 s = 0.250 (bar 1.15/M = 0.287: met)"
    )


def test_deferred_signals_hold_a_signal_until_cleanup_is_done() -> None:
    done = []
    after_cleanup = r"^stopped by SIGTERM \(after cleanup\)$"
    with (
        pytest.raises(KeyboardInterrupt, match=after_cleanup),
        interrupts_unwind(),
        deferred_signals(),
    ):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        done.append("cleanup")
    assert done == ["cleanup"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_stopped_by_sigterm_inside_a_cluster_block_removes_its_hosts() -> None:
    """`with Cluster(...)` unwinds on SIGTERM (a supervisor's stop, `kill`): a script such
    as benchmarks/delta_trajectory.py leaves no namespace or link behind."""
    tag = f"awtsig{os.getpid() % 10000}"
    script = (
        "import sys, time\n"
        "from asyncwt._bench.cluster.hosts import Cluster\n"
        "with Cluster({'a': 1, 'b': 2}, tag=sys.argv[1]):\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(100)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, tag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n", proc.stderr
        assert _namespaces(tag), "the script made no namespace"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "KeyboardInterrupt: stopped by SIGTERM" in stderr
    assert _namespaces(tag) == []
    assert _root_links(tag) == []
