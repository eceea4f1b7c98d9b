"""A tiny Llama that vLLM can serve on the CPU, built locally (no hub access).

`save_tiny_llama(path)` writes a Hugging Face checkpoint (config, float32 weights and a
BPE tokenizer trained here) that `vllm serve`/`LLM` can load with `HF_HUB_OFFLINE=1`.
Head size 32: vLLM's CPU attention supports 32, 64, 80, ... but not 16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

HIDDEN = 64
LAYERS = 2
HEADS = 2  # head size HIDDEN // HEADS = 32
INTERMEDIATE = 128
MAX_POSITIONS = 512

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "weights move from the trainer to the workers in buckets",
    "a round starts, the buckets stream, the round finishes",
    "vllm serves the model while the trainer learns",
    "one two three four five six seven eight nine ten",
    "asyncio runs the trainer; threads apply the weights",
]


def build_tokenizer(path: Path) -> int:
    """Train a small byte-level BPE tokenizer, save it as a HF fast tokenizer; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return int(tokenizer.get_vocab_size())


def build_model(
    vocab_size: int,
    seed: int,
    *,
    kv_heads: int = HEADS,
    tie: bool = False,
    attention_bias: bool = False,
) -> Any:
    """A float32 `LlamaForCausalLM` with weights drawn from `seed` (typed `Any`: a
    transformers model); `kv_heads` below `HEADS` shares each kv head among query
    heads, `tie` ties the output head to the embedding, `attention_bias` gives the
    attention's projections biases (as Qwen2's q/k/v have)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=tie,
        attention_bias=attention_bias,
        bos_token_id=0,
        eos_token_id=1,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    reseed(model, seed)
    return model


def reseed(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter new values drawn from `seed`, large enough that greedy
    decoding depends on them (norm weights stay near 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * values)
            else:
                param.copy_(0.2 * values)


def save_tiny_llama(path: Path, seed: int = 0, *, vocab: int = 0, **shape: Any) -> Any:
    """Write the tokenizer and a model drawn from `seed` to `path`; return the model.
    `vocab` (at least the tokenizer's) pads the vocabulary; `shape` goes to
    `build_model`."""
    vocab_size = max(build_tokenizer(path), vocab)
    model = build_model(vocab_size, seed, **shape)
    model.save_pretrained(path, safe_serialization=True)
    return model


@torch.no_grad()
def greedy_tokens(model: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of `prompt_ids` by `model` (argmax each step, no EOS stop)."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    for _ in range(max_tokens):
        logits = model(input_ids=ids).logits[0, -1]
        token = int(torch.argmax(logits))
        out.append(token)
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return out


def model_from_env() -> Any:
    """`asyncwt worker --model _vllm_model:model_from_env`: the tiny Llama with the
    vocabulary size in `$ASYNCWT_TEST_VOCAB` (a zero-argument factory for the CLI)."""
    import os

    return build_model(int(os.environ["ASYNCWT_TEST_VOCAB"]), seed=0)


@torch.no_grad()
def greedy_tokens_cached(model: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """`greedy_tokens` with a KV cache: for long continuations (hundreds of tokens)."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(max_tokens):
        token = int(torch.argmax(out.logits[0, -1]))
        tokens.append(token)
        out = model(
            input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
        )
    return tokens
