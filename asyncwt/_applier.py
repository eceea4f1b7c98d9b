"""The worker's deferred applier: unpack, transform and load buckets off the hot path.

`update_weights` only receives; each received bucket is handed here and processed
on background threads while the next bucket arrives. A bucket's buffer goes back
to the receiver only after its last reader (this applier) finished with it. Errors
are kept, never lost: `drain()` waits for everything and raises the first one,
naming the parameter.

Where a parameter's bytes can land where they are applied (a plain model, a CPU
parameter that is contiguous and already of the wire dtype, no transform), the
receiver writes straight into it and the applier has nothing left to do: a
received byte is copied once, by the kernel.

A parameter larger than a bucket arrives in chunks. Where nothing needs it whole
(no transform, no `load_weights`), each chunk is copied into its element range as
it arrives, so a large parameter costs no memory beyond the receive buffers.
Otherwise it is reassembled in a parameter-sized buffer, which is reused by the
next round unless `load_weights` (which may keep the tensor) received it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ._bytes import byte_view
from ._exceptions import ApplyError, PlanMismatchError
from ._meta import ParamMeta
from ._plan import Bucket, TransferPlan

__all__ = ["DeferredApplier", "ModelTarget", "Transform", "weights_loader"]

Transform = Callable[[str, torch.Tensor], torch.Tensor]
"""A per-parameter hook `(name, tensor) -> tensor` run before loading (cast, quantise)."""


@dataclass
class ModelTarget:
    """How received parameters reach one model, resolved once per plan and model.

    Unstaged, `params` are the model's own parameters: a round writes into the live
    weights as it arrives. Staged (`resolve(..., staged=True)`), `params` are a
    shadow copy that the round fills, and `commit()` moves a completely received
    round into the model in one step at `finish_weight_update`; a round that fails
    before that leaves the model as it was.
    """

    model: torch.nn.Module
    plan: TransferPlan
    transform: Transform | None
    load_weights: Callable[[list[tuple[str, torch.Tensor]]], object] | None
    params: dict[str, torch.Tensor]
    """Where received parameters are written: the model's own, or the shadow copy."""
    direct: tuple[bool, ...]
    """Per plan parameter: whether its bytes are received straight into `params`."""
    chunks_land: tuple[bool, ...]
    """Per plan parameter: whether a chunk of it is copied into its element range of
    `params` as it arrives (nothing needs the whole tensor), instead of reassembled."""
    commit: Callable[[], None] | None = None
    """Staged only: moves the shadow copy into the model (None when unstaged)."""

    @classmethod
    def resolve(
        cls,
        model: torch.nn.Module,
        plan: TransferPlan,
        transform: Transform | None,
        *,
        in_place: bool = True,
        staged: bool = False,
    ) -> ModelTarget:
        """Match `plan` against `model`; a parameter it cannot take is a `PlanMismatchError`.

        A model with `load_weights` (vLLM's models) takes whatever it accepts, so
        nothing is checked up front; otherwise every plan parameter must exist in
        `named_parameters()` with the same shape. `in_place=False` is for transports
        whose bytes arrive in their own memory (shared memory, collectives).

        `staged=True` allocates the shadow copy now: one extra copy of every plan
        parameter, in the model's dtype and on its device (for a model with
        `load_weights`, in the wire dtype on the CPU, and `transform` and
        `load_weights` then run at commit).
        """
        load = weights_loader(model)
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        if load is not None:
            if staged:
                return cls._staged_loader(model, plan, transform, load, in_place=in_place)
            none = (False,) * len(plan.params)
            return cls(model, plan, transform, load, params, none, none)
        live: dict[str, torch.Tensor] = {}
        for meta in plan.params:
            param = params.get(meta.name)
            if param is None:
                raise PlanMismatchError(
                    f"the worker's model has no parameter {meta.name!r} that the trainer sends "
                    f"(it has {len(params)} parameters); load_weights is not defined to map names"
                )
            if tuple(param.shape) != meta.shape:
                raise PlanMismatchError(
                    f"parameter {meta.name!r}: the worker's shape is {tuple(param.shape)}, "
                    f"the trainer sends {meta.shape}"
                )
            live[meta.name] = param
        commit = None
        if staged:
            shadow = {
                name: torch.empty(p.shape, dtype=p.dtype, device=p.device)
                for name, p in live.items()
            }

            def commit() -> None:
                with torch.no_grad():
                    for name, param in live.items():
                        param.data.copy_(shadow[name])

            params = shadow
        direct = tuple(
            in_place
            and transform is None
            and params[meta.name].device.type == "cpu"
            and params[meta.name].dtype == meta.dtype
            and params[meta.name].is_contiguous()
            for meta in plan.params
        )
        chunks_land = tuple(
            transform is None and _chunks_align(plan, meta, params[meta.name])
            for meta in plan.params
        )
        return cls(model, plan, transform, None, params, direct, chunks_land, commit)

    @classmethod
    def _staged_loader(
        cls,
        model: torch.nn.Module,
        plan: TransferPlan,
        transform: Transform | None,
        load: Callable[[list[tuple[str, torch.Tensor]]], object],
        *,
        in_place: bool,
    ) -> ModelTarget:
        """Staged target of a `load_weights` model: the round lands in wire-format
        tensors; transform and `load_weights` run on all of them at commit."""
        shadow = {meta.name: torch.empty(meta.shape, dtype=meta.dtype) for meta in plan.params}

        def commit() -> None:
            ready = [
                (name, transform(name, t) if transform is not None else t)
                for name, t in shadow.items()
            ]
            with torch.no_grad():
                load(ready)

        direct = (in_place,) * len(plan.params)
        chunks_land = tuple(_chunks_align(plan, meta, shadow[meta.name]) for meta in plan.params)
        return cls(model, plan, None, None, shadow, direct, chunks_land, commit)

    def landing_view(self, index: int) -> memoryview:
        """The bytes of plan parameter `index` where it is applied (direct landing)."""
        return byte_view(self.params[self.plan.params[index].name].data)

    def chunk_destination(self, index: int, start: int, nbytes: int) -> torch.Tensor:
        """The elements of plan parameter `index` that its wire bytes `[start, start +
        nbytes)` hold, in `params` (only where `chunks_land[index]`)."""
        meta = self.plan.params[index]
        size = meta.dtype.itemsize
        flat = self.params[meta.name].data.view(-1)
        return flat[start // size : (start + nbytes) // size]


def weights_loader(
    model: torch.nn.Module,
) -> Callable[[list[tuple[str, torch.Tensor]]], object] | None:
    """The model's `load_weights` (vLLM's models have one), or None: such a model
    takes whole tensors by name instead of copies into `named_parameters()`."""
    load = getattr(model, "load_weights", None)
    return load if callable(load) else None


def _chunks_align(plan: TransferPlan, meta: ParamMeta, param: torch.Tensor) -> bool:
    """Whether any chunk of `meta` can be copied straight into `param`'s elements:
    `param` is contiguous and every chunk boundary falls between two elements (the
    plan cuts a large parameter at multiples of the bucket size)."""
    return param.is_contiguous() and plan.bucket_bytes % meta.dtype.itemsize == 0


class DeferredApplier:
    """Applies received buckets on `threads` background threads."""

    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="asyncwt-apply")
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self._jobs: list[tuple[int, Bucket, TransferPlan]] = []
        """(round, bucket, plan) of each entry of `_futures`, for error messages."""
        self._error: ApplyError | None = None
        self._partial: dict[int, tuple[torch.Tensor, int]] = {}
        """Chunked parameters being reassembled: buffer and bytes received so far."""
        self._spare: dict[int, list[torch.Tensor]] = {}
        """Reassembly buffers free for reuse, by size."""

    def submit(
        self,
        target: ModelTarget,
        round_id: int,
        bucket: Bucket,
        buffer: torch.Tensor | None,
        release: Callable[[], None],
    ) -> None:
        """Queue `bucket` (received into `buffer`) for applying; `release` frees the buffer."""
        with self._lock:
            future = self._executor.submit(self._apply, target, round_id, bucket, buffer, release)
            self._futures.append(future)
            self._jobs.append((round_id, bucket, target.plan))

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds for every queued bucket; whether all are done."""
        with self._lock:
            futures = list(self._futures)
        _, not_done = concurrent.futures.wait(futures, timeout=timeout)
        return not not_done

    def stuck_error(self, timeout: float, when: str) -> ApplyError:
        """The error for buckets still unapplied after `timeout` seconds, naming the first."""
        with self._lock:
            pending = [(f, job) for f, job in zip(self._futures, self._jobs) if not f.done()]
        if not pending:
            return ApplyError(f"background apply did not finish within drain_timeout={timeout}s")
        round_id, bucket, plan = pending[0][1]
        names = [plan.params[s.param].name for s in bucket.slices]
        shown = ", ".join(repr(n) for n in names[:3]) + (", ..." if len(names) > 3 else "")
        return ApplyError(
            f"round {round_id}, bucket {bucket.index} (parameters {shown}): background apply "
            f"did not finish within drain_timeout={timeout}s {when} ({len(pending)} bucket(s) "
            f"unapplied): a transform or load_weights that never returns? The weights are "
            f"incomplete and the round's version is not published; once the apply threads "
            f"return, a new round applies cleanly (raise drain_timeout if applying is slow)"
        )

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every queued bucket; raise the first error (once), then reset.

        With a `timeout`, buckets still unapplied after it raise `ApplyError` naming
        the first one; they stay queued (a later drain waits for them again).
        """
        if not self.wait(timeout):
            assert timeout is not None
            raise self.stuck_error(timeout, "while draining")
        with self._lock:
            done = [f.done() for f in self._futures]
            self._futures = [f for f, d in zip(self._futures, done) if not d]
            self._jobs = [j for j, d in zip(self._jobs, done) if not d]
            error, self._error = self._error, None
            if not self._futures:
                self._partial.clear()
        if error is not None:
            raise error

    def shutdown(self, timeout: float | None = None) -> None:
        """Finish queued work and stop the threads.

        With a `timeout`, stop waiting after it: an apply still running (a transform
        that never returns) keeps its thread until it returns.
        """
        if timeout is None:
            self._executor.shutdown(wait=True)
            return
        self.wait(timeout)
        self._executor.shutdown(wait=False)

    def _apply(
        self,
        target: ModelTarget,
        round_id: int,
        bucket: Bucket,
        buffer: torch.Tensor | None,
        release: Callable[[], None],
    ) -> None:
        where = "?"  # the parameter(s) being worked on, for the error message
        try:
            with self._lock:
                if self._error is not None:
                    return  # the round already failed; don't pile on
            ready: list[tuple[str, torch.Tensor]] = []
            assembled: list[torch.Tensor] = []
            for s in bucket.slices:
                if target.direct[s.param]:
                    continue
                meta = target.plan.params[s.param]
                name, where = meta.name, repr(meta.name)
                assert buffer is not None
                region = buffer[s.offset : s.offset + s.nbytes]
                if s.nbytes == meta.nbytes:
                    ready.append((name, _as_tensor(region, meta.dtype, meta.shape)))
                elif target.chunks_land[s.param]:
                    with torch.no_grad():
                        target.chunk_destination(s.param, s.start, s.nbytes).copy_(
                            region.view(meta.dtype)
                        )
                else:
                    whole = self._reassemble(s.param, meta.nbytes, s.start, region)
                    if whole is not None:
                        assembled.append(whole)
                        ready.append((name, _as_tensor(whole, meta.dtype, meta.shape)))
            if target.transform is not None:
                transformed = []
                for name, tensor in ready:
                    where = repr(name)
                    transformed.append((name, target.transform(name, tensor)))
                ready = transformed
            if target.load_weights is not None:
                names = [n for n, _ in ready]
                where = repr(names[0]) if len(names) == 1 else f"one of {names}"
                with torch.no_grad():
                    target.load_weights(ready)
            else:
                with torch.no_grad():
                    for name, tensor in ready:
                        where = repr(name)
                        target.params[name].data.copy_(tensor)
                self._reuse(assembled)  # copied out: the next round may fill them again
        except BaseException as exc:  # noqa: BLE001 - kept for drain(), never lost
            error = ApplyError(
                f"round {round_id}, bucket {bucket.index}: applying parameter {where} failed: "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            with self._lock:
                if self._error is None:
                    self._error = error
        finally:
            if buffer is not None and buffer.is_cuda:
                # Copies out of a device buffer are asynchronous: the buffer may be
                # handed back (and rewritten) only once they have run.
                torch.cuda.current_stream(buffer.device).synchronize()
            release()

    def _reassemble(
        self, index: int, nbytes: int, start: int, region: torch.Tensor
    ) -> torch.Tensor | None:
        """Collect a chunked parameter; return it whole once its last byte arrived."""
        with self._lock:
            whole, got = self._partial.get(index, (None, 0))
            if whole is None:
                spare = self._spare.get(nbytes)
                whole = spare.pop() if spare else torch.empty(nbytes, dtype=torch.uint8)
            self._partial[index] = (whole, got)
        whole[start : start + region.numel()].copy_(region)
        with self._lock:
            whole, got = self._partial[index]
            got += region.numel()
            if got < nbytes:
                self._partial[index] = (whole, got)
                return None
            del self._partial[index]
            return whole

    def _reuse(self, buffers: list[torch.Tensor]) -> None:
        """Keep reassembly buffers whose contents were copied out, for the next round.

        At most as many of a size are kept as were in use at once, so the spares
        never outgrow one round's peak.
        """
        if buffers:
            with self._lock:
                for buffer in buffers:
                    self._spare.setdefault(buffer.numel(), []).append(buffer)


def _as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """View `raw` bytes as a tensor of `dtype` and `shape` (no copy)."""
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)
