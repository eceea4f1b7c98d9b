"""Shared test configuration.

Every asyncio test runs on the default loop and on uvloop. Tests are in two tiers:
`slow` ones start processes (worker children, forkers, Ray, vLLM), need root or soak;
the rest, `python -m pytest -q -m "not slow"`, is the fast tier run after each change.
A test joins the slow tier by its mark, by a `cuda`/`ray`/`vllm` mark, or by using a fixture
in SPAWNING_FIXTURES; a fast test that starts a process fails (tests/_spawns.py), so
a new test cannot slip a process into the fast tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import _spawns
import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
    uvloop = None


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    factories: dict[str, Callable[[], Any]] = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


SLOW_MARKS = ("cuda", "ray", "vllm")
"""Marks whose tests are slow without saying so: Ray and vLLM start processes, and the
cuda tests (skipped here, so the spy cannot sort them) run on the GPU machine only."""
SPAWNING_FIXTURES = frozenset(
    {
        "tests/test_adapter.py::worker_url",
        "tests/test_backends.py::mixed_worker",
        "tests/test_backends.py::second_mixed_worker",
        "tests/test_bench.py::tiny_run",
        "tests/test_chain.py::pool",
        "tests/test_chain_trust.py::pool",
        "tests/test_delta.py::workers",
        "tests/test_delta_shm.py::workers",
        "tests/test_faults.py::worker",
        "tests/test_ray.py::two_workers",
        "tests/test_server.py::workers",
        "tests/test_shm_direct.py::probe_elsewhere",
        "tests/test_source_dtensor.py::ranks",
        "tests/test_sync.py::worker_url",
        "tests/test_vllm.py::vllm_server",
    }
)
"""Fixtures (`file::name`, where defined) that start processes: their users are slow.
The spy names the fixture when one not listed here starts a process."""


def _spawning_fixtures(item: pytest.Item) -> set[str]:
    """The fixtures `item` uses that are in SPAWNING_FIXTURES."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    used = {
        f"{fixturedef.baseid}::{name}"
        for name, fixturedefs in info.name2fixturedefs.items()
        for fixturedef in fixturedefs
    }
    return used & SPAWNING_FIXTURES


def pytest_configure(config: pytest.Config) -> None:
    _spawns.install()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the slow tier; tests marked `cuda` need a GPU: they run on the GPU machine."""
    import torch

    for item in items:
        if any(mark in item.keywords for mark in SLOW_MARKS) or _spawning_fixtures(item):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _watched(item: pytest.Item) -> Any:
    """Run one phase of `item`, refusing spawns unless it is slow (see tests/_spawns.py)."""
    _spawns.watch(None if item.get_closest_marker("slow") else item.nodeid)
    try:
        result = yield
    finally:
        refused = list(_spawns.spawned)
        _spawns.watch(None)
    if refused:  # the phase passed: a thread swallowed the refusal
        pytest.fail(f"{item.nodeid} started processes but is not marked slow: {refused}")
    return result


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    """Name the fixture being set up, for the spy's message."""
    with _spawns.in_fixture(f"{fixturedef.baseid}::{fixturedef.argname}"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    return (yield from _watched(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Any:
    return (yield from _watched(item))
