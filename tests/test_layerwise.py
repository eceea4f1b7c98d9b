"""layerwise_groups: one group per layer, keyed on the outermost index, for any naming."""

from __future__ import annotations

import pytest

from asyncwt import layerwise_groups

# Each case: the flat names in metadata order, and the groups they must partition into.
_CONVENTIONS: dict[str, tuple[list[str], list[list[str]]]] = {
    "llama": (
        [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.1.self_attn.q_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.norm.weight",
            "lm_head.weight",
        ],
        [
            ["model.embed_tokens.weight"],
            ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"],
            ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"],
            ["model.norm.weight", "lm_head.weight"],
        ],
    ),
    "gpt2": (
        [
            "transformer.wte.weight",
            "transformer.wpe.weight",
            "transformer.h.0.attn.c_attn.weight",
            "transformer.h.0.ln_1.weight",
            "transformer.h.1.attn.c_attn.weight",
            "transformer.h.2.attn.c_attn.weight",
            "transformer.ln_f.weight",
        ],
        [
            ["transformer.wte.weight", "transformer.wpe.weight"],
            ["transformer.h.0.attn.c_attn.weight", "transformer.h.0.ln_1.weight"],
            ["transformer.h.1.attn.c_attn.weight"],
            ["transformer.h.2.attn.c_attn.weight"],
            ["transformer.ln_f.weight"],
        ],
    ),
    "mamba-backbone": (
        [
            "backbone.embeddings.weight",
            "backbone.layers.0.mixer.in_proj.weight",
            "backbone.layers.0.norm.weight",
            "backbone.layers.1.mixer.in_proj.weight",
            "backbone.norm_f.weight",
        ],
        [
            ["backbone.embeddings.weight"],
            ["backbone.layers.0.mixer.in_proj.weight", "backbone.layers.0.norm.weight"],
            ["backbone.layers.1.mixer.in_proj.weight"],
            ["backbone.norm_f.weight"],
        ],
    ),
    "bert": (
        [
            "bert.embeddings.word_embeddings.weight",
            "bert.embeddings.LayerNorm.weight",
            "bert.encoder.layer.0.attention.self.query.weight",
            "bert.encoder.layer.0.output.dense.weight",
            "bert.encoder.layer.1.attention.self.query.weight",
            "bert.pooler.dense.weight",
        ],
        [
            ["bert.embeddings.word_embeddings.weight", "bert.embeddings.LayerNorm.weight"],
            [
                "bert.encoder.layer.0.attention.self.query.weight",
                "bert.encoder.layer.0.output.dense.weight",
            ],
            ["bert.encoder.layer.1.attention.self.query.weight"],
            ["bert.pooler.dense.weight"],
        ],
    ),
    "vision-tower": (
        [
            "visual.patch_embed.proj.weight",
            "visual.blocks.0.attn.qkv.weight",
            "visual.blocks.0.mlp.fc1.weight",
            "visual.blocks.1.attn.qkv.weight",
            "visual.merger.ln_q.weight",
        ],
        [
            ["visual.patch_embed.proj.weight"],
            ["visual.blocks.0.attn.qkv.weight", "visual.blocks.0.mlp.fc1.weight"],
            ["visual.blocks.1.attn.qkv.weight"],
            ["visual.merger.ln_q.weight"],
        ],
    ),
    "vlm-language-model-with-projector": (
        [
            "model.language_model.embed_tokens.weight",
            "model.language_model.layers.0.self_attn.q_proj.weight",
            "model.language_model.layers.0.mlp.gate_proj.weight",
            "model.language_model.layers.1.self_attn.q_proj.weight",
            "model.language_model.norm.weight",
            "model.multi_modal_projector.linear_1.weight",
            "model.multi_modal_projector.linear_2.weight",
            "lm_head.weight",
        ],
        [
            ["model.language_model.embed_tokens.weight"],
            [
                "model.language_model.layers.0.self_attn.q_proj.weight",
                "model.language_model.layers.0.mlp.gate_proj.weight",
            ],
            ["model.language_model.layers.1.self_attn.q_proj.weight"],
            [
                "model.language_model.norm.weight",
                "model.multi_modal_projector.linear_1.weight",
                "model.multi_modal_projector.linear_2.weight",
                "lm_head.weight",
            ],
        ],
    ),
    "moe-experts-keyed-on-layer": (
        [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.mlp.experts.0.w1.weight",
            "model.layers.0.mlp.experts.1.w1.weight",
            "model.layers.0.mlp.experts.7.w2.weight",
            "model.layers.1.mlp.experts.0.w1.weight",
            "model.layers.1.mlp.experts.1.w1.weight",
            "model.norm.weight",
        ],
        [
            ["model.embed_tokens.weight"],
            [
                "model.layers.0.mlp.gate.weight",
                "model.layers.0.mlp.experts.0.w1.weight",
                "model.layers.0.mlp.experts.1.w1.weight",
                "model.layers.0.mlp.experts.7.w2.weight",
            ],
            ["model.layers.1.mlp.experts.0.w1.weight", "model.layers.1.mlp.experts.1.w1.weight"],
            ["model.norm.weight"],
        ],
    ),
    "pipeline-stage-yields-post-before-its-layers": (
        # Stage 0 streams embeddings and its layers; the last stage streams its output
        # block (norm, lm_head) before its own layers, as Megatron-Bridge does.
        [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.weight",
            "model.layers.1.mlp.weight",
            "model.norm.weight",
            "lm_head.weight",
            "model.layers.2.mlp.weight",
            "model.layers.3.mlp.weight",
        ],
        [
            ["model.embed_tokens.weight"],
            ["model.layers.0.mlp.weight"],
            ["model.layers.1.mlp.weight"],
            ["model.layers.2.mlp.weight"],
            ["model.layers.3.mlp.weight"],
            ["model.norm.weight", "lm_head.weight"],
        ],
    ),
    "t5-encoder-then-decoder-stacks": (
        [
            "shared.weight",
            "encoder.block.0.layer.0.SelfAttention.q.weight",
            "encoder.block.1.layer.0.SelfAttention.q.weight",
            "encoder.final_layer_norm.weight",
            "decoder.block.0.layer.0.SelfAttention.q.weight",
            "decoder.block.1.layer.1.EncDecAttention.q.weight",
            "decoder.final_layer_norm.weight",
        ],
        [
            ["shared.weight"],
            ["encoder.block.0.layer.0.SelfAttention.q.weight"],
            ["encoder.block.1.layer.0.SelfAttention.q.weight"],
            ["decoder.block.0.layer.0.SelfAttention.q.weight"],
            ["decoder.block.1.layer.1.EncDecAttention.q.weight"],
            ["encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight"],
        ],
    ),
    "opt-decoder-layers": (
        [
            "model.decoder.embed_tokens.weight",
            "model.decoder.layers.0.fc1.weight",
            "model.decoder.layers.1.fc1.weight",
            "model.decoder.final_layer_norm.weight",
        ],
        [
            ["model.decoder.embed_tokens.weight"],
            ["model.decoder.layers.0.fc1.weight"],
            ["model.decoder.layers.1.fc1.weight"],
            ["model.decoder.final_layer_norm.weight"],
        ],
    ),
    "no-index-at-all": (
        ["embed.weight", "proj.weight", "norm.weight", "lm_head.weight"],
        [["embed.weight", "proj.weight", "norm.weight", "lm_head.weight"]],
    ),
    "only-layers": (
        ["layers.0.w", "layers.0.b", "layers.1.w"],
        [["layers.0.w", "layers.0.b"], ["layers.1.w"]],
    ),
    "empty": ([], []),
}


@pytest.mark.parametrize(("names", "groups"), list(_CONVENTIONS.values()), ids=list(_CONVENTIONS))
def test_layerwise_groups_partitions_naming_convention(
    names: list[str], groups: list[list[str]]
) -> None:
    assert layerwise_groups(names) == groups


@pytest.mark.parametrize(("names", "groups"), list(_CONVENTIONS.values()), ids=list(_CONVENTIONS))
def test_layerwise_groups_is_a_partition_without_empty_groups(
    names: list[str], groups: list[list[str]]
) -> None:
    result = layerwise_groups(names)

    assert all(result)
    assert sorted(name for group in result for name in group) == sorted(names)


def test_layerwise_groups_of_empty_list_is_empty() -> None:
    assert layerwise_groups([]) == []


def test_layerwise_groups_sorts_layers_yielded_out_of_order_by_numeric_index() -> None:
    names = [
        "model.embed_tokens.weight",
        "model.layers.2.w",
        "model.layers.10.w",
        "model.layers.0.w",
        "model.layers.1.w",
        "model.layers.0.b",
        "model.norm.weight",
    ]

    assert layerwise_groups(names) == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.w", "model.layers.0.b"],
        ["model.layers.1.w"],
        ["model.layers.2.w"],
        ["model.layers.10.w"],
        ["model.norm.weight"],
    ]


def test_layerwise_groups_splits_unindexed_names_by_position_not_by_name() -> None:
    names = ["model.layers.1.w", "model.embed_tokens.weight", "model.layers.0.w"]

    assert layerwise_groups(names) == [
        ["model.layers.0.w"],
        ["model.layers.1.w"],
        ["model.embed_tokens.weight"],
    ]


def test_layerwise_groups_orders_stacks_by_first_appearance_of_their_prefix() -> None:
    names = [
        "visual.patch_embed.proj.weight",
        "visual.blocks.1.attn.weight",
        "model.layers.1.attn.weight",
        "visual.blocks.0.attn.weight",
        "model.layers.0.attn.weight",
        "visual.merger.weight",
        "lm_head.weight",
    ]

    assert layerwise_groups(names) == [
        ["visual.patch_embed.proj.weight"],
        ["visual.blocks.0.attn.weight"],
        ["visual.blocks.1.attn.weight"],
        ["model.layers.0.attn.weight"],
        ["model.layers.1.attn.weight"],
        ["visual.merger.weight", "lm_head.weight"],
    ]


def test_layerwise_groups_vision_tower_then_language_layers() -> None:
    names = [
        "visual.patch_embed.proj.weight",
        "visual.blocks.0.attn.qkv.weight",
        "visual.blocks.1.attn.qkv.weight",
        "visual.merger.mlp.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.language_model.layers.1.self_attn.q_proj.weight",
        "model.language_model.norm.weight",
        "lm_head.weight",
    ]

    groups = layerwise_groups(names)

    assert groups == [
        ["visual.patch_embed.proj.weight"],
        ["visual.blocks.0.attn.qkv.weight"],
        ["visual.blocks.1.attn.qkv.weight"],
        ["model.language_model.layers.0.self_attn.q_proj.weight"],
        ["model.language_model.layers.1.self_attn.q_proj.weight"],
        [
            "visual.merger.mlp.weight",
            "model.language_model.embed_tokens.weight",
            "model.language_model.norm.weight",
            "lm_head.weight",
        ],
    ]


def test_layerwise_groups_same_index_under_different_prefixes_are_different_groups() -> None:
    names = ["encoder.layer.0.w", "decoder.layer.0.w", "encoder.layer.0.b"]

    assert layerwise_groups(names) == [
        ["encoder.layer.0.w", "encoder.layer.0.b"],
        ["decoder.layer.0.w"],
    ]


def test_layerwise_groups_keeps_metadata_order_within_a_group() -> None:
    names = ["layers.0.z", "layers.1.a", "layers.0.a", "layers.0.m"]

    assert layerwise_groups(names) == [["layers.0.z", "layers.0.a", "layers.0.m"], ["layers.1.a"]]


def test_layerwise_groups_does_not_modify_its_input() -> None:
    names = ["lm_head.weight", "layers.1.w", "layers.0.w"]
    before = list(names)

    layerwise_groups(names)

    assert names == before
