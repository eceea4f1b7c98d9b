"""Run only shm's headline against one core's memcpy, per `read_streams`: an A/B tool.

The shm bar is its end-to-end round (the worker's model updated) against one core's
memcpy, paired round by round. This runs that headline alone for each given count
of concurrent reads per bucket (`ShmTrainerInitInfo.read_streams`; 0 is the
default, one per core the worker may run on), in turn, several times, so that the
counts meet the machine in the same minutes:

    python benchmarks/shm_streams.py --streams 1,2,0 --reps 3

Each line is one count of one repetition: the median of the per-round ratios
against one core's memcpy (the bar's figure) and against two cores', the rounds,
and the cores the trainer and the worker kept busy. Same pairing as `asyncwt bench`
(`asyncwt._bench._paired`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

from asyncwt._bench import _run
from asyncwt._bench._engines import TrainerJob, available_backends, run_trainer
from asyncwt._bench._model import MODEL_ENV, LlamaShape, SyntheticLlama, fill_random
from asyncwt._bench._paired import PairedBaselines, headline_limits
from asyncwt._bench._procs import start_asyncwt_worker
from asyncwt._bench._util import Rounds
from asyncwt._core.checksum import model_checksum


def _counts(text: str) -> list[int]:
    try:
        counts = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be comma-separated ints, got {text!r}") from None
    if not counts or any(c < 0 for c in counts):
        raise argparse.ArgumentTypeError(f"counts should be >= 0, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--streams", type=_counts, default=[1, 0],
        help="comma-separated read_streams values, 0 = the default (default 1,0)",
    )  # fmt: skip
    parser.add_argument("--reps", type=int, default=2, help="repetitions (default 2)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument(
        "--preset", choices=sorted(_run.PRESETS), default="default",
        help="model and bucket sizes, as asyncwt bench's (default: the 1 GiB model)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-streams-out"), help="logs folder")
    args = parser.parse_args(argv)
    if not available_backends(["shm"]):
        parser.error("the shm backend is not available here")
    settings = _run.BenchSettings.from_preset(args.preset, out=args.out)
    torch.set_num_threads(settings.torch_threads)
    shape = LlamaShape.for_mib(settings.model_mib)
    model = SyntheticLlama(shape)
    fill_random(model, settings.seed)
    expected = model_checksum(model)
    log_dir = settings.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**settings.child_env(), MODEL_ENV: shape.to_json()}
    backend = available_backends(["shm"])[0]
    rounds = Rounds(rounds=args.rounds, warmup=1)
    for rep in range(args.reps):
        for streams in args.streams:
            config = dataclasses.replace(settings.config, read_streams=streams)
            paired = PairedBaselines(
                model, shape, rounds=rounds, raw_chunk=1 << 20,
                jobs={PairedBaselines.RAW_JOB: headline_limits("shm")}, log_dir=log_dir,
                env=settings.child_env(),
            )  # fmt: skip
            worker, url = start_asyncwt_worker(
                backend="shm", log_dir=log_dir, env=env, role="worker-shm-streams"
            )
            with worker, paired:
                job = TrainerJob(
                    label=PairedBaselines.RAW_JOB, config=config, verify=True,
                    rounds=paired.job_rounds, gated=True,
                )  # fmt: skip
                checksum, records = run_trainer(
                    backend, url=url, worker=worker, shape=shape, seed=settings.seed,
                    rounds=rounds, jobs=[job], log_dir=log_dir, env=env,
                    between_rounds=paired.between,
                )  # fmt: skip
                result = paired.result({job.label: records[0]}, expected)
            record = records[0]
            exact = checksum == expected and record["bit_exact"]
            ratios = " ".join(f"{r:.2f}" for r in result["ratios"]["memcpy"])
            busy = ", ".join(f"{k} {v:.2f}" for k, v in record["cores_busy"].items())
            print(
                f"shm rep {rep} read_streams {streams}: {result['vs']['memcpy']:.2f}x one "
                f"core's memcpy (rounds {ratios}), {result['vs']['memcpy_2cores']:.2f}x two "
                f"cores'; {record['gbps']:.2f} GB/s; cores busy: {busy}; "
                f"bit-exact {'yes' if exact else 'NO'}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
