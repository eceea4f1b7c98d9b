"""vLLM tensor-parallel ranks as sliced receivers: the boxes each rank holds, and
loading only those bytes through vLLM's own weight loaders.

`rank_boxes(model)` reads, from this rank's parallel layers (column and row
parallel linears, fused qkv with kv heads replicated when there are fewer than
ranks, merged gate/up, vocab-parallel embeddings and heads with their padding),
the box of each Hugging Face checkpoint tensor the rank loads; everything else is
held whole. The worker declares them and receives only their bytes.

vLLM's loaders take full checkpoint tensors and `narrow` them to the rank's part
(offsets inside a fused parameter, padding rows included). `BoxTensor.make` gives
them a stand-in of the full shape that holds only the box: a narrow that stays
inside the box is a view of the received bytes, so the loaders place them exactly
as they would the full tensor's; any other use of the stand-in raises, so a model
whose loader does more than narrow fails loudly instead of loading wrong bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import Self

__all__ = ["BoxTensor", "SlicedLoading", "rank_boxes", "refresh_tied_lm_head"]

Boxes = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]
"""Checkpoint name -> `(start, size)` of the full tensor (an `asyncwt_layout`)."""


def _whole(shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return (0,) * len(shape), tuple(shape)


def rank_boxes(model: torch.nn.Module) -> Boxes:
    """The box of each checkpoint tensor this vLLM rank's `model` loads (Llama-style
    dense models; a parameter of another layer is held whole)."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    boxes: Boxes = {}
    tied: set[int] = set()
    for prefix, module in model.named_modules():
        base, _, leaf = prefix.rpartition(".")

        def name(hf: str, base: str = base) -> str:
            return f"{base}.{hf}" if base else hf

        if isinstance(module, QKVParallelLinear):
            rank, replicas, k_in = module.tp_rank, module.num_kv_head_replicas, module.input_size
            parts = [
                (module.num_heads * module.head_size, rank),
                (module.num_kv_heads * module.head_size, rank // replicas),
                (module.num_kv_heads * module.v_head_size, rank // replicas),
            ]
            hf_names = packed.get(leaf, ["q_proj", "k_proj", "v_proj"])
            for hf, (size, index) in zip(hf_names, parts):
                boxes[name(hf) + ".weight"] = ((index * size, 0), (size, k_in))
                if module.bias is not None:
                    boxes[name(hf) + ".bias"] = ((index * size,), (size,))
        elif isinstance(module, MergedColumnParallelLinear):
            for hf, full in zip(packed.get(leaf, []), module.output_sizes):
                size = full // module.tp_size
                boxes[name(hf) + ".weight"] = (
                    (module.tp_rank * size, 0),
                    (size, module.input_size),
                )
                if module.bias is not None:
                    boxes[name(hf) + ".bias"] = ((module.tp_rank * size,), (size,))
        elif isinstance(module, ColumnParallelLinear):  # after its subclasses
            size = module.output_size_per_partition
            boxes[prefix + ".weight"] = ((module.tp_rank * size, 0), (size, module.input_size))
            if module.bias is not None:
                boxes[prefix + ".bias"] = ((module.tp_rank * size,), (size,))
        elif isinstance(module, RowParallelLinear):
            size = module.input_size_per_partition
            boxes[prefix + ".weight"] = ((0, module.tp_rank * size), (module.output_size, size))
            # its bias is whole on every rank (rank 0 adds it): held whole, not listed
        elif isinstance(module, VocabParallelEmbedding):  # a ParallelLMHead too
            if id(module.weight) in tied:  # the head tied to the embedding: never loaded
                continue
            tied.add(id(module.weight))
            indices = module.shard_indices
            rows = indices.org_vocab_end_index - indices.org_vocab_start_index  # may be 0
            boxes[prefix + ".weight"] = (
                (indices.org_vocab_start_index, 0),
                (rows, module.embedding_dim),
            )
    return boxes


class BoxTensor(torch.Tensor):
    """A checkpoint tensor of the full shape of which only a box is present (see the
    module docstring). Build it with `BoxTensor.make`."""

    _start: tuple[int, ...]
    _data: torch.Tensor

    @staticmethod
    def __new__(cls, shape: torch.Size, data: torch.Tensor, start: Sequence[int]) -> Self:
        wrapper: Self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=data.dtype, device=data.device, requires_grad=False
        )
        wrapper._start = tuple(start)
        wrapper._data = data
        return wrapper

    @staticmethod
    def make(data: torch.Tensor, start: Sequence[int], full: Sequence[int]) -> torch.Tensor:
        """`data`, the box at `start` of a tensor of shape `full`, as loaders take it
        (`data` itself when the box is the whole tensor)."""
        if tuple(data.shape) == tuple(full):
            return data
        return BoxTensor(torch.Size(full), data, start)

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.narrow and isinstance(args[0], cls):
            self, dim, start, length = (*args, *kwargs.values())[:4]
            return self._narrow(dim % self.ndim, int(start), int(length))
        if func is torch.Tensor.detach and isinstance(args[0], cls):
            return args[0]
        if func is torch.Tensor.copy_:
            source = args[1] if len(args) > 1 else kwargs.get("src")
            if isinstance(source, cls):
                raise ValueError(
                    f"a loader copied the whole {tuple(source.shape)} checkpoint tensor, of "
                    f"which this rank received only {tuple(source._data.shape)} at "
                    f"{source._start}: its layer loads more than its slice"
                )
        with torch._C.DisableTorchFunctionSubclass():  # metadata: shape, dtype, ...
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        raise NotImplementedError(
            f"{func} needs bytes of a checkpoint tensor outside the slice this rank "
            f"received; its layer's loader does more than narrow it"
        )

    def _narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        first, held = self._start[dim], self._data.shape[dim]
        shape, at = list(self.shape), list(self._start)
        if first <= start and start + length <= first + held:  # inside the box
            data = self._data.narrow(dim, start - first, length)
            at[dim] = 0
        elif start <= first and first + held <= start + length:  # the box inside it
            data = self._data
            at[dim] = first - start
        else:
            raise ValueError(
                f"a loader narrowed dim {dim} to [{start}, {start + length}) of a "
                f"{tuple(self.shape)} checkpoint tensor, of which this rank received only "
                f"[{first}, {first + held}): its layer's slice is not the one it declared"
            )
        shape[dim] = length
        return BoxTensor.make(data, at, shape)


class SlicedLoading:
    """What a vLLM rank receiving slices hands its loaders: each received box wrapped
    as a `BoxTensor` of its full shape (set per init by `declare`)."""

    def __init__(self) -> None:
        self.boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        """Checkpoint name -> (start, full shape), for the boxes that are not whole."""

    def declare(self, boxes: Boxes, full_shapes: dict[str, tuple[int, ...]]) -> None:
        """The boxes of this init (`rank_boxes`), with the plan's full shapes."""
        self.boxes = {
            name: (start, full_shapes[name])
            for name, (start, size) in boxes.items()
            if name in full_shapes and tuple(size) != full_shapes[name]
        }

    def wrap(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as vLLM's loaders take it: its full-shape stand-in if it is a box."""
        box = self.boxes.get(name)
        return tensor if box is None else BoxTensor.make(tensor, box[0], box[1])


def refresh_tied_lm_head(model: torch.nn.Module) -> bool:
    """Re-process an `lm_head` tied to the embedding after a reload: vLLM skips the
    tied name, so on the CPU the head kept the matrix it packed from the previous
    weights and served stale logits. Returns whether there was one to refresh."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if isinstance(head, ParallelLMHead) and embed is not None and head.weight is embed.weight:
        method: Any = head.quant_method
        method.process_weights_after_loading(head)
        return True
    return False
