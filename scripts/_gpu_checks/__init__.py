"""gpu-check's checks, one module per topic; `load_all` imports every module here.

Add a check by adding a module (or a function to one) with `@check(...)` from
`_gpu_check_core`: see `scripts/README.md`. Modules load in name order and checks
run in group order (`correctness`, then `perf`), then in load order.
"""

from __future__ import annotations

import importlib
import pkgutil


def load_all() -> None:
    """Import every check module of this package (each registers its checks)."""
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{info.name}")
