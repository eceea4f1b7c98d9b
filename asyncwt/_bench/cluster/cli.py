"""`asyncwt bench --cluster [--quick] [--out DIR]` (also `python benchmarks/cluster.py`)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from ..._core.logs import add_log_level_option, configure_logging
from .._procs import BenchChildError
from .._util import Rounds
from .hosts import ClusterError, ClusterUnsupportedError, check_support
from .layouts import Layout
from .signals import interrupts_unwind

__all__ = ["EXIT_UNSUPPORTED", "build_parser", "main", "parse_rates"]

MiB = 1 << 20
EXIT_UNSUPPORTED = 4
"""Exit status when this machine cannot emulate hosts (no root, iproute2 or netns)."""

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rates(text: str) -> tuple[int | None, ...]:
    """`250M,1G,10G,none` → bits per second (None: uncapped)."""
    rates: list[int | None] = []
    for item in (t.strip().lower() for t in text.split(",")):
        if item in ("none", "uncapped", "0"):
            rates.append(None)
            continue
        number = item.removesuffix("bit").removesuffix("bps")
        unit = number[-1:] if number[-1:] in _UNITS else ""
        try:
            value = float(number[: len(number) - len(unit)]) * _UNITS[unit]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"rates should be like 250M,1G,10G,none (bits per second), got {item!r}"
            ) from None
        if value < 10**5:
            raise argparse.ArgumentTypeError(f"a rate should be at least 100k, got {item!r}")
        rates.append(int(value))
    if not rates:
        raise argparse.ArgumentTypeError(f"should name at least one rate, got {text!r}")
    return tuple(rates)


def _counts(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be comma-separated ints, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"counts should be >= 1, got {text!r}")
    return values


def _topologies(text: str) -> tuple[str, ...]:
    values = tuple(t.strip() for t in text.split(",") if t.strip())
    if not values or any(v not in ("star", "chain") for v in values):
        raise argparse.ArgumentTypeError(f"should be star, chain or star,chain; got {text!r}")
    return values


PRESETS = {
    "default": {"model_mib": 32.0, "workers": (1, 2, 4, 8), "ranks": (1, 2, 4),
                "rates_bps": (250 * 10**6, 10**9, 10 * 10**9, None)},
    "quick": {"model_mib": 16.0, "workers": (1, 2), "ranks": (2,), "rates_bps": (10**9,),
              "senders": ("rank0", "owners"), "topologies": ("star", "chain"),
              "layouts": ("tp2",), "layout_ranks": (2,)},
}  # fmt: skip
"""`quick`: one and two workers (star and chain), two FSDP2 ranks (gathered and
owner senders), and two owner ranks to one engine of two sliced ranks, a 16 MiB model,
1 Gbit/s: CI-sized."""


def _senders(text: str) -> tuple[str, ...]:
    modes = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [m for m in modes if m not in ("rank0", "owners")]
    if not modes or bad or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(
            f"--senders should list rank0 and/or owners, comma-separated, got {text!r}"
        )
    return modes


def _layouts(text: str) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    try:
        return tuple(Layout.parse(name).name for name in names)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--layouts: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncwt bench --cluster",
        description=(
            "Emulate a cluster on this machine (root needed): every host a network namespace "
            "behind a bridge, every link capped both ways by tc's token bucket; time a round "
            "from one trainer to N workers and from M FSDP2 ranks to M workers at each link "
            "rate, next to the link-limited ideal. Writes DIR/cluster.md, cluster.json and "
            "cluster.png. Exits with status 4, measuring nothing, where hosts cannot be "
            "emulated."
        ),
    )
    parser.add_argument(
        "--quick",
        action="store_const",
        dest="preset",
        const="quick",
        default="default",
        help="N = 1, 2 workers (star and chain), M = 2 ranks (both senders) and M = 2 to "
        "tp2, 16 MiB model, 1 Gbit/s only: CI-sized",
    )
    parser.add_argument("--model-mib", type=float, metavar="MIB", help="model size (default 32)")
    parser.add_argument(
        "--workers", type=_counts, metavar="A,B,...", help="worker counts N (default 1,2,4,8)"
    )
    parser.add_argument(
        "--topology",
        type=_topologies,
        metavar="T,...",
        help="tcp topologies of the one-trainer rows: star, chain or both (default star)",
    )
    parser.add_argument(
        "--ranks",
        type=_counts,
        metavar="A,B,...",
        help="FSDP2 trainer rank counts M, each to M workers (default 1,2,4; empty: none)",
    )
    parser.add_argument(
        "--senders",
        type=_senders,
        metavar="S,...",
        help="who sends in the FSDP2 scenarios: rank0 (gathers, today's default), owners "
        "(every rank its own shards), or both: rank0,owners (default rank0)",
    )
    parser.add_argument(
        "--layouts",
        type=_layouts,
        metavar="L,...",
        help="M:N rows: receiving engines of tensor-parallel ranks, each rank a host, "
        "as [Kx]tpN (tp2,tp4,2xtp2); each beside as many whole-model receivers "
        "(default: none)",
    )
    parser.add_argument(
        "--layout-ranks",
        type=_counts,
        metavar="A,B,...",
        help="trainer rank counts M of the M:N rows (1: rank 0 sends; more: FSDP2 owner "
        "senders) (default 1,2,4)",
    )
    parser.add_argument(
        "--rates",
        type=parse_rates,
        metavar="R,...",
        help="link rates in bit/s, 'none' uncapped (default 250M,1G,10G,none)",
    )
    parser.add_argument(
        "--bucket-mib", type=float, default=4.0, metavar="MIB", help="bucket (default 4)"
    )
    parser.add_argument("--num-buffers", type=int, default=2, metavar="N", help="(default 2)")
    parser.add_argument("--rounds", type=int, default=3, metavar="N", help="timed rounds (>= 3)")
    parser.add_argument("--warmup", type=int, default=1, metavar="N", help="warm-up rounds")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out/cluster"),
        metavar="DIR",
        help="output folder (default %(default)s)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads per process; 0: torch's default (default 1)",
    )
    parser.add_argument(
        "--cpu-bound-cores",
        type=float,
        metavar="C",
        help="flag a row CPU-bound when its processes keep >= C cores busy "
        "(default 0.85 x this machine's CPUs)",
    )
    parser.add_argument("--no-chart", action="store_true", help="do not draw cluster.png")
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="measure nothing: print a saved cluster.json's table and redraw its chart",
    )
    add_log_level_option(parser)
    return parser


def main(argv: Sequence[str] | None = None, *, check: Callable[[], None] = check_support) -> int:
    """Run the cluster bench; 0 on success, 4 where hosts cannot be emulated, 1 on a
    failure, 130 when interrupted (after cleanup)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        configure_logging(args.log_level)
    except ValueError as exc:
        parser.error(str(exc))

    from .report import format_table, write_chart, write_json, write_table
    from .run import ClusterSettings, derive, run_cluster

    if args.from_json is not None:
        try:
            saved = json.loads(args.from_json.read_text())
        except (OSError, ValueError) as exc:
            parser.error(f"--from-json {args.from_json}: {exc}")
        settings = saved["meta"]["settings"]
        for row in saved["rows"]:  # judged by this code's rules, not the saved run's
            derive(
                row,
                saved["meta"]["model"]["bytes"],
                settings["cpu_bound_cores"],
                settings["cpu_bound_process"],
            )
        note = "chart skipped: --no-chart" if args.no_chart else write_chart(saved, args.out)[1]
        print(format_table(saved))
        print(note, flush=True)
        return 0

    try:
        rounds = Rounds(rounds=args.rounds, warmup=args.warmup)
    except ValueError as exc:
        parser.error(str(exc))
    if args.num_buffers < 1:
        parser.error(f"--num-buffers should be >= 1, got {args.num_buffers}")
    bucket = int(args.bucket_mib * MiB) // 64 * 64
    if bucket < 64:
        parser.error(f"--bucket-mib is too small: {args.bucket_mib}")
    preset = PRESETS[args.preset]
    overrides = {
        "model_mib": args.model_mib,
        "workers": args.workers,
        "topologies": args.topology,
        "ranks": args.ranks,
        "senders": args.senders,
        "layouts": args.layouts,
        "layout_ranks": args.layout_ranks,
        "rates_bps": args.rates,
        "cpu_bound_cores": args.cpu_bound_cores,
    }
    values = {**preset, **{k: v for k, v in overrides.items() if v is not None}}
    if not values["workers"] and not values["ranks"] and not values.get("layouts"):
        parser.error("--workers, --ranks and --layouts are all empty: nothing to measure")
    if values.get("layouts") and not values.get("layout_ranks", (1,)):
        parser.error("--layout-ranks is empty while --layouts is not: nothing to send with")
    settings = ClusterSettings(
        preset=args.preset,
        bucket_bytes=bucket,
        num_buffers=args.num_buffers,
        rounds=rounds,
        out=args.out,
        torch_threads=args.torch_threads,
        **values,
    )
    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", file=sys.stderr, flush=True)

    try:
        with interrupts_unwind():
            report = run_cluster(settings, log=log, check=check)
    except ClusterUnsupportedError as exc:
        print(f"asyncwt bench --cluster: error: {exc}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    except (BenchChildError, ClusterError, RuntimeError) as exc:
        print(f"asyncwt bench --cluster: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(
            f"asyncwt bench --cluster: interrupted ({exc or 'Ctrl-C'}); processes stopped "
            "(the cleanup line above says what was removed)",
            file=sys.stderr,
        )
        return 130
    report["meta"]["command"] = shlex.join(["asyncwt", "bench", "--cluster", *argv])
    if args.no_chart:
        note = "chart skipped: --no-chart"
    else:
        note = write_chart(report, settings.out)[1]
    report["chart"] = note
    path = write_json(report, settings.out)
    table = write_table(report, settings.out)
    print(format_table(report))
    print(f"{note}\nevery figure: {path}; the table: {table}", flush=True)
    return 0
