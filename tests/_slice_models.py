"""A small model and its tensor-parallel ranks' shards, for sliced receivers' tests.

`full(seed)` is the trainer's model. `rank(r, size)` is what tensor-parallel rank `r`
of `size` holds: `up` split by output rows (column parallel), `down` by input
columns (row parallel), the embedding's rows padded to a multiple of 8 and split
(vocab parallel: the last rank's range runs past the vocabulary), `norm` whole
(replicated). Each declares its boxes in `asyncwt_layout`.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 64
INTER = 128
VOCAB = 50  # padded to 56 across ranks: a rank's rows may run past the vocabulary


def _shapes() -> dict[str, tuple[int, ...]]:
    return {
        "embed.weight": (VOCAB, HIDDEN),
        "up.weight": (INTER, HIDDEN),
        "up.bias": (INTER,),
        "down.weight": (HIDDEN, INTER),
        "norm.weight": (HIDDEN,),
    }


def boxes(rank: int, size: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """The box of each parameter rank `rank` of `size` holds, `(start, size)`."""
    padded = -(-VOCAB // 8) * 8
    rows = padded // size
    first = min(rank * rows, VOCAB)
    vocab_rows = min(first + rows, VOCAB) - first
    part, cols = INTER // size, INTER // size
    return {
        "embed.weight": ((first, 0), (vocab_rows, HIDDEN)),
        "up.weight": ((rank * part, 0), (part, HIDDEN)),
        "up.bias": ((rank * part,), (part,)),
        "down.weight": ((0, rank * cols), (HIDDEN, cols)),
        "norm.weight": ((0,), (HIDDEN,)),
    }


class Holder(nn.Module):
    """Parameters by dotted name, each of a given shape (a rank's shards, or all)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            module_name, leaf = name.split(".")
            if not hasattr(self, module_name):
                self.add_module(module_name, nn.Module())
            getattr(self, module_name).register_parameter(
                leaf, nn.Parameter(torch.zeros(shape), requires_grad=False)
            )


def full(seed: int) -> nn.Module:
    """The trainer's model, its values drawn from `seed`."""
    model = Holder(_shapes())
    generator = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.data.copy_(torch.randn(param.shape, generator=generator))
    return model


def rank(index: int, size: int) -> nn.Module:
    """Rank `index` of `size`: its shards (zeros until pushed), its layout declared."""
    declared = boxes(index, size)
    model = Holder({name: box[1] for name, box in declared.items()})
    model.asyncwt_layout = declared  # type: ignore[assignment]
    return model


def shard_of(model: nn.Module, index: int, size: int) -> nn.Module:
    """What rank `index` of `size` should hold once `model` was pushed."""
    out = rank(index, size)
    params = dict(model.named_parameters())
    for name, ((start), (extent)) in boxes(index, size).items():
        region = params[name].data[tuple(slice(s, s + n) for s, n in zip(start, extent))]
        out.get_parameter(name).data.copy_(region)
    return out


def rank0_of_2() -> nn.Module:
    return rank(0, 2)


def rank1_of_2() -> nn.Module:
    return rank(1, 2)


def past_the_edge() -> nn.Module:
    """Rank 1 of 2 declaring one box that runs past its parameter's end."""
    model = rank(1, 2)
    model.asyncwt_layout = {**boxes(1, 2), "up.bias": ((INTER // 2,), (INTER,))}  # type: ignore[assignment]
    return model


def tp_rank(rank: int, world_size: int) -> nn.Module:
    """`asyncwt worker --ranks N --model _slice_models:tp_rank`: rank `rank`'s shards."""
    return _shards(rank, world_size)


_shards = rank
