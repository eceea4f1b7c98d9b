"""Optional dependencies, imported on use so that `import asyncwt` never needs them."""

from __future__ import annotations

from typing import Any

__all__ = ["import_ray"]


def import_ray() -> Any:
    """`import ray`, or an `ImportError` that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            "RayClient needs Ray, an optional dependency of asyncwt: pip install 'asyncwt[ray]'"
        ) from exc
    return ray
