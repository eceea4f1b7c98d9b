"""The trainer's side of delta rounds: the copy of what it last sent, and the policy.

The trainer keeps one host copy of every bucket's payload as it last sent it
(`host_bytes`: the plan's total bytes). Each worker says in its READY which round's
bytes it holds; a worker holding the round this copy is of gets a delta round,
any other (a worker that missed a round, restarted, joined late, or failed a
round's digest check) gets a full one, automatically. So does everyone when the
copy itself is not of one completed round (the first round, or after an abort),
and every `full_every` rounds.

Whether a delta round pays is decided per round from rates: the wire's, measured
from the raw buckets every round sends (free; the median of the last few rounds,
so one slow round moves nothing), against the encoder's, measured once when the
sender is made (on bytes of its own, with `CALIBRATION_CHANGED` of their values
changed) and then on every delta round it sends. The copy costs a memcpy of every
byte per round, so it is kept only where a delta is predicted to take at most
`KEEP_LIMIT` of a full round (and kept on while it stays below `SLOWER_LIMIT`):
the first round keeps nothing, and on a link faster than the encoder (a loopback)
a round does no more than a plain one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .._core.bytes import empty_bytes
from .._core.plan import Bucket, TransferPlan
from .codec import Encoded, encode, unit_of

__all__ = ["DeltaSender", "check_delta_plan", "encoder_rate"]

SAMPLE_BYTES = 4 << 20
"""Bytes the encoder is measured on (and the least a raw bucket must hold for its
time to measure the wire)."""
RESAMPLE_EVERY = 8
"""While the copy is kept but deltas do not pay, the encoder is measured against
it once in this many rounds (how much changed may have dropped)."""
SLOWER_LIMIT = 0.9
"""A delta round is chosen only if its predicted time is below this fraction of a full one."""
KEEP_LIMIT = 0.5
"""The copy starts being kept only where a delta round is predicted below this
fraction of a full one: a margin, so that a round slowed by the machine does not
start a copy that the next rounds drop again."""
WIRE_ROUNDS = 5
"""Rounds whose wire rates the policy takes the median of."""
CALIBRATION_CHANGED = 0.02
"""Fraction of bf16 values changed in the bytes the encoder is first measured on
(an RL step at a small learning rate changes about that many)."""


def check_delta_plan(plan: TransferPlan) -> None:
    """Delta positions travel as u32: a bucket must hold fewer than 2**32 units."""
    if plan.bucket_bytes >= 1 << 32:
        raise ValueError(
            f"delta=True needs bucket_bytes below 4 GiB (positions travel as 32 bits), "
            f"got {plan.bucket_bytes}"
        )


@dataclass
class _Rates:
    """Seconds per payload byte, measured; `None` until seen."""

    wires: deque[float] = field(default_factory=lambda: deque(maxlen=WIRE_ROUNDS))
    """Of the wire, per recent round."""
    encode: float | None = None
    """Of coding a bucket against the previous round's bytes."""
    ratio: float = 0.1
    """Coded bytes per payload byte, last seen (a guess until a round measures it)."""

    @property
    def wire(self) -> float | None:
        return statistics.median(self.wires) if self.wires else None

    def delta_share(self) -> float | None:
        """A delta round's predicted time over a full one's (`None`: not measured)."""
        wire = self.wire
        if wire is None or self.encode is None:
            return None
        return (self.encode + self.ratio * wire) / wire

    @staticmethod
    def blend(old: float | None, new: float) -> float:
        return new if old is None else 0.5 * old + 0.5 * new


class DeltaSender:
    """What the trainer keeps between rounds to send deltas, and which round to send.

    `policy` `"auto"` sends a delta round only where measured rates say it pays,
    and keeps the copy (a memcpy per round) only while they predict a delta round
    well below a full one (see the module docstring): on a fast loopback every
    round is then a plain one; on a slow link it starts keeping the copy once the
    wire is measured, and codes from the round after. `"always"` keeps the copy
    from the first round and sends every round it can as a delta.
    """

    def __init__(self, plan: TransferPlan, *, full_every: int = 0, policy: str = "auto") -> None:
        check_delta_plan(plan)
        self.plan = plan
        self.full_every = full_every
        self.policy = policy
        self._copy: torch.Tensor | None = None
        self._starts: list[int] = []
        at = 0
        for bucket in plan.buckets:
            self._starts.append(at)
            at += bucket.payload_bytes
        self._units = [unit_of(b) for b in plan.buckets]
        self.base_round = 0
        """The round whose bytes the copy holds completely (0: none)."""
        self._since_full = 0
        self._rates = _Rates()
        self.round_delta = False
        """Whether the round being sent codes its buckets (for some worker)."""
        self.keeping = True
        """Whether this round's bytes go into the copy (see the class docstring)."""
        self._prior = False
        """Whether the copy held a whole round when this one began (so a sample of
        it says how much changed)."""
        self._held = 0
        """The round the copy held when this one began."""
        self._touched = False
        """Whether this round wrote to the copy."""
        self._sampled = False
        """Whether this round measured the encoder yet."""
        self._rounds = 0
        self._raw_bytes = 0
        self._raw_s = 0.0
        if policy == "auto":
            self._rates.encode = encoder_rate()

    @property
    def host_bytes(self) -> int:
        """Host memory this side pays for delta rounds now: one copy of the payload
        while it is kept, else nothing."""
        return self._copy.numel() if self._copy is not None else 0

    def _base(self, bucket: Bucket) -> torch.Tensor:
        if self._copy is None:
            self._copy = empty_bytes(self.plan.total_bytes)
        start = self._starts[bucket.index]
        return self._copy[start : start + bucket.payload_bytes]

    def begin(self, round_id: int, worker_bases: Sequence[int]) -> list[bool]:
        """Open round `round_id`; per worker (given the round each holds, as READY
        carried it: its low 32 bits), whether it gets deltas."""
        base = self.base_round & 0xFFFFFFFF
        due = self.full_every > 0 and self._since_full + 1 >= self.full_every
        self._held, self._touched = self.base_round, False
        self._prior = bool(self.base_round)
        self.keeping = self.policy == "always" or self._worth_keeping()
        if not self.keeping:
            self._copy = None  # a copy not kept holds no round: give its memory back
        self._rounds += 1
        # The encoder is sampled against the copy now and then, only while it is kept.
        self._sampled = not self._prior or not self.keeping or self._rounds % RESAMPLE_EVERY != 0
        self.round_delta = self._prior and self.keeping and not due and self._pays()
        self.base_round = 0  # the copy is being rewritten
        chosen = [self.round_delta and b == base for b in worker_bases]
        self.round_delta = any(chosen)
        self._since_full = self._since_full + 1 if self.round_delta else 0
        return chosen

    def _pays(self) -> bool:
        if self.policy == "always":
            return True
        share = self._rates.delta_share()
        return share is None or share < SLOWER_LIMIT  # nothing measured: try it

    def _worth_keeping(self) -> bool:
        """Whether the wire is known to be slow enough for deltas to pay: by a margin
        to start keeping the copy, by any to go on."""
        share = self._rates.delta_share()
        if share is None:
            return False
        return share < (SLOWER_LIMIT if self._copy is not None else KEEP_LIMIT)

    def end(self, round_id: int) -> None:
        """Round `round_id` was sent completely: the copy is of it, if it was kept."""
        self.base_round = round_id if self.keeping else 0
        self._close_wire()

    def abort(self) -> None:
        """The round was not sent completely: once a bucket of it reached the copy, the
        copy is a mix and the next round is full; before that it still holds its round."""
        self.base_round = 0 if self._touched else self._held
        self._close_wire()

    def encode(self, bucket: Bucket, segments: Sequence[torch.Tensor]) -> Encoded:
        """Code `bucket`'s new payload against the copy, then update the copy (a thread's work)."""
        self._touched = True
        started = time.perf_counter()
        coded = encode(segments, self._base(bucket), self._units[bucket.index])
        payload = bucket.payload_bytes
        rates = self._rates
        rates.encode = rates.blend(rates.encode, (time.perf_counter() - started) / payload)
        rates.ratio = coded.header.body_bytes / payload
        return coded

    @property
    def keeps_nothing(self) -> bool:
        """Whether `keep` has nothing to do this round (the copy is not kept): a
        full bucket then goes out as without deltas."""
        return not self.keeping

    def keep(self, bucket: Bucket, segments: Sequence[torch.Tensor]) -> None:
        """Copy a bucket sent in full into the copy (while `keeping`), measuring the
        encoder against the copy on a sample of the round's first large bucket, now
        and then (a thread's work)."""
        if not self.keeping:
            return
        unit = self._units[bucket.index]
        head = min(SAMPLE_BYTES, segments[0].numel() if segments else 0) // unit * unit
        if head == SAMPLE_BYTES and not self._sampled:
            # What coding would cost against the previous round's bytes, and how much
            # it would send.
            self._sampled = True
            new = segments[0][:head]
            old = self._base(bucket)[:head].clone()
            started = time.perf_counter()
            sample = encode([new], old, unit)
            rates = self._rates
            rates.encode = rates.blend(rates.encode, (time.perf_counter() - started) / head)
            rates.ratio = sample.header.body_bytes / head
        self._touched = True
        base = self._base(bucket)
        at = 0
        for segment in segments:
            base[at : at + segment.numel()].copy_(segment)
            at += segment.numel()

    def sent_raw(self, nbytes: int, seconds: float) -> None:
        """A raw bucket of `nbytes` took `seconds` to reach every worker. A round's
        raw buckets add up into one rate once they hold `SAMPLE_BYTES`."""
        self._raw_bytes += nbytes
        self._raw_s += seconds

    def _close_wire(self) -> None:
        """The round's raw buckets are one more wire rate, if they were enough bytes."""
        if self._raw_bytes >= SAMPLE_BYTES and self._raw_s > 0:
            self._rates.wires.append(self._raw_s / self._raw_bytes)
        self._raw_bytes, self._raw_s = 0, 0.0


def encoder_rate(nbytes: int = SAMPLE_BYTES, tries: int = 3) -> float:
    """Seconds per byte the encoder takes on `nbytes` of bf16 values of its own with
    `CALIBRATION_CHANGED` of them changed: the best of `tries` (a machine's
    hiccups only ever slow it down)."""
    generator = torch.Generator().manual_seed(0)
    old = torch.randn(nbytes // 2, generator=generator).to(torch.bfloat16)
    new = old.clone()
    changed = torch.randperm(new.numel(), generator=generator)[
        : int(new.numel() * CALIBRATION_CHANGED)
    ]
    new[changed] = new[changed] * 1.01 + 0.01
    payload = new.view(torch.uint8)
    best = float("inf")
    for _ in range(tries):
        base = old.view(torch.uint8).clone()
        started = time.perf_counter()
        encode([payload], base, 2)
        best = min(best, time.perf_counter() - started)
    return best / nbytes
