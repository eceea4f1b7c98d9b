"""Which device a trainer's lanes and staging use: resolved once, with its index.

A bare `"cuda"` means "the current CUDA device" only in the thread that says it:
`torch.cuda.set_device` is per thread, and an engine's work may run on an event
loop or portal thread that never called it (and so sits on GPU 0). Every device a
trainer engine keeps is therefore resolved here, in the caller's thread, to an
explicit `cuda:N`.

Nothing here runs at import: asking torch whether CUDA exists initialises the
driver, which a process that forks afterwards (vLLM's workers do) must not have done.
"""

from __future__ import annotations

import torch

from .source import WeightSource

__all__ = ["resolve_device", "source_device"]


def source_device(source: WeightSource | None) -> torch.device | None:
    """The device `source`'s tensors live on on this rank, or None if it cannot say."""
    if source is None:
        return None
    hint = source.device()
    return None if hint is None else torch.device(hint)


def resolve_device(
    name: str | torch.device | None, source: WeightSource | None = None
) -> torch.device:
    """The device to stage on, with its index when it is a GPU.

    `name` wins when given; `"cuda"` without an index becomes the calling thread's
    current CUDA device. `None` follows the weights: the device `source` reports
    (a CPU model stays on the CPU even on a GPU host, so a torch_dist trainer keeps
    gloo), else CUDA's current device where CUDA is available, else the CPU.
    """
    if name is None:
        hinted = source_device(source)
        if hinted is not None:
            device = hinted
        elif torch.cuda.is_available():
            device = torch.device("cuda")
        else:
            device = torch.device("cpu")
    else:
        try:
            device = torch.device(name)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device should name a torch device, got {name!r}: {exc}") from None
    if device.type == "cuda" and device.index is None:
        if not torch.cuda.is_available():
            raise ValueError(f"device is {name!r} but CUDA is not available here")
        device = torch.device("cuda", torch.cuda.current_device())
    return device
