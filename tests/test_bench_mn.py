"""The cluster bench's M:N pieces: layouts, the synthetic model's TP slices, the ideal.

The emulated-cluster run itself (sliced ranks as hosts, bit-exact per rank) is in
`test_bench_cluster.py`'s quick run; these check what its rows are judged by.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncwt._bench._model import LlamaShape, SyntheticLlama, fill_random
from asyncwt._bench._tp_model import tp_boxes, tp_shard, tp_worker_model
from asyncwt._bench.cluster.layouts import Layout, fsdp_rows, link_payloads

SHAPE = LlamaShape(hidden=256, intermediate=704, kv_dim=128, vocab=1000, layers=2)
"""Two kv heads of 64: with four ranks each head is held by two of them."""


def _numel(shape: LlamaShape) -> int:
    return sum(math.prod(dims) for _, dims in shape.param_shapes())


def test_layout_names_parse_and_bad_ones_are_refused_with_the_form() -> None:
    assert Layout.parse("tp2") == Layout(engines=1, tp=2)
    assert Layout.parse("2xtp2").shards == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert Layout.parse("tp4").receivers == 4 and Layout.parse("3xtp2").name == "3xtp2"
    for bad in ("tp", "tp0", "0xtp2", "2tp2", "tp2x2", ""):
        with pytest.raises(ValueError, match=r"should be \[Kx\]tpN .* got"):
            Layout.parse(bad)


def test_cli_layouts_option() -> None:
    from asyncwt._bench.cluster.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["--layouts", "tp2, 2xtp2", "--layout-ranks", "1,4"])
    assert args.layouts == ("tp2", "2xtp2") and args.layout_ranks == (1, 4)
    with pytest.raises(SystemExit):
        parser.parse_args(["--layouts", "tp2,eight"])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_tp_group_holds_every_element_and_only_the_kv_heads_repeat(world: int) -> None:
    boxes = [tp_boxes(SHAPE, rank, world) for rank in range(world)]
    for name, dims in SHAPE.param_shapes():
        held = [b[name] for b in boxes]
        covered = torch.zeros(dims, dtype=torch.int32)
        for box in held:
            covered[tuple(slice(s, s + n) for s, n in zip(box.start, box.size))] += 1
        if name.endswith(("k_proj.weight", "v_proj.weight")):  # 2 heads over `world` ranks
            assert covered.min() == covered.max() == max(1, world // 2), name
        elif name.endswith("norm.weight"):  # replicated
            assert covered.min() == covered.max() == world, name
        else:
            assert covered.min() == covered.max() == 1, name


def test_a_ranks_shard_is_its_boxes_of_the_full_model_and_its_worker_declares_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    full = SyntheticLlama(SHAPE)
    fill_random(full, seed=3)
    shard = tp_shard(full, 1, 4)
    params = dict(full.named_parameters())
    for name, box in tp_boxes(SHAPE, 1, 4).items():
        region = params[name][tuple(slice(s, s + n) for s, n in zip(box.start, box.size))]
        assert torch.equal(shard.get_parameter(name), region), name
    assert shard.get_parameter("model.embed_tokens.weight").shape == (256, 256)  # 1024 / 4
    monkeypatch.setenv("ASYNCWT_BENCH_MODEL", SHAPE.to_json())
    worker = tp_worker_model(rank=3, world_size=4)
    layout = worker.asyncwt_layout
    assert layout["model.embed_tokens.weight"] == ((768, 0), (232, 256))  # past the vocab
    assert all(float(p.abs().sum()) == 0.0 for p in worker.parameters())
    assert [n for n, _ in worker.named_parameters()] == [n for n, _ in full.named_parameters()]


def test_fsdp_rows_are_torch_chunks() -> None:
    for rows, ranks in ((10, 4), (3, 4), (8, 2), (1000, 3)):
        chunks = torch.arange(rows).chunk(ranks)
        for rank in range(ranks):
            start, stop = fsdp_rows(rows, ranks, rank)
            expected = chunks[rank].tolist() if rank < len(chunks) else []
            assert list(range(start, stop)) == expected


@pytest.mark.parametrize("layout", ["tp2", "tp4", "2xtp2"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_link_payloads_send_each_received_byte_once_and_slices_cut_the_bytes(
    layout: str, ranks: int
) -> None:
    shards = Layout.parse(layout).shards
    sent, received = link_payloads(SHAPE, shards, ranks)
    assert len(sent) == ranks and len(received) == len(shards)
    assert sum(sent) == sum(received)  # each receiver's bytes come from exactly one rank
    for shard, got in zip(shards, received):
        expected = sum(box.numel for box in tp_boxes(SHAPE, *shard).values())
        assert got == 2 * expected
    whole_sent, whole_received = link_payloads(SHAPE, [None] * len(shards), ranks)
    assert whole_received == [2 * _numel(SHAPE)] * len(shards)
    assert sum(whole_sent) == len(shards) * 2 * _numel(SHAPE)
    tp = Layout.parse(layout).tp
    # A sliced receiver takes about 1/tp of the model (norms and kv heads repeat).
    assert max(received) < 1.1 * 2 * _numel(SHAPE) / tp
