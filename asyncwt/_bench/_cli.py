"""The benchmark's command line: `python -m asyncwt._bench [--quick|--tiny] [--out DIR]`."""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core.logs import add_log_level_option, configure_logging
from ._util import Rounds

if TYPE_CHECKING:
    from ._run import BenchSettings

__all__ = ["build_parser", "main"]


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"should be > 0, got {text}")
    return value


def _nonnegative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"should be >= 0, got {text}")
    return value


def _mib_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(float(v) * (1 << 20)) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"should be comma-separated MiB sizes, got {text!r}"
        ) from None
    if not values or any(v < 64 or v % 64 for v in values):
        raise argparse.ArgumentTypeError(f"sizes should be multiples of 64 bytes, got {text!r}")
    return values


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be comma-separated ints, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"counts should be >= 1, got {text!r}")
    return values


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError(f"should be comma-separated backend names, got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The options of `asyncwt bench`, in the order `--help` lists them."""
    parser = argparse.ArgumentParser(
        prog="asyncwt bench",
        description=(
            "Measure weight transfer from a trainer process to a worker process on a synthetic "
            "Llama-like model: the machine's limits, peer approaches, asyncwt per backend, "
            "overlap of slow stages, peak memory, and a bucket/buffer sweep. Prints a table, "
            "writes DIR/bench.json (every figure) and DIR/bench.png (with matplotlib)."
        ),
    )
    add_log_level_option(parser)
    _add_model_options(parser)
    _add_rounds_options(parser)
    _add_overlap_options(parser)
    _add_sweep_options(parser)
    _add_scope_options(parser)
    return parser


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    """The model's size (a preset or MiB) and asyncwt's buckets."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument(
        "--quick",
        action="store_const",
        dest="preset",
        const="quick",
        help=(
            "64 MiB model, 4 MiB buckets: a CI-sized run (about two minutes on 2 quiet cores); "
            "its speed bars are informational (INFO), set for the 1 GiB model"
        ),
    )
    size.add_argument(
        "--tiny",
        action="store_const",
        dest="preset",
        const="tiny",
        help="8 MiB model, 512 KiB buckets, smaller sweep: the test suite's smoke run",
    )
    parser.set_defaults(preset="default")
    parser.add_argument(
        "--model-mib",
        type=_positive_float,
        metavar="MIB",
        help="model size in MiB of bf16 weights (default: 1024; 64 with --quick)",
    )
    parser.add_argument(
        "--bucket-mib",
        type=_positive_float,
        metavar="MIB",
        help="asyncwt bucket size for the main runs (default 64; 4 with --quick)",
    )
    parser.add_argument(
        "--num-buffers", type=int, metavar="N", help="asyncwt buffers per side (default 2)"
    )
    parser.add_argument(
        "--read-streams",
        type=int,
        metavar="N",
        help="shm: concurrent reads per bucket on a direct-reading worker (default 0: one "
        "per core, at most 4)",
    )


def _add_rounds_options(parser: argparse.ArgumentParser) -> None:
    """How many rounds make a figure, and where the figures go."""
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        metavar="N",
        help="timed rounds per figure, >= 3; figures are medians (default %(default)s)",
    )
    parser.add_argument(
        "--headline-rounds",
        type=int,
        metavar="N",
        help="timed rounds of each backend's headline, each paired with a round of its "
        "limit, >= 3 (default: 15; 5 with --quick/--tiny)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        metavar="N",
        help="untimed rounds before them (default %(default)s)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out"),
        metavar="DIR",
        help="output folder for bench.json, bench.png and logs/ (default %(default)s)",
    )


def _add_overlap_options(parser: argparse.ArgumentParser) -> None:
    """The overlap test's slow stages and the worker's apply threads."""
    parser.add_argument(
        "--apply-threads",
        type=int,
        metavar="N",
        help="the worker's apply threads (default: asyncwt's default)",
    )
    parser.add_argument(
        "--gather-x",
        type=_nonnegative_float,
        metavar="X",
        help="overlap test: simulated gather alone = X times the wire alone (default 1)",
    )
    parser.add_argument(
        "--transform-x",
        type=_nonnegative_float,
        metavar="X",
        help="overlap test: worker transform alone = X times the wire alone (default 1)",
    )
    parser.add_argument(
        "--gather-ms",
        type=_nonnegative_float,
        metavar="MS",
        dest="gather_ms_per_tensor",
        help="overlap test: fixed gather milliseconds per tensor (overrides --gather-x)",
    )
    parser.add_argument(
        "--transform-ms",
        type=_nonnegative_float,
        metavar="MS",
        dest="transform_ms_per_bucket",
        help="overlap test: fixed transform milliseconds per full bucket (overrides --transform-x)",
    )
    parser.add_argument(
        "--whole-tensor-transform",
        action="store_true",
        help="overlap test: give the worker transform whole tensors (a chunked one after its "
        "last chunk) instead of declaring it elementwise",
    )


def _add_sweep_options(parser: argparse.ArgumentParser) -> None:
    """The bucket/buffer sweep's grid."""
    parser.add_argument(
        "--sweep-bucket-mib",
        type=_mib_list,
        metavar="A,B,...",
        help="sweep bucket sizes in MiB (default 16,64,256; 1,4,16 with --quick)",
    )
    parser.add_argument(
        "--sweep-buffers",
        type=_int_list,
        metavar="A,B,...",
        help="sweep buffer counts (default 1,2,4)",
    )


def _add_scope_options(parser: argparse.ArgumentParser) -> None:
    """What runs (backends, threads, the cluster bench, a saved report) and what counts."""
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        metavar="N",
        help="torch intra-op threads in every process; 0 keeps torch's default "
        "(default %(default)s: several OpenMP pools oversubscribe a small machine)",
    )
    parser.add_argument(
        "--backends",
        type=_name_list,
        metavar="A,B,...",
        help="asyncwt backends to run (default: every available one; tcp with --quick/--tiny)",
    )
    parser.add_argument(
        "--cluster",
        action="store_true",
        help="the cluster bench instead: emulated hosts with capped links "
        "(asyncwt bench --cluster --help)",
    )
    parser.add_argument("--no-sweep", action="store_true", help="skip the sweep")
    parser.add_argument("--no-chart", action="store_true", help="do not draw bench.png")
    parser.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="measure nothing: print the table of a saved bench.json and draw its chart into --out",
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="exit with status 3 when a bar FAILs (default: report only)",
    )


def _terminate(signum: int, frame: object) -> None:
    """SIGTERM unwinds like Ctrl-C, so that every child process is stopped on the way out."""
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; exit status 0 (bars are reported, not enforced, unless --strict).

    With `--cluster` the rest of the options go to the cluster bench
    (`asyncwt._bench.cluster.cli`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--cluster" in argv:
        from .cluster.cli import main as cluster_main

        return cluster_main([a for a in argv if a != "--cluster"])
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    try:
        configure_logging(args.log_level)
    except ValueError as exc:
        parser.error(str(exc))
    if args.from_json is not None:
        return _replay(args, parser)
    settings = _settings(args, parser)
    report = _measure(settings)
    if isinstance(report, int):
        return report
    return _conclude(report, settings, args)


def _replay(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """`--from-json`: print a saved report's table and draw its chart; measure nothing."""
    from ._report import format_table, write_chart

    try:
        saved = json.loads(args.from_json.read_text())
    except (OSError, ValueError) as exc:
        parser.error(f"--from-json {args.from_json}: {exc}")
    if args.no_chart:
        note = "chart skipped: --no-chart"
    else:
        note = write_chart(saved, args.out)[1]
    print(format_table(saved))
    print(note, flush=True)
    failed = any(bar["status"] == "FAIL" for bar in saved["bars"])
    return 3 if args.strict and failed else 0


def _settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchSettings:
    """The run's settings from the options; a usage error (exit 2) for a bad one."""
    from ._engines import available_backends
    from ._run import BenchSettings

    try:
        rounds = Rounds(rounds=args.rounds, warmup=args.warmup)
    except ValueError as exc:
        parser.error(str(exc))
    if args.headline_rounds is not None and args.headline_rounds < 3:
        parser.error(f"--headline-rounds should be >= 3, got {args.headline_rounds}")
    if args.torch_threads < 0:
        parser.error(f"--torch-threads should be >= 0, got {args.torch_threads}")
    if args.num_buffers is not None and args.num_buffers < 1:
        parser.error(f"--num-buffers should be >= 1, got {args.num_buffers}")
    if args.read_streams is not None and not 0 <= args.read_streams <= 8:
        parser.error(f"--read-streams should be in [0, 8], got {args.read_streams}")
    bucket = None
    if args.bucket_mib is not None:
        bucket = int(args.bucket_mib * (1 << 20)) // 64 * 64
        if bucket < 64:
            parser.error(f"--bucket-mib is too small: {args.bucket_mib}")
    settings = BenchSettings.from_preset(
        args.preset,
        model_mib=args.model_mib,
        bucket_bytes=bucket,
        num_buffers=args.num_buffers,
        read_streams=args.read_streams,
        rounds=rounds,
        headline_rounds=args.headline_rounds,
        out=args.out,
        apply_threads=args.apply_threads,
        gather_x=args.gather_x,
        transform_x=args.transform_x,
        transform_elementwise=not args.whole_tensor_transform,
        gather_ms_per_tensor=args.gather_ms_per_tensor,
        transform_ms_per_bucket=args.transform_ms_per_bucket,
        sweep_bucket_bytes=args.sweep_bucket_mib,
        sweep_num_buffers=args.sweep_buffers,
        sweep=not args.no_sweep,
        torch_threads=args.torch_threads,
        backends=args.backends or (("tcp",) if args.preset != "default" else None),
    )
    try:
        available_backends(settings.backends)
    except ValueError as exc:
        parser.error(f"--backends: {exc}")
    return settings


def _measure(settings: BenchSettings) -> dict[str, Any] | int:
    """Run every section, logging progress; the report, or the exit status of a failure.

    SIGTERM unwinds like Ctrl-C meanwhile, and `kill -USR1 PID` dumps the stacks.
    """
    from ._procs import BenchChildError
    from ._run import run_bench

    started = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - started:7.1f}s] {message}", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGTERM, _terminate)
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps the stacks of a stuck run
    try:
        return run_bench(settings, log=log)
    except BenchChildError as exc:
        print(f"asyncwt bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        print(
            f"asyncwt bench: interrupted ({exc or 'Ctrl-C'}); child processes stopped",
            file=sys.stderr,
        )
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _conclude(report: dict[str, Any], settings: BenchSettings, args: argparse.Namespace) -> int:
    """Ratios, bars, chart and JSON; print the table; the exit status (3: a bar FAILs)."""
    from ._report import add_ratios, evaluate_bars, format_table, write_chart, write_json

    add_ratios(report)
    report["bars"] = evaluate_bars(report)
    if args.no_chart:
        chart, note = None, "chart skipped: --no-chart"
    else:
        chart, note = write_chart(report, settings.out)
    report["chart"] = {"path": None if chart is None else str(chart), "note": note}
    path = write_json(report, settings.out)
    print(format_table(report))
    print(f"{note}\nevery figure: {path}", flush=True)
    if args.strict and any(bar["status"] == "FAIL" for bar in report["bars"]):
        return 3
    return 0
