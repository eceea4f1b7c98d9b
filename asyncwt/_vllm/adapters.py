"""Adapter rounds inside vLLM: LoRA adapters served from memory, no folder.

vLLM loads a LoRA adapter when a request names one its workers do not hold:
`WorkerLoRAManager._load_adapter(lora_request)` reads the folder at
`lora_request.lora_path`. And vLLM's workers drop every adapter they hold after each
weight update (`reset_lora_state`, base rounds and adapter rounds alike). So an
adapter round does not install anything itself: when it is published, the worker
keeps its own copy of the adapter's tensors here (`publish`), and vLLM's next
request for the adapter loads it from that copy. The plugin points vLLM's loader at
this module (`serve_adapters_from_memory`) for every path of the form
`adapter_path(name)`: `asyncwt-adapter://<name>`; any other path loads as before.

What this gives, with no call from the user but naming the path once:
- the adapter served right after `send_weights` is the round's (every round drops
  the adapters held, and the plugin resets the prefix cache after every round, so
  no cached prefix of an older adapter is reused);
- it survives base rounds (reloaded from memory on top of the new base);
- vLLM never aliases the trainer's tensors, nor this copy: `from_lora_tensors`
  scales the tensors it is given in place, so each load gets fresh copies.

To serve it in the one-process `LLM`, name `adapter_path(name)` as the adapter's
path: `LoRARequest(name, <any positive int id>, adapter_path(name))`. The OpenAI
server (`--enable-lora`, `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`) serves `model=<name>`
through asyncwt's LoRA resolver (`resolve_adapters_by_name`), with no call at all.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .._core.adapter import AdapterConfig

__all__ = [
    "ADAPTER_SCHEME",
    "adapter_path",
    "publish",
    "resolve_adapters_by_name",
    "serve_adapters_from_memory",
]

logger = logging.getLogger("asyncwt")

ADAPTER_SCHEME = "asyncwt-adapter://"
"""The prefix of the LoRA paths vLLM loads from asyncwt's adapters in memory."""

_ADAPTERS: dict[str, tuple[AdapterConfig, dict[str, torch.Tensor]]] = {}
"""The adapters published in this (worker) process, by name."""
_LOCK = threading.Lock()


def adapter_path(name: str) -> str:
    """The LoRA path under which vLLM serves asyncwt's adapter `name` from memory."""
    return ADAPTER_SCHEME + name


def publish(config: AdapterConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Serve `tensors` (this worker's own copies) as adapter `config.name` from now on."""
    with _LOCK:
        _ADAPTERS[config.name] = (config, tensors)


def _published(name: str) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    with _LOCK:
        found = _ADAPTERS.get(name)
    if found is None:
        raise FileNotFoundError(
            f"asyncwt adapter {name!r} has not been pushed to this worker yet "
            f"(send_weights with AdapterSource(..., name={name!r}) first)"
        )
    return found


def _load_from_memory(manager: Any, lora_request: Any) -> Any:
    """What vLLM's `WorkerLoRAManager._load_adapter` does, from an adapter in memory."""
    from vllm.lora.peft_helper import PEFTHelper

    name = lora_request.lora_path.removeprefix(ADAPTER_SCHEME)
    config, tensors = _published(name)
    peft_helper = PEFTHelper.from_dict(
        {**config.peft_config(), "vllm_max_position_embeddings": manager.max_position_embeddings}
    )
    peft_helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        # Copies: from_lora_tensors scales its tensors in place.
        tensors={key: tensor.clone() for key, tensor in tensors.items()},
        peft_helper=peft_helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None),
    )
    lora.is_3d_lora_weight = getattr(lora_request, "is_3d_lora_weight", False)
    return lora


def serve_adapters_from_memory() -> None:
    """Make vLLM's LoRA loader read `adapter_path(name)` from asyncwt's adapters in
    memory (see the module docstring). Idempotent."""
    try:
        from vllm.lora.worker_manager import WorkerLoRAManager
    except ImportError as exc:  # pragma: no cover - a vLLM without LoRA support
        logger.warning("cannot serve asyncwt adapters from memory with this vLLM: %r", exc)
        return
    original = WorkerLoRAManager._load_adapter
    if getattr(original, "_asyncwt_adapters", False):
        return

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        path = getattr(lora_request, "lora_path", None)
        if isinstance(path, str) and path.startswith(ADAPTER_SCHEME):
            return _load_from_memory(self, lora_request)
        return original(self, lora_request)

    _load_adapter._asyncwt_adapters = True  # type: ignore[attr-defined]
    _load_adapter.__doc__ = original.__doc__
    WorkerLoRAManager._load_adapter = _load_adapter


def resolve_adapters_by_name() -> None:
    """Let vLLM's OpenAI server serve `model=<name>` for adapters pushed as `name`.

    The server knows only adapters it loaded (`/v1/load_lora_adapter`) or that a
    LoRA resolver finds when a request names an unknown model; this registers
    asyncwt's resolver, which answers any name with `adapter_path(name)`. The worker
    then loads the adapter from memory, or fails the request ("found but could not be
    loaded", 400) while no adapter of that name was pushed. vLLM consults resolvers
    only with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`. Idempotent.
    """
    try:
        from vllm.lora.request import LoRARequest
        from vllm.lora.resolver import LoRAResolver, LoRAResolverRegistry
    except ImportError as exc:  # pragma: no cover - a vLLM without LoRA resolvers
        logger.warning("cannot resolve asyncwt adapters by name with this vLLM: %r", exc)
        return
    if "asyncwt" in LoRAResolverRegistry.get_supported_resolvers():
        return

    class AsyncwtAdapterResolver(LoRAResolver):  # type: ignore[misc]
        """Resolves a model name to the asyncwt adapter of that name, in memory."""

        async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
            return LoRARequest(lora_name, 1, adapter_path(lora_name))

    LoRAResolverRegistry.register_resolver("asyncwt", AsyncwtAdapterResolver())
