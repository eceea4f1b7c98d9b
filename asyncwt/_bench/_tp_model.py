"""The benchmark's synthetic Llama split the way vLLM's tensor parallelism splits it.

Rank `r` of a group of `world_size` holds, of every decoder layer: the rows of q, gate
and up (column parallel), the columns of o and down (row parallel), its key/value
heads (split when there are at least as many as ranks, else each rank holding one
head whole), and its rows of the embedding and the LM head (vocab parallel: the
vocabulary padded so that it splits evenly, the last rank's range running past its
end); the norms whole (replicated). `tp_worker_model` is the `asyncwt worker --ranks N
--model` factory: a rank's shards, zeros until pushed, its `asyncwt_layout` declared.
`tp_shard` is what a rank should hold once a full model was pushed (for checksums).
"""

from __future__ import annotations

import torch

from .._core.meta import ParamMeta
from .._core.owners import Box
from .._core.receiver_layout import kv_heads_box, range_box, shard_box, whole_box
from ._model import LlamaShape, SyntheticLlama, shape_from_env, worker_model_for

__all__ = ["HEAD_DIM", "tp_boxes", "tp_shard", "tp_worker_model"]

HEAD_DIM = 64
"""Size of an attention head (a synthetic k/v projection narrower than this is one head)."""
VOCAB_PADDING = 64
"""vLLM pads the vocabulary of its parallel embedding to a multiple of this."""

_ROW_PARALLEL = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
_COLUMN_PARALLEL = ("self_attn.q_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight")
_KV = ("self_attn.k_proj.weight", "self_attn.v_proj.weight")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def _box(shape: LlamaShape, meta: ParamMeta, rank: int, world_size: int) -> Box:
    name = meta.name
    if name in _VOCAB:
        step = -(-shape.vocab // (VOCAB_PADDING * world_size)) * VOCAB_PADDING
        return range_box(meta, 0, rank * step, (rank + 1) * step)
    if name.endswith(_COLUMN_PARALLEL):
        return shard_box(meta, 0, size=world_size, rank=rank)
    if name.endswith(_ROW_PARALLEL):
        return shard_box(meta, 1, size=world_size, rank=rank)
    if name.endswith(_KV):
        head_dim = HEAD_DIM if shape.kv_dim % HEAD_DIM == 0 else shape.kv_dim
        return kv_heads_box(
            meta,
            kv_heads=shape.kv_dim // head_dim,
            head_dim=head_dim,
            size=world_size,
            rank=rank,
        )
    return whole_box(meta)


def tp_boxes(shape: LlamaShape, rank: int, world_size: int) -> dict[str, Box]:
    """The box of every parameter rank `rank` of `world_size` holds, by name."""
    return {
        name: _box(shape, ParamMeta(name, torch.bfloat16, dims), rank, world_size)
        for name, dims in shape.param_shapes()
    }


def _zeros(shape: LlamaShape, rank: int, world_size: int) -> SyntheticLlama:
    boxes = tp_boxes(shape, rank, world_size)
    model = worker_model_for(shape, [(name, box.size) for name, box in boxes.items()])
    layout = {name: (box.start, box.size) for name, box in boxes.items()}
    model.asyncwt_layout = layout  # type: ignore[assignment]
    return model


def tp_shard(full: SyntheticLlama, rank: int, world_size: int) -> SyntheticLlama:
    """What rank `rank` of `world_size` holds once `full` was pushed."""
    shard = _zeros(full.shape, rank, world_size)
    params = dict(full.named_parameters())
    with torch.no_grad():
        for name, box in tp_boxes(full.shape, rank, world_size).items():
            region = tuple(slice(s, s + n) for s, n in zip(box.start, box.size))
            shard.get_parameter(name).copy_(params[name][region])
    return shard


def tp_worker_model(rank: int, world_size: int) -> SyntheticLlama:
    """`asyncwt worker --ranks N --model asyncwt._bench._tp_model:tp_worker_model`:
    rank `rank`'s shards of the shape in `$ASYNCWT_BENCH_MODEL`, zeros."""
    return _zeros(shape_from_env(), rank, world_size)
