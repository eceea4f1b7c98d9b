"""Baselines measured next to every asyncwt round, for ratios that drift cancels out of.

On a small shared machine the loopback's speed changes by tens of percent within
seconds, so a ratio between two figures measured minutes apart says as much about
the machine's phase as about the approaches. `PairedBaselines` keeps the baselines
ready (a raw loopback sender connected, a naive peer worker, the memcpy buffers)
while asyncwt's headline runs; the trainer process waits at a gate before each of
its rounds (`TrainerJob.gated`) while this process runs the baselines' rounds.
Each asyncwt round is compared with the baseline run right before it (in blocks,
see `PairedBaselines`), and the paired ratio is the median of those per-round
ratios.

Which limit a backend's headline is held to (`HEADLINE_LIMITS`): a transport over
TCP against one raw loopback stream; shared memory, where one host's memory is the
wire, against one core's memcpy (two cores' memcpy paired too, and reported).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from typing_extensions import Self

from ._limits import MemcpyLimit, RawLoopback
from ._model import LlamaShape
from ._peers import SocketPeer
from ._util import Rounds, summarize

__all__ = ["BASELINES", "HEADLINE_LIMITS", "PairedBaselines", "headline_limits"]

BASELINES = ("raw_loopback", "naive", "memcpy", "memcpy_2cores")
"""Every baseline a job may be paired with."""
HEADLINE_LIMITS: dict[str, tuple[str, ...]] = {"shm": ("memcpy", "memcpy_2cores")}
"""Per backend, the baselines its headline rounds pair with, the bar's first;
`("raw_loopback",)` for any other."""


def headline_limits(backend: str) -> tuple[str, ...]:
    """The baselines `backend`'s headline pairs with; the first is its bar's limit."""
    return HEADLINE_LIMITS.get(backend, ("raw_loopback",))


class PairedBaselines:
    """Baselines, each round for round beside a job: `jobs` maps a job's label to
    the baselines that run before each block of its rounds.

    Rounds run in blocks of `BLOCK`: before every block of asyncwt rounds, a block
    of each of its baselines' rounds; the last round of each block counts. A round
    that follows an approach other than its own may inherit that approach's
    aftermath: a naive round churns a GiB of fresh allocations on both of its
    processes, and the round after it runs slower. Blocks make every counted round
    follow a round of its own kind, the steady state each approach has when run
    alone, while the two stay seconds apart. The aftermath outlasts a round,
    though, so the asyncwt block starts `SETTLE_S` after a socket baseline's block
    ends. A baseline pairs with one job only.

    Use: enter; run the jobs of `jobs` with `job_rounds` timed rounds each (after
    `rounds.warmup` warm-up rounds), passing `between` as `run_trainer`'s
    `between_rounds`; call `result` with their records before leaving the block.
    """

    BLOCK = 2
    SETTLE_S = 2.0
    """Seconds between a socket baseline's block and the asyncwt block: longer than
    a naive round's aftermath lasts."""
    RAW_JOB = "direct"
    """The headline job's label."""

    def __init__(
        self,
        model: torch.nn.Module,
        shape: LlamaShape,
        *,
        rounds: Rounds,
        raw_chunk: int,
        jobs: Mapping[str, Sequence[str]],
        log_dir: Path,
        env: Mapping[str, str] | None = None,
    ) -> None:
        wanted = [name for names in jobs.values() for name in names]
        unknown = sorted(set(wanted) - set(BASELINES))
        if unknown or len(wanted) != len(set(wanted)) or not all(jobs.values()):
            raise ValueError(
                f"jobs should give each job one or more of {BASELINES}, each baseline to one "
                f"job only; got {dict(jobs)!r}"
            )
        self.rounds = rounds
        self.raw_chunk = raw_chunk
        self.nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self._jobs = {label: tuple(names) for label, names in jobs.items()}
        self._model, self._shape = model, shape
        self._log_dir, self._env = log_dir, env
        self._stack = contextlib.ExitStack()
        self._raw: RawLoopback | None = None
        self._naive: SocketPeer | None = None
        self._memcpy: MemcpyLimit | None = None
        self._seconds: dict[str, list[float]] = {name: [] for name in wanted}

    @property
    def jobs(self) -> dict[str, tuple[str, ...]]:
        """Job label -> the baselines that run before each block of its rounds."""
        return dict(self._jobs)

    def __enter__(self) -> Self:
        wanted = set(self._seconds)
        with contextlib.ExitStack() as stack:
            if "raw_loopback" in wanted:
                self._raw = stack.enter_context(RawLoopback(self.nbytes, self._log_dir, self._env))
            if "naive" in wanted:
                self._naive = stack.enter_context(
                    SocketPeer(
                        "naive", self._model, self._shape, rounds=self.BLOCK * self.rounds.total,
                        bucket_bytes=0, log_dir=self._log_dir, env=self._env,
                    )
                )  # fmt: skip
            if wanted & {"memcpy", "memcpy_2cores"}:
                self._memcpy = MemcpyLimit(self._model)
            self._stack = stack.pop_all()
        return self

    @property
    def job_rounds(self) -> int:
        """Timed rounds each paired job runs: whole blocks, its warm-up included."""
        return self.BLOCK * self.rounds.total - self.rounds.warmup

    def _round(self, baseline: str) -> Callable[[], float]:
        if baseline == "raw_loopback" and self._raw is not None:
            raw = self._raw
            return lambda: raw.round_s(self.raw_chunk)
        if baseline == "naive" and self._naive is not None:
            return self._naive.round_s
        if baseline in ("memcpy", "memcpy_2cores") and self._memcpy is not None:
            memcpy, cores = self._memcpy, 2 if baseline == "memcpy_2cores" else 1
            return lambda: memcpy.round_s(cores)
        raise RuntimeError("PairedBaselines used outside its `with` block")

    def between(self, label: str, index: int) -> None:
        """Before round `index` of job `label`: at a block's start, a block of each of
        that job's baselines; only each block's last round is kept."""
        baselines = self._jobs.get(label)
        if baselines is None or index % self.BLOCK:
            return
        settle = False
        for baseline in baselines:
            one = self._round(baseline)
            for _ in range(self.BLOCK):
                seconds = one()
            self._seconds[baseline].append(seconds)
            settle = settle or baseline in ("raw_loopback", "naive")
        if settle:
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
        for label, names in self._jobs.items():
            record = records[label]
            every = list(record["warmup_s"]) + list(record["rounds_s"])
            counted = every[self.BLOCK - 1 :: self.BLOCK]
            for name in names:
                seconds = self._seconds[name]
                if len(every) != self.BLOCK * self.rounds.total or len(seconds) != len(counted):
                    raise RuntimeError(
                        f"job {label!r} ran {len(every)} rounds beside {len(seconds)} blocks "
                        f"of {name}; expected {self.BLOCK * self.rounds.total} and "
                        f"{self.rounds.total}: the job was not gated round for round"
                    )
                mine = counted[warmup:]
                base = summarize(seconds[warmup:], self.nbytes, seconds[:warmup])
                if name == "raw_loopback":
                    base["chunk_bytes"] = self.raw_chunk
                elif name == "naive":
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
        self._raw, self._naive, self._memcpy = None, None, None
        # Hand the exception on: after a failure the raw sender is stopped, not asked to quit.
        self._stack.__exit__(exc_type, exc, tb)
