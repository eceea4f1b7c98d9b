"""asyncwt's trainer engines behind vLLM's `WeightTransferTrainerFactory` (synchronous).

vLLM's trainer factory is synchronous: `WeightTransferTrainerFactory.trainer_init(
init_info, client=..., source=...)` returns a ready engine whose `send_weights()`
blocks. asyncwt's trainer engines are coroutines, so the engine registered there is an
adapter over `SyncTrainerEngine` (the async engine on a private event loop thread):
no second copy of the pipeline.

The factory dispatches on `init_info.backend`, so asyncwt's init infos are wrapped
first, which names the backend as vLLM knows it:

    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from asyncwt import TcpTrainerInitInfo
    from asyncwt._vllm.trainer import VllmTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        VllmTrainerInitInfo(TcpTrainerInitInfo(rank=0)), client=client, source=source
    )
    engine.send_weights(weight_version="v1")

`client` may be vLLM's `HTTPVLLMWeightSyncClient` (or any `VLLMWeightSyncClient`) or
asyncwt's `HttpClient`; `source` may be a vLLM `WeightSource` (adapted) or an asyncwt
one. Async trainers need none of this: `await asyncwt.trainer_init(TcpTrainerInitInfo(
rank=0), client=HttpClient(url), source=...)` talks to the same vLLM server.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from typing_extensions import Self

from .._core.meta import ParamMeta
from .._core.protocol import AnyWeightSyncClient
from .._core.source import WeightSource
from .._core.stats import RoundStats
from .._core.trainer_api import TrainerInitInfo
from .._trainer.blocking import SyncTrainerEngine
from .worker import vllm_backend_name

__all__ = [
    "LLMClient",
    "VllmSource",
    "VllmTrainerAdapter",
    "VllmTrainerInitInfo",
    "vllm_trainer_engine_class",
]

_CLASS: list[type[VllmTrainerAdapter]] = []


@dataclass(frozen=True)
class VllmTrainerInitInfo:
    """An asyncwt trainer init info, addressed to vLLM's trainer factory."""

    info: TrainerInitInfo
    """The asyncwt init info (e.g. `TcpTrainerInitInfo(rank=0)`); its settings are used
    as they are."""

    def __post_init__(self) -> None:
        if not isinstance(self.info, TrainerInitInfo):
            raise TypeError(
                f"info should be an asyncwt TrainerInitInfo, got {type(self.info).__name__}"
            )

    @property
    def backend(self) -> str:
        """vLLM's name of the backend (`"asyncwt_tcp"`), which the factory dispatches on."""
        return vllm_backend_name(self.info.backend)

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def is_sender(self) -> bool:
        return self.info.is_sender


class VllmSource(WeightSource):
    """An asyncwt `WeightSource` over a vLLM `WeightSource` (full tensors, in its order).

    asyncwt's pipelined backends send every full tensor from rank 0, so a vLLM source
    whose ranks hold only part of the model (`held_names()` not None) is refused.
    """

    def __init__(self, source: Any) -> None:
        if source.held_names() is not None:
            raise ValueError(
                f"{type(source).__name__}.held_names() should be None (every rank holds "
                f"every parameter): asyncwt sends every full tensor from rank 0"
            )
        self.source = source

    @cached_property
    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata()]

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from iter(self.source)


class LLMClient:
    """A `VLLMWeightSyncClient` over vLLM's offline `LLM` (one process, no server).

    `LLM`'s own methods take request objects (`{"init_info": ...}`), not the plain
    dicts of the protocol; this passes them on. Every call blocks until vLLM's workers
    answer, so trainer engines call it from a thread (as they call any sync client).
    """

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        """Release the workers' trainer connection (`shutdown_weight_transfer_engine`)."""
        self.llm.shutdown_weight_transfer_engine()


def _as_asyncwt_source(source: object) -> WeightSource | None:
    if source is None or isinstance(source, WeightSource):
        return source
    if callable(getattr(source, "metadata", None)) and callable(
        getattr(source, "held_names", None)
    ):
        return VllmSource(source)
    raise TypeError(
        f"source should be an asyncwt or vLLM WeightSource, got {type(source).__name__}"
    )


class VllmTrainerAdapter:
    """asyncwt's trainer engine as vLLM's trainer factory builds it (blocking calls).

    The class registered in vLLM is this one with vLLM's `TrainerWeightTransferEngine`
    as a further base (see `vllm_trainer_engine_class`). `send_weights(
    weight_version=None)` runs one round and returns asyncwt's `RoundStats`; call it on
    every trainer rank, from plain (non-async) code.
    """

    init_info_cls = VllmTrainerInitInfo

    def __init__(
        self, engine: SyncTrainerEngine, *, client: Any, source: Any, is_sender: bool
    ) -> None:
        # What vLLM's base __init__ sets, set here (the base takes no engine).
        self.client = client
        self.source = source
        self.is_sender = is_sender
        self.engine = engine
        """The blocking asyncwt engine doing the work."""

    @classmethod
    def trainer_init(
        cls,
        init_info: VllmTrainerInitInfo | TrainerInitInfo,
        *,
        client: AnyWeightSyncClient,
        source: Any = None,
    ) -> Self:
        """Rendezvous through asyncwt (`SyncTrainerEngine`); call on every trainer rank.

        `source` is an asyncwt `WeightSource` or a vLLM one (wrapped in `VllmSource`).
        """
        info = init_info.info if isinstance(init_info, VllmTrainerInitInfo) else init_info
        engine = SyncTrainerEngine(info, client=client, source=_as_asyncwt_source(source))
        return cls(engine, client=client, source=source, is_sender=info.is_sender)

    def send_weights(self, *, weight_version: str | None = None) -> RoundStats:
        """One round, blocking; see `SyncTrainerEngine.send_weights`."""
        return self.engine.send_weights(weight_version=weight_version)

    def shutdown(self) -> None:
        """Shut the asyncwt engine and its loop thread down. Idempotent."""
        self.engine.shutdown()


def vllm_trainer_engine_class() -> type[VllmTrainerAdapter]:
    """The class registered in vLLM's `WeightTransferTrainerFactory` for every asyncwt
    backend: `VllmTrainerAdapter` with vLLM's `TrainerWeightTransferEngine` as a further
    base. Built once; imports vLLM."""
    if _CLASS:
        return _CLASS[0]
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

    namespace = {"__module__": __name__, "__qualname__": "VllmTrainerEngine"}
    cls: type[VllmTrainerAdapter] = type(
        "VllmTrainerEngine", (VllmTrainerAdapter, TrainerWeightTransferEngine), namespace
    )
    _CLASS.append(cls)
    return cls
