"""Baselines measured next to every asyncwt round, for ratios that drift cancels out of.

On a small shared machine the loopback's speed changes by tens of percent within
seconds, so a ratio between two figures measured minutes apart says as much about
the machine's phase as about the approaches. `PairedBaselines` keeps a raw loopback
sender (and a naive peer worker) connected while asyncwt's headline runs; the
trainer process waits at a gate before each of its rounds (`TrainerJob.gated`)
while this process runs one baseline round. Each asyncwt round is compared with
the baseline run right before it (in blocks, see `PairedBaselines`), and the
paired ratio is the median of those per-round ratios.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from typing_extensions import Self

from ._limits import RawLoopback
from ._model import LlamaShape
from ._peers import SocketPeer
from ._util import Rounds, summarize

__all__ = ["PairedBaselines"]


class PairedBaselines:
    """Raw loopback, and the naive peer if asked, each round for round beside a job.

    Rounds run in blocks of `BLOCK`: before every block of asyncwt rounds, a block
    of baseline rounds; the last round of each block counts. A round that follows an
    approach other than its own may inherit that approach's aftermath: a naive round
    churns a GiB of fresh allocations on both of its processes, and the round after
    it runs slower. Blocks make every counted round follow a round of its own kind,
    the steady state each approach has when run alone, while the two stay seconds
    apart. The aftermath outlasts a round, though, so the asyncwt block starts
    `SETTLE_S` after the baseline block ends. Each baseline pairs with
    a job of its own (`RAW_JOB`, `NAIVE_JOB`).

    Use: enter; run the jobs of `jobs` with `job_rounds` timed rounds each (after
    `rounds.warmup` warm-up rounds), passing `between` as `run_trainer`'s
    `between_rounds`; call `result` with their records before leaving the block.
    """

    BLOCK = 2
    SETTLE_S = 2.0
    """Seconds between a baseline block's end and the asyncwt block's start: longer
    than a naive round's aftermath lasts."""
    RAW_JOB = "direct"
    NAIVE_JOB = "direct, beside naive"

    def __init__(
        self,
        model: torch.nn.Module,
        shape: LlamaShape,
        *,
        rounds: Rounds,
        raw_chunk: int,
        naive: bool,
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.rounds = rounds
        self.raw_chunk = raw_chunk
        self.nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._model, self._shape = model, shape
        self._naive_wanted = naive
        self._log_dir, self._env = log_dir, env
        self._stack = contextlib.ExitStack()
        self._raw: RawLoopback | None = None
        self._naive: SocketPeer | None = None
        self._seconds: dict[str, list[float]] = {"raw_loopback": [], "naive": []}

    @property
    def jobs(self) -> dict[str, str]:
        """Job label -> the baseline that runs before each of its rounds."""
        jobs = {self.RAW_JOB: "raw_loopback"}
        if self._naive_wanted:
            jobs[self.NAIVE_JOB] = "naive"
        return jobs

    def __enter__(self) -> Self:
        with contextlib.ExitStack() as stack:
            self._raw = stack.enter_context(RawLoopback(self.nbytes, self._log_dir, self._env))
            if self._naive_wanted:
                self._naive = stack.enter_context(
                    SocketPeer(
                        "naive", self._model, self._shape, rounds=self.BLOCK * self.rounds.total,
                        bucket_bytes=0, log_dir=self._log_dir, env=self._env,
                    )
                )  # fmt: skip
            self._stack = stack.pop_all()
        return self

    @property
    def job_rounds(self) -> int:
        """Timed rounds each paired job runs: whole blocks, its warm-up included."""
        return self.BLOCK * self.rounds.total - self.rounds.warmup

    def between(self, label: str, index: int) -> None:
        """Before round `index` of job `label`: at a block's start, a block of that
        job's baseline; only the block's last round is kept."""
        baseline = self.jobs.get(label)
        if baseline is None or index % self.BLOCK:
            return
        if self._raw is None:
            raise RuntimeError("PairedBaselines used outside its `with` block")
        for _ in range(self.BLOCK):
            if baseline == "naive":
                assert self._naive is not None
                seconds = self._naive.round_s()
            else:
                seconds = self._raw.round_s(self.raw_chunk)
        self._seconds[baseline].append(seconds)
        time.sleep(self.SETTLE_S)  # let the baseline's aftermath pass

    def result(
        self, records: Mapping[str, dict[str, Any]], expected_checksum: str
    ) -> dict[str, Any]:
        """Per baseline: its record, asyncwt's rounds beside it, and the per-round
        throughput ratios (asyncwt over the baseline) with their median."""
        warmup = self.rounds.warmup
        out: dict[str, Any] = {
            "block": self.BLOCK,
            "baselines": {},
            "asyncwt_s": {},
            "ratios": {},
            "vs": {},
        }
        for label, name in self.jobs.items():
            record, seconds = records[label], self._seconds[name]
            every = list(record["warmup_s"]) + list(record["rounds_s"])
            counted = every[self.BLOCK - 1 :: self.BLOCK]
            if len(every) != self.BLOCK * self.rounds.total or len(seconds) != len(counted):
                raise RuntimeError(
                    f"job {label!r} ran {len(every)} rounds beside {len(seconds)} blocks of "
                    f"{name}; expected {self.BLOCK * self.rounds.total} and {self.rounds.total}: "
                    f"the job was not gated round for round"
                )
            mine = counted[warmup:]
            base = summarize(seconds[warmup:], self.nbytes, seconds[:warmup])
            if name == "raw_loopback":
                base["chunk_bytes"] = self.raw_chunk
            else:
                assert self._naive is not None
                base["worker_checksum"] = self._naive.finish()
                base["bit_exact"] = base["worker_checksum"] == expected_checksum
            ratios = [b / a for b, a in zip(base["rounds_s"], mine, strict=True)]
            out["baselines"][name] = base
            out["asyncwt_s"][name] = mine
            out["ratios"][name] = ratios
            out["vs"][name] = float(statistics.median(ratios))
        return out

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._raw, self._naive = None, None
        # Hand the exception on: after a failure the raw sender is stopped, not asked to quit.
        self._stack.__exit__(exc_type, exc, tb)
