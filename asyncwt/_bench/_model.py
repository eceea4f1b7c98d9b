"""The benchmark's synthetic Llama-like model: realistic tensor mix, no real weights.

Parameter names and order follow Hugging Face's Llama (`model.embed_tokens.weight`,
`model.layers.{i}.self_attn.q_proj.weight`, ..., `lm_head.weight`), so the tensor
count and size mix (a few huge embedding matrices, many mid-size projections, tiny
norms) is what a trainer really pushes. Weights are bf16.

The trainer fills its copy with pseudo-random values; a worker process builds the
same shapes filled with zeros (`worker_model`, a zero-argument factory for
`asyncwt worker --model`), reading the shape from the `ASYNCWT_BENCH_MODEL`
environment variable.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

__all__ = [
    "MODEL_ENV",
    "LlamaShape",
    "SyntheticLlama",
    "fill_random",
    "shape_from_env",
    "worker_model",
    "worker_model_for",
]

MODEL_ENV = "ASYNCWT_BENCH_MODEL"
"""Environment variable holding the JSON `LlamaShape` a worker process builds."""

_DTYPE = torch.bfloat16
_EMBED_SHARE = 0.4
"""At most this share of the model goes to the embedding and the LM head together."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaShape:
    """Sizes of a Llama-style decoder (grouped-query attention, SwiGLU MLP)."""

    hidden: int
    """Model width."""
    intermediate: int
    """MLP width (gate/up output, down input)."""
    kv_dim: int
    """Width of the k and v projections (kv heads × head size)."""
    vocab: int
    """Rows of the embedding and of the LM head."""
    layers: int
    """Decoder layers."""

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "kv_dim", "vocab", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} should be a positive int, got {value!r}")

    @classmethod
    def for_mib(cls, mib: float) -> LlamaShape:
        """A shape whose bf16 weights take about `mib` MiB (within one layer's size)."""
        if not mib > 0:
            raise ValueError(f"mib should be > 0, got {mib!r}")
        hidden = (
            2048
            if mib >= 512
            else 1024
            if mib >= 192
            else 512
            if mib >= 32
            else 256
            if mib >= 4
            else 128
        )
        intermediate = -(-int(hidden * 2.75) // 64) * 64
        kv_dim = hidden // 4
        target = mib * 2**20 / 2  # elements
        vocab = min(32000, int(_EMBED_SHARE * target / (2 * hidden)) // 1000 * 1000)
        vocab = max(vocab, 1000)
        per_layer = (
            2 * hidden * hidden + 2 * hidden * kv_dim + 3 * hidden * intermediate + 2 * hidden
        )
        layers = max(1, round((target - 2 * vocab * hidden - hidden) / per_layer))
        return cls(
            hidden=hidden, intermediate=intermediate, kv_dim=kv_dim, vocab=vocab, layers=layers
        )

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every parameter's name and shape, in the model's registration order."""
        h, i, kv = self.hidden, self.intermediate, self.kv_dim
        shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}."
            shapes += [
                (p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (h, h)),
                (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)),
                (p + "self_attn.o_proj.weight", (h, h)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)),
            ]
        shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return shapes

    @property
    def nbytes(self) -> int:
        """Bytes of all weights (bf16)."""
        total = 0
        for _, shape in self.param_shapes():
            count = 1
            for d in shape:
                count *= d
            total += count * 2
        return total

    @property
    def num_tensors(self) -> int:
        return len(self.param_shapes())

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LlamaShape:
        """Parse `to_json` output; anything else is a `ValueError`."""
        try:
            data = json.loads(text)
            return cls(**data)
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"a LlamaShape should be a JSON object of its fields, got {text!r}"
            ) from exc


class _Holder(nn.Module):
    """A module that only holds parameters (no forward: the benchmark never runs one)."""


class SyntheticLlama(nn.Module):
    """Parameters shaped like `shape`, uninitialised until filled (see `fill_random`).

    Built from plain `nn.Parameter`s (no `nn.Linear` init, which would cost seconds
    per GiB); `named_parameters()` yields the Hugging Face Llama names and order.
    """

    def __init__(
        self, shape: LlamaShape, shapes: Sequence[tuple[str, tuple[int, ...]]] | None = None
    ) -> None:
        """`shapes` replaces `shape.param_shapes()` (a tensor-parallel rank's shards)."""
        super().__init__()
        self.shape = shape
        for name, dims in shape.param_shapes() if shapes is None else shapes:
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = _Holder()
                    owner.add_module(part, child)
                owner = child
            owner.register_parameter(
                leaf, nn.Parameter(torch.empty(dims, dtype=_DTYPE), requires_grad=False)
            )

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())


def fill_random(model: nn.Module, seed: int = 0) -> None:
    """Fill every parameter with pseudo-random bf16 values, fast and position-dependent.

    Drawing normal samples for a whole GiB takes seconds on two cores, so a 16 MiB
    pool is drawn once and each 1 MiB chunk of each parameter copies from a pool
    offset derived from (parameter, chunk): a misplaced chunk changes the checksum.
    """
    generator = torch.Generator().manual_seed(seed)
    pool = torch.empty(8 << 20, dtype=_DTYPE).normal_(0.0, 0.02, generator=generator)
    pool_len = pool.numel()
    chunk = 512 << 10  # elements: 1 MiB of bf16
    with torch.no_grad():
        for index, (name, param) in enumerate(model.named_parameters()):
            flat = param.data.view(-1)
            for start in range(0, flat.numel(), chunk):
                n = min(chunk, flat.numel() - start)
                key = hashlib.blake2b(f"{seed}|{name}|{start}".encode(), digest_size=8).digest()
                offset = int.from_bytes(key, "little") % (pool_len - n + 1)
                flat[start : start + n].copy_(pool[offset : offset + n])
            flat[0] = float(index % 97) / 97.0  # distinct first element per parameter


def worker_model_for(
    shape: LlamaShape, shapes: Sequence[tuple[str, tuple[int, ...]]] | None = None
) -> SyntheticLlama:
    """A model of `shape` (its parameters shaped as `shapes`, if given) filled with
    zeros, every page touched.

    Zero-filling touches every page now, so the worker's resident memory holds the
    whole model before the first round: extra memory measured later is the
    transfer's own.
    """
    model = SyntheticLlama(shape, shapes)
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    return model


def shape_from_env() -> LlamaShape:
    """The shape a benchmark worker builds: `$ASYNCWT_BENCH_MODEL`."""
    text = os.environ.get(MODEL_ENV)
    if not text:
        raise RuntimeError(f"{MODEL_ENV} should hold a JSON LlamaShape; it is unset")
    return LlamaShape.from_json(text)


def worker_model() -> SyntheticLlama:
    """`asyncwt worker --model` factory: the shape in `$ASYNCWT_BENCH_MODEL`, zeros."""
    return worker_model_for(shape_from_env())
