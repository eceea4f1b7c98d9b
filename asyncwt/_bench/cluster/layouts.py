"""The receiving engines of the cluster bench's M:N rows, and what each link carries.

A layout names engines of tensor-parallel ranks, `[Kx]tpN`: `tp2` is one engine of
two ranks, `tp4` one of four, `2xtp2` two engines of two ranks each. Every rank is a
receiver host of its own, holding the synthetic Llama's slices as vLLM splits them
(`asyncwt._bench._tp_model`).

`link_payloads` counts the payload bytes each trainer rank sends and each receiver
receives in one round, from the boxes alone: a receiver gets exactly the part of each
parameter it holds (all of it when it holds the model whole), and trainer rank `i` of
`M` sends the part of that which it holds (FSDP2's dim-0 chunk `i`; everything when
`M = 1`). The busiest of those links bounds the round: the row's ideal.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..._core.owners import Box
from .._model import LlamaShape
from .._tp_model import tp_boxes

__all__ = ["Layout", "fsdp_rows", "link_payloads"]

Shard = tuple[int, int]
"""A receiver's `(rank, world_size)` in its engine; None: it holds the model whole."""


@dataclass(frozen=True, slots=True)
class Layout:
    """`engines` engines of `tp` tensor-parallel ranks each."""

    engines: int
    tp: int

    @classmethod
    def parse(cls, text: str) -> Layout:
        """`tp2`, `tp4`, `2xtp2`, ...; anything else is a `ValueError`."""
        match = re.fullmatch(r"(?:([1-9]\d*)x)?tp([1-9]\d*)", text.strip())
        if match is None:
            raise ValueError(
                f"a layout should be [Kx]tpN (tp2, tp4, 2xtp2: K engines of N ranks), got {text!r}"
            )
        return cls(engines=int(match.group(1) or 1), tp=int(match.group(2)))

    @property
    def name(self) -> str:
        return f"tp{self.tp}" if self.engines == 1 else f"{self.engines}xtp{self.tp}"

    @property
    def receivers(self) -> int:
        return self.engines * self.tp

    @property
    def shards(self) -> list[Shard]:
        """Each receiver's place in its engine, engine after engine."""
        return [(rank, self.tp) for _ in range(self.engines) for rank in range(self.tp)]


def fsdp_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """The dim-0 rows `[start, stop)` FSDP2 gives rank `rank` of `ranks` (`torch.chunk`'s
    split: chunks of ceil(rows / ranks), the last ones short or empty)."""
    chunk = -(-rows // ranks)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def _overlap(a: Box, b: Box) -> int:
    return math.prod(
        max(0, min(sa + na, sb + nb) - max(sa, sb))
        for sa, na, sb, nb in zip(a.start, a.size, b.start, b.size)
    )


def link_payloads(
    shape: LlamaShape, shards: Sequence[Shard | None], ranks: int
) -> tuple[list[int], list[int]]:
    """(bytes each of `ranks` trainer ranks sends, bytes each receiver receives) in a
    round of the bf16 model of `shape` to receivers holding `shards`."""
    held = [None if shard is None else tp_boxes(shape, *shard) for shard in shards]
    sent, received = [0] * ranks, [0] * len(shards)
    for name, dims in shape.param_shapes():
        whole = Box((0,) * len(dims), dims)
        owned = []
        for rank in range(ranks):
            start, stop = fsdp_rows(dims[0], ranks, rank)
            owned.append(Box((start, *whole.start[1:]), (stop - start, *dims[1:])))
        for index, boxes in enumerate(held):
            box = whole if boxes is None else boxes[name]
            received[index] += 2 * box.numel
            for rank, mine in enumerate(owned):
                sent[rank] += 2 * _overlap(mine, box)
    return sent, received
