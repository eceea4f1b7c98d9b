"""WeightSource's contract and ModuleSource over a plain (unsharded) module."""

from __future__ import annotations

from collections.abc import Iterator
from functools import cached_property

import pytest
import torch

from asyncwt import ModuleSource, ParamMeta, Shard, WeightSource, materialize_full_tensor

_METAS = [
    ParamMeta("embed", torch.float32, (8, 4)),
    ParamMeta("layers.0.w", torch.float32, (4, 4), owners=(0,)),
    ParamMeta("layers.1.w", torch.float32, (4, 4), owners=(1, 2)),
    ParamMeta("lm_head", torch.float32, (8, 4), owners=(2, 0), placements=(Shard(0),)),
]


class _FullOnly(WeightSource):
    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return list(_METAS)

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        for meta in self.metadata:
            yield meta.name, torch.zeros(meta.shape, dtype=meta.dtype)


class _LocalOnly(WeightSource):
    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return list(_METAS)

    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()


class _Both(_FullOnly):
    def iter_local(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()


def test_weight_source_rejects_plain_property_metadata_at_class_definition() -> None:
    with pytest.raises(
        TypeError,
        match=r"^PropertySource\.metadata should be a functools\.cached_property \(engines read "
        r"it repeatedly and it must not change\), got property$",
    ):

        class PropertySource(WeightSource):
            @property
            def metadata(self) -> list[ParamMeta]:
                return []


def test_weight_source_rejects_method_metadata_at_class_definition() -> None:
    with pytest.raises(
        TypeError,
        match=r"^MethodSource\.metadata should be a functools\.cached_property \(engines read "
        r"it repeatedly and it must not change\), got function$",
    ):

        class MethodSource(WeightSource):
            def metadata(self) -> list[ParamMeta]:  # type: ignore[override]
                return []


def test_weight_source_rejects_plain_list_metadata_at_class_definition() -> None:
    with pytest.raises(
        TypeError,
        match=r"^ListSource\.metadata should be a functools\.cached_property \(engines read "
        r"it repeatedly and it must not change\), got list$",
    ):

        class ListSource(WeightSource):
            metadata: list[ParamMeta] = []  # noqa: RUF012


def test_weight_source_subclass_inheriting_cached_metadata_is_accepted() -> None:
    class Child(_FullOnly):
        pass

    assert Child().metadata == _METAS


def test_weight_source_without_metadata_cannot_be_instantiated() -> None:
    class NoMetadata(WeightSource):
        pass

    with pytest.raises(
        TypeError, match=r"^Can't instantiate abstract class NoMetadata .*\bmetadata'?$"
    ):
        NoMetadata()  # type: ignore[abstract]


def test_weight_source_cached_metadata_is_read_once() -> None:
    calls = []

    class Counting(WeightSource):
        @cached_property
        def metadata(self) -> list[ParamMeta]:
            calls.append(1)
            return list(_METAS)

    source = Counting()

    assert source.metadata is source.metadata
    assert source.owned_names(0) == ["embed", "layers.0.w", "lm_head"]
    assert len(calls) == 1


@pytest.mark.parametrize(
    ("rank", "names"),
    [
        (0, ["embed", "layers.0.w", "lm_head"]),
        (1, ["embed", "layers.1.w"]),
        (2, ["embed", "layers.1.w", "lm_head"]),
        (7, ["embed"]),
    ],
)
def test_weight_source_owned_names_follow_owners_in_metadata_order(
    rank: int, names: list[str]
) -> None:
    assert _FullOnly().owned_names(rank) == names


def test_weight_source_reports_which_iteration_modes_it_implements() -> None:
    assert _FullOnly().implements_iter_full()
    assert not _FullOnly().implements_iter_local()
    assert not _LocalOnly().implements_iter_full()
    assert _LocalOnly().implements_iter_local()
    assert _Both().implements_iter_full()
    assert _Both().implements_iter_local()
    assert ModuleSource(torch.nn.Linear(2, 2)).implements_iter_full()
    assert ModuleSource(torch.nn.Linear(2, 2)).implements_iter_local()


def test_weight_source_default_iter_local_raises_naming_the_class() -> None:
    with pytest.raises(NotImplementedError, match=r"^_FullOnly does not implement iter_local$"):
        _FullOnly().iter_local()


def test_weight_source_default_iter_full_raises_naming_the_class() -> None:
    with pytest.raises(NotImplementedError, match=r"^_LocalOnly does not implement iter_full$"):
        _LocalOnly().iter_full()


def _plain_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(10, 4).to(torch.bfloat16),
        torch.nn.Linear(4, 3),
        torch.nn.LayerNorm(3, dtype=torch.float64),
    )
    return model


_PLAIN_METAS = [
    ParamMeta("0.weight", torch.bfloat16, (10, 4)),
    ParamMeta("1.weight", torch.float32, (3, 4)),
    ParamMeta("1.bias", torch.float32, (3,)),
    ParamMeta("2.weight", torch.float64, (3,)),
    ParamMeta("2.bias", torch.float64, (3,)),
]


def test_module_source_metadata_of_plain_module() -> None:
    metadata = ModuleSource(_plain_model()).metadata

    assert metadata == _PLAIN_METAS
    assert [m.name for m in metadata] == ["0.weight", "1.weight", "1.bias", "2.weight", "2.bias"]
    assert [m.dtype for m in metadata] == [
        torch.bfloat16,
        torch.float32,
        torch.float32,
        torch.float64,
        torch.float64,
    ]
    assert [m.shape for m in metadata] == [(10, 4), (3, 4), (3,), (3,), (3,)]
    assert all(m.owners is None and m.mesh_shape is None and m.placements is None for m in metadata)


def test_module_source_metadata_is_cached_on_first_read() -> None:
    model = _plain_model()
    source = ModuleSource(model)
    first = source.metadata

    model.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))

    assert source.metadata is first
    assert [m.name for m in source.metadata] == [m.name for m in _PLAIN_METAS]


def test_module_source_plain_parameters_are_owned_by_every_rank() -> None:
    source = ModuleSource(_plain_model())
    names = [m.name for m in _PLAIN_METAS]

    assert source.owned_names(0) == names
    assert source.owned_names(5) == names


@pytest.mark.parametrize("mode", ["iter_full", "iter_local"])
def test_module_source_plain_iterators_yield_each_parameter_in_order(mode: str) -> None:
    model = _plain_model()
    source = ModuleSource(model)

    yielded = list(getattr(source, mode)())

    params = list(model.named_parameters())
    assert [name for name, _ in yielded] == [name for name, _ in params]
    for (_, tensor), (_, param) in zip(yielded, params):
        assert type(tensor) is torch.Tensor
        assert tensor.dtype == param.dtype
        assert tensor.shape == param.shape
        assert torch.equal(tensor, param)
        assert tensor.data_ptr() == param.data_ptr()


@pytest.mark.parametrize("mode", ["iter_full", "iter_local"])
def test_module_source_each_iteration_is_a_new_pass(mode: str) -> None:
    source = ModuleSource(_plain_model())

    first = [name for name, _ in getattr(source, mode)()]
    second = [name for name, _ in getattr(source, mode)()]

    assert first == second == [m.name for m in _PLAIN_METAS]


def test_module_source_yields_current_values_after_an_update() -> None:
    model = torch.nn.Linear(2, 2, bias=False)
    source = ModuleSource(model)
    assert source.metadata == [ParamMeta("weight", torch.float32, (2, 2))]

    with torch.no_grad():
        model.weight.fill_(3.0)

    ((name, tensor),) = list(source.iter_full())
    assert name == "weight"
    assert torch.equal(tensor, torch.full((2, 2), 3.0))


def test_module_source_of_module_without_parameters_is_empty() -> None:
    source = ModuleSource(torch.nn.ReLU())

    assert source.metadata == []
    assert list(source.iter_full()) == []
    assert list(source.iter_local()) == []


class _Decoder(torch.nn.Module):
    """Registration order of a Hugging Face decoder: embedding, layers, norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"attn": torch.nn.Linear(4, 4), "mlp": torch.nn.Linear(4, 4)})
            for _ in range(2)
        )
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 16, bias=False)


_LAYER_NAMES = [
    f"layers.{i}.{part}.{kind}"
    for i in range(2)
    for part in ("attn", "mlp")
    for kind in ("weight", "bias")
]


@pytest.mark.parametrize("mode", ["iter_full", "iter_local"])
def test_module_source_puts_parameters_outside_the_layers_first(mode: str) -> None:
    model = _Decoder()
    source = ModuleSource(model)
    expected = ["embed.weight", "norm.weight", "norm.bias", "lm_head.weight", *_LAYER_NAMES]

    yielded = list(getattr(source, mode)())

    assert [m.name for m in source.metadata] == expected
    assert [name for name, _ in yielded] == expected
    assert source.owned_names(0) == expected
    params = dict(model.named_parameters())
    for name, tensor in yielded:
        assert tensor.data_ptr() == params[name].data_ptr()


def test_module_source_layers_last_false_keeps_registration_order() -> None:
    model = _Decoder()
    source = ModuleSource(model, layers_last=False)
    registered = [name for name, _ in model.named_parameters()]

    assert registered[0] == "embed.weight" and registered[-1] == "lm_head.weight"
    assert [m.name for m in source.metadata] == registered
    assert [name for name, _ in source.iter_full()] == registered


# Importing torch's compiler (on the first torch.compile) warns about its own internals.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("compiled", ["whole", "per-layer"])
def test_module_source_reads_a_compiled_module_under_its_own_names(compiled: str) -> None:
    """`torch.compile` wraps the module (`_orig_mod.`); the workers' model has no
    such prefix, so the source reads through it, in the same order."""
    model = _Decoder()
    expected = [m.name for m in ModuleSource(model).metadata]
    if compiled == "whole":
        wrapped: torch.nn.Module = torch.compile(model)
    else:
        for index, layer in enumerate(model.layers):
            model.layers[index] = torch.compile(layer)
        wrapped = model
    assert any("_orig_mod" in name for name, _ in wrapped.named_parameters())

    source = ModuleSource(wrapped)

    assert [m.name for m in source.metadata] == expected
    assert [name for name, _ in source.iter_full()] == expected
    assert source.device() == torch.device("cpu")


def test_module_source_rename_maps_and_filters_names() -> None:
    model = _Decoder()

    def rename(name: str) -> str | None:
        return None if name.startswith("lm_head.") else f"model.{name}"

    source = ModuleSource(model, rename=rename)

    expected = ["model.embed.weight", "model.norm.weight", "model.norm.bias"]
    expected += [f"model.{name}" for name in _LAYER_NAMES]
    assert [m.name for m in source.metadata] == expected
    yielded = dict(source.iter_local())
    assert list(yielded) == expected
    assert yielded["model.embed.weight"].data_ptr() == model.embed.weight.data_ptr()


def test_module_source_rename_that_merges_names_is_refused() -> None:
    source = ModuleSource(_Decoder(), rename=lambda name: name.split(".")[-1])
    with pytest.raises(
        ValueError,
        match=r"^rename maps both 'embed\.weight' and 'layers\.0\.attn\.weight' to 'weight'; ",
    ):
        _ = source.metadata


def test_module_source_rename_must_return_a_name_or_none() -> None:
    with pytest.raises(ValueError, match=r"^rename should be a callable or None, got str$"):
        ModuleSource(_Decoder(), rename="model.")  # type: ignore[arg-type]
    source = ModuleSource(_Decoder(), rename=lambda name: "")
    with pytest.raises(
        ValueError, match=r"^rename should return a non-empty str or None, got '' for 'embed"
    ):
        list(source.iter_full())


def test_materialize_full_tensor_returns_plain_tensor_unchanged() -> None:
    tensor = torch.arange(6.0).reshape(2, 3)
    param = torch.nn.Parameter(torch.ones(3))

    assert materialize_full_tensor(tensor) is tensor
    assert materialize_full_tensor(param) is param
