"""The public surface: `asyncwt.__all__` is complete, sorted and importable."""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
import typing

import pytest

import asyncwt

# The names issue 2 requires, mirroring vllm.distributed.weight_transfer.base.
_REQUIRED = [
    "AsyncWeightSyncClient",
    "ModuleSource",
    "ParamMeta",
    "Replicate",
    "Shard",
    "TrainerInitInfo",
    "TrainerWeightTransferEngine",
    "VLLMWeightSyncClient",
    "WeightSource",
    "WeightTransferConfig",
    "WeightTransferEngine",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdateRequest",
    "create_worker_engine",
    "layerwise_groups",
    "materialize_full_tensor",
    "register_trainer_engine",
    "register_worker_engine",
    "trainer_init",
]


def _is_type_alias(obj: object) -> bool:
    """`Union[...]`, `dict[str, Any]` and friends have no module of their own."""
    return not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isroutine(obj))


@pytest.mark.parametrize("name", asyncwt.__all__)
def test_every_name_in_all_is_importable_from_asyncwt(name: str) -> None:
    module = __import__("asyncwt", fromlist=[name])  # what `from asyncwt import name` does

    assert getattr(module, name) is getattr(asyncwt, name)


def test_all_is_sorted() -> None:
    assert asyncwt.__all__ == sorted(asyncwt.__all__)


def test_all_has_no_duplicates() -> None:
    assert len(asyncwt.__all__) == len(set(asyncwt.__all__))


def test_every_public_attribute_is_listed_in_all() -> None:
    # dir(), not vars(): a built-in backend's names load on first use (module __getattr__).
    public = {
        name
        for name in dir(asyncwt)
        if not name.startswith("_") and not isinstance(getattr(asyncwt, name), types.ModuleType)
    }

    assert public == set(asyncwt.__all__)


@pytest.mark.parametrize("name", asyncwt.__all__)
def test_every_public_object_is_defined_in_asyncwt(name: str) -> None:
    obj = getattr(asyncwt, name)
    if _is_type_alias(obj):
        assert obj.__module__ in {"typing", "builtins", "types"} or obj.__module__.startswith(
            "asyncwt"
        )
    else:
        assert obj.__module__.startswith("asyncwt"), f"{name} comes from {obj.__module__}"


def test_type_aliases_are_the_only_objects_without_an_asyncwt_module() -> None:
    aliases = sorted(name for name in asyncwt.__all__ if _is_type_alias(getattr(asyncwt, name)))

    assert aliases == ["Placement", "WeightTransferUpdatePayload"]


_DEFINED = [name for name in asyncwt.__all__ if not _is_type_alias(getattr(asyncwt, name))]


@pytest.mark.parametrize("name", _DEFINED)
def test_every_public_object_reports_asyncwt_as_its_module(name: str) -> None:
    obj = getattr(asyncwt, name)

    assert obj.__module__ == "asyncwt"
    assert getattr(asyncwt, obj.__qualname__) is obj  # `asyncwt.<qualname>` finds it


@pytest.mark.parametrize("name", _DEFINED)
def test_every_public_objects_type_hints_still_resolve(name: str) -> None:
    """`typing.get_type_hints` reads a class's annotations in its `__module__`'s
    namespace: moving the module to `asyncwt` must not leave them unresolvable."""
    typing.get_type_hints(getattr(asyncwt, name))


def test_a_public_class_shows_its_public_path() -> None:
    assert repr(asyncwt.TcpTrainerEngine) == "<class 'asyncwt.TcpTrainerEngine'>"
    assert repr(asyncwt.TransferError("x").__class__) == "<class 'asyncwt.TransferError'>"


@pytest.mark.parametrize("name", _REQUIRED)
def test_issue_required_name_is_public(name: str) -> None:
    assert name in asyncwt.__all__
    assert hasattr(asyncwt, name)


def test_version_is_a_string() -> None:
    assert isinstance(asyncwt.__version__, str)
    assert asyncwt.__version__


@pytest.mark.slow
def test_import_asyncwt_loads_no_backend_module_until_one_is_used() -> None:
    """Backends are registered by name and imported on first use: a fresh
    `import asyncwt` loads none of them; asking for a public backend name loads its."""
    code = (
        "import sys, asyncwt\n"
        "print(sorted(m for m in sys.modules if m.startswith('asyncwt._backends.')))\n"
        "asyncwt.ShmTrainerInitInfo\n"
        "print('asyncwt._backends.shm.backend' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split("\n")

    assert out[:2] == ["[]", "True"]
