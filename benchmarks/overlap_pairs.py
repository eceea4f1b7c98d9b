"""Run only the benchmark's two-stage overlap pairs, several times: a quick A/B tool.

The full benchmark takes about 13 minutes; a design change that touches overlap
(pipeline depth, buffer count, scheduling) is judged faster on the pairs alone,
run a few times because the machine is noisy:

    python benchmarks/overlap_pairs.py --backends tcp,shm --reps 2

Each line is one pair of one repetition: total against the slower stage alone (the
bar's figure), the same paired round by round, the stages' balance, and the
figure with more buffers. Same pairs, calibration and figures as
`asyncwt bench` (`asyncwt._bench._run._overlap_pairs`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from asyncwt._bench import _run
from asyncwt._bench._engines import TrainerJob, available_backends, run_trainer
from asyncwt._bench._model import MODEL_ENV, LlamaShape, SyntheticLlama, fill_random
from asyncwt._bench._procs import Child


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="tcp", help="comma-separated (default tcp)")
    parser.add_argument("--reps", type=int, default=2, help="repetitions (default 2)")
    parser.add_argument(
        "--pairs", default=",".join(_run.PAIR_NAMES),
        help=f"comma-separated, of {', '.join(_run.PAIR_NAMES)} (default: both)",
    )  # fmt: skip
    parser.add_argument(
        "--preset", choices=sorted(_run.PRESETS), default="default",
        help="model and bucket sizes, as asyncwt bench's (default: the 1 GiB model)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench-pairs-out"), help="logs folder")
    args = parser.parse_args(argv)
    pair_names = args.pairs.split(",")
    for name in pair_names:
        if name not in _run.PAIR_NAMES:
            parser.error(f"--pairs should name pairs of {_run.PAIR_NAMES}, got {name!r}")
    settings = _run.BenchSettings.from_preset(args.preset, out=args.out)
    torch.set_num_threads(settings.torch_threads)
    shape = LlamaShape.for_mib(settings.model_mib)
    model = SyntheticLlama(shape)
    fill_random(model, settings.seed)
    log_dir = settings.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    env = {**settings.child_env(), MODEL_ENV: shape.to_json()}
    for backend in available_backends(args.backends.split(",")):

        def trainer(
            worker: Child, url: str, jobs: list[TrainerJob], backend: Any = backend
        ) -> list[dict[str, Any]]:
            _, records = run_trainer(
                backend, url=url, worker=worker, shape=shape, seed=settings.seed,
                rounds=settings.rounds, jobs=jobs, log_dir=log_dir, env=env,
            )  # fmt: skip
            return records

        apply = _run._ApplyBench.build(backend, settings, shape)
        for rep in range(args.reps):
            pairs = _run._overlap_pairs(
                backend, settings, model, shape, apply, trainer, lambda _: None, log_dir, env,
                pairs=pair_names,
            )  # fmt: skip
            for name, pair in pairs.items():
                print(
                    f"{backend.name} rep {rep} {name}: {pair['total_vs_slowest']:.3f}x the slower "
                    f"alone (paired {pair['paired_vs_slowest']:.3f}x), stages "
                    f"{pair['balance']:.2f}:1, with {pair['more_buffers']['num_buffers']} buffers "
                    f"{pair['more_buffers']['total_vs_slowest']:.3f}x",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
