"""The worker's deferred applier: unpack, transform and load buckets off the hot path.

`update_weights` only receives; each received bucket is handed here and processed
on background threads while the next bucket arrives. A bucket's buffer goes back
to the receiver only after its last reader (this applier) finished with it. Errors
are kept, never lost: `drain()` waits for everything and raises the first one,
naming the parameter.

Where a parameter's bytes can land where they are applied (a plain model, a CPU
parameter that is contiguous and already of the wire dtype, no transform or an
elementwise one), the receiver writes straight into it and the applier has
nothing left to do but run the elementwise transform there, in place: a received
byte is copied once, by the kernel.

A parameter larger than a bucket arrives in chunks. Where nothing needs it whole
(no `load_weights`, and no transform or an elementwise one), each chunk is
transformed and copied into its element range as it arrives, so a large parameter
costs no memory beyond the receive buffers. Otherwise it is reassembled in a
parameter-sized buffer, which is reused by the next round unless `load_weights`
(which may keep the tensor) received it.

Work that lands element by element is divisible: a bucket's share of it is cut
into up to `threads` parts of about equal bytes (`split_runs`), applied in
parallel, and the bucket's buffer is released when its last part finishes. So a
large tensor at the end of a round is not left to one thread after the last byte.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .._core.bytes import byte_view
from .._core.errors import ApplyError, PlanMismatchError
from .._core.lanes import DeviceLane, wait_for_stream
from .._core.meta import ParamMeta
from .._core.owners import row_groups
from .._core.plan import Bucket, Slice, TransferPlan

__all__ = [
    "MIN_PART_BYTES",
    "DeferredApplier",
    "ModelTarget",
    "Piece",
    "Transform",
    "bucket_parts",
    "split_runs",
    "weights_loader",
]

logger = logging.getLogger("asyncwt.worker")

MIN_PART_BYTES = 1 << 20
"""A bucket's elementwise work is split among the apply threads only into parts of
at least this many bytes: below it a thread hand-off costs more than it saves."""

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
    """Per plan parameter: whether its bytes are received straight into `params` (an
    elementwise transform then runs there, in place, once they have arrived)."""
    chunks_land: tuple[bool, ...]
    """Per plan parameter: whether any run of its bytes is transformed (elementwise)
    and copied into its element range of `params` as it arrives (nothing needs the
    whole tensor), instead of being reassembled or handed over whole."""
    commit: Callable[[], None] | None = None
    """Staged only: moves the shadow copy into the model (None when unstaged)."""
    untouched: tuple[str, ...] = ()
    """The model's parameters the plan does not cover, left as they are by every
    round (only with `resolve(..., partial=True)`; always empty for a model with
    `load_weights`, whose names the plan need not share)."""

    @property
    def hands_out_buffers(self) -> bool:
        """Whether user code (the transform, `load_weights`) may be given views of a
        receive buffer (see `LandingTarget`); a staged target gives it the shadow."""
        return self.transform is not None or self.load_weights is not None

    @property
    def device(self) -> torch.device:
        """Where the received parameters go (the first one's device; CPU if none)."""
        first = next(iter(self.params.values()), None)
        return first.device if first is not None else torch.device("cpu")

    @classmethod
    def resolve(
        cls,
        model: torch.nn.Module,
        plan: TransferPlan,
        transform: Transform | None,
        *,
        elementwise: bool = False,
        in_place: bool = True,
        staged: bool = False,
        partial: bool = False,
    ) -> ModelTarget:
        """Match `plan` against `model`; a parameter it cannot take is a `PlanMismatchError`.

        A model with `load_weights` (vLLM's models) takes whatever it accepts, so
        nothing is checked up front; otherwise every plan parameter must exist in
        `named_parameters()` with the same shape, and every parameter of the model
        must be in the plan unless `partial` (then those left out are `untouched`).
        `in_place=False` is for transports whose bytes arrive in their own memory
        (shared memory, collectives).

        `staged=True` allocates the shadow copy now: one extra copy of every plan
        parameter, in the model's dtype and on its device (for a model with
        `load_weights`, in the wire dtype on the CPU, and `transform` and
        `load_weights` then run at commit).

        `elementwise=True` says `transform` may be given any contiguous run of a
        parameter's elements, flat (see `WeightTransferConfig.transform_elementwise`);
        it changes nothing for a model with `load_weights`, which takes whole tensors.
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
        untouched = tuple(name for name in params if name not in live)
        if untouched and not partial:
            raise PlanMismatchError(_uncovered(untouched, len(params)))
        commit = None
        if staged:
            shadow = {
                name: torch.empty(p.shape, dtype=p.dtype, device=p.device)
                for name, p in live.items()
            }

            lane = DeviceLane(next(iter(live.values())).device if live else "cpu")

            def commit() -> None:
                """Copy the shadow into the model, and return once the copies are
                done: the round is published right after, and a reader on any
                stream must then see all of it (see `_settled`)."""
                with torch.no_grad(), _settled(lane):
                    for name, param in live.items():
                        param.data.copy_(shadow[name], non_blocking=True)

            params = shadow
        direct = tuple(
            in_place
            and (transform is None or elementwise)
            and params[meta.name].device.type == "cpu"
            and params[meta.name].dtype == meta.dtype
            and params[meta.name].is_contiguous()
            for meta in plan.params
        )
        chunks_land = tuple(
            (transform is None or elementwise) and _chunks_align(plan, meta, params[meta.name])
            for meta in plan.params
        )
        return cls(model, plan, transform, None, params, direct, chunks_land, commit, untouched)

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


@contextlib.contextmanager
def _settled(lane: DeviceLane) -> Iterator[None]:
    """Run the enclosed device work on `lane`'s stream, after what the calling thread
    queued so far on its current stream, and return only once the device has done
    it (sleeping, not spinning). On the CPU: nothing to order or wait for."""
    stream = lane.stream
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(lane.device))
    try:
        with lane.activate():
            yield
    finally:
        lane.record().synchronize()


def _uncovered(names: tuple[str, ...], total: int) -> str:
    """Why a plan that leaves `names` (of `total` parameters) untouched is refused."""
    shown = ", ".join(repr(n) for n in names[:10])
    more = f" and {len(names) - 10} more" if len(names) > 10 else ""
    return (
        f"the trainer never sends {len(names)} of the worker's {total} parameters "
        f"({shown}{more}): every version would leave them stale. Send them (is the "
        f"trainer's model the worker's?), or opt in to updating part of the model with "
        f"partial=True in the trainer's init info"
    )


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


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes `[start, start + nbytes)` of one slice (counted from the slice's first
    byte): the unit of work that lands elementwise in one call."""

    slice: Slice
    start: int
    nbytes: int


def split_runs(runs: Sequence[tuple[Slice, int]], parts: int) -> list[list[Piece]]:
    """Cut `runs` (slices with their element size) into at most `parts` lists of
    pieces of about equal bytes, in order, cutting only between two elements."""
    total = sum(s.nbytes for s, _ in runs)
    if parts < 1:
        raise ValueError(f"parts should be >= 1, got {parts}")
    out: list[list[Piece]] = [[] for _ in range(parts)]
    placed = 0
    for s, itemsize in runs:
        done = 0
        while done < s.nbytes:
            part = min(parts - 1, placed * parts // total)
            take = s.nbytes - done
            if part < parts - 1:
                room = (part + 1) * total // parts - placed
                take = min(take, max(itemsize, room // itemsize * itemsize))
            out[part].append(Piece(s, done, take))
            done += take
            placed += take
    return [p for p in out if p]


def bucket_parts(
    target: ModelTarget, bucket: Bucket, threads: int, min_part_bytes: int = MIN_PART_BYTES
) -> tuple[list[Slice], list[list[Piece]]]:
    """How the applier divides `bucket`: the slices that need whole-tensor handling
    (reassembly, a whole-tensor transform, `load_weights`), which stay in one job,
    and the elementwise work cut into parts for up to `threads` threads (a direct
    slice is elementwise work only when there is a transform to run in place)."""
    whole: list[Slice] = []
    runs: list[tuple[Slice, int]] = []
    for s in bucket.slices:
        if target.direct[s.param] and target.transform is None:
            continue  # landed where it belongs: nothing left to do
        if target.direct[s.param] or target.chunks_land[s.param]:
            runs.append((s, target.plan.params[s.param].dtype.itemsize))
        else:
            whole.append(s)
    if not runs:
        return whole, []
    nbytes = sum(s.nbytes for s, _ in runs)
    return whole, split_runs(runs, max(1, min(threads, nbytes // max(1, min_part_bytes))))


class _Countdown:
    """Calls `release` once `count` parts have called `done`."""

    def __init__(self, count: int, release: Callable[[], None]) -> None:
        self._left = count
        self._release = release
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._release()


class DeferredApplier:
    """Applies received buckets on `threads` background threads."""

    def __init__(self, threads: int, *, min_part_bytes: int = MIN_PART_BYTES) -> None:
        self._threads = threads
        self._min_part_bytes = min_part_bytes
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix="asyncwt-apply")
        self._lock = threading.Lock()
        self._futures: list[Future[None]] = []
        self._jobs: list[tuple[int, Bucket, TransferPlan]] = []
        """(round, bucket, plan) of each entry of `_futures`, for error messages."""
        self._error: ApplyError | None = None
        self._partial: dict[int, tuple[torch.Tensor, int]] = {}
        """Chunked parameters being reassembled: buffer and bytes received so far."""
        self._spare: dict[tuple[int, torch.device], list[torch.Tensor]] = {}
        """Reassembly buffers free for reuse, by size and device."""
        self._thread = threading.local()
        """Per apply thread: its CUDA stream (see `_on_device`)."""

    @contextlib.contextmanager
    def _on_device(self, device: torch.device) -> Iterator[None]:
        """Run the enclosed apply on this thread's own stream of `device` (a GPU), and
        return only once the device has done it.

        Each apply thread sets its device and keeps a stream of its own, so the
        threads' host-to-device copies run side by side instead of queuing on the
        default stream, and kernels queued by inference on the default stream are
        not waited for. Leaving waits (sleeping, not spinning) for everything queued
        on that stream, a transform's asynchronous copies included: only then may
        the receive buffer be handed back and rewritten. On the CPU: nothing.
        """
        if device.type != "cuda":
            yield
            return
        streams: dict[torch.device, torch.cuda.Stream] = getattr(self._thread, "streams", {})
        stream = streams.get(device)
        if stream is None:
            torch.cuda.set_device(device)
            stream = streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            self._thread.streams = streams
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            wait_for_stream(stream)

    def submit(
        self,
        target: ModelTarget,
        round_id: int,
        bucket: Bucket,
        buffer: torch.Tensor | None,
        release: Callable[[], None],
        prepare: Callable[[], torch.Tensor | None] | None = None,
    ) -> None:
        """Queue `bucket` (received into `buffer`) for applying; `release` frees the buffer.

        The bucket becomes one job per part (`bucket_parts`); `release` runs once,
        after the last of them. With `prepare` (decoding a delta), the bucket is one
        job that first runs `prepare` and applies from the buffer it returns.
        """
        whole, parts = bucket_parts(target, bucket, self._threads, self._min_part_bytes)
        jobs: list[tuple[list[Slice], list[Piece]]] = [(whole, parts[0] if parts else [])]
        jobs += [([], part) for part in parts[1:]]
        if prepare is not None:
            jobs = [(whole, [piece for part in parts for piece in part])]
        countdown = _Countdown(len(jobs), release)
        with self._lock:
            for slices, pieces in jobs:
                future = self._executor.submit(
                    self._apply,
                    target,
                    round_id,
                    bucket,
                    buffer,
                    slices,
                    pieces,
                    countdown.done,
                    prepare,
                )
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
        whole: list[Slice],
        pieces: list[Piece],
        release: Callable[[], None],
        prepare: Callable[[], torch.Tensor | None] | None = None,
    ) -> None:
        where = "?"  # the parameter(s) being worked on, for the error message
        try:
            with self._lock:
                if self._error is not None:
                    return  # the round already failed; don't pile on
            if prepare is not None:
                where = "(decoding the bucket's delta)"
                buffer = prepare()
            device = buffer.device if buffer is not None and buffer.is_cuda else target.device
            with self._on_device(device):
                where = self._apply_on_stream(target, buffer, whole, pieces)
        except BaseException as exc:
            if isinstance(exc, _Failed):
                where, exc = exc.where, exc.cause
            error = ApplyError(
                f"round {round_id}, bucket {bucket.index}: applying parameter {where} failed: "
                f"{type(exc).__name__}: {exc}"
            )
            error.__cause__ = exc
            with self._lock:
                first = self._error is None
                if first:
                    self._error = error
            if first:  # the user's transform or load_weights: its traceback, once a round
                logger.error("%s", error, exc_info=exc)
        finally:
            release()

    def _apply_on_stream(
        self,
        target: ModelTarget,
        buffer: torch.Tensor | None,
        whole: list[Slice],
        pieces: list[Piece],
    ) -> str:
        """Land `pieces` and load `whole` slices; a failure is a `_Failed` naming
        the parameter(s) being worked on."""
        where = "?"
        try:
            for first, rows, stride in _row_groups(target, [_row_slice(target, p) for p in pieces]):
                piece = pieces[first]
                where = repr(target.plan.params[piece.slice.param].name)
                if rows > 1:
                    _land_rows(target, buffer, piece.slice, rows, stride)
                else:
                    _land(target, buffer, piece)
            ready: list[tuple[str, torch.Tensor]] = []
            assembled: list[torch.Tensor] = []
            chunks = [s if s.nbytes != target.plan.params[s.param].nbytes else None for s in whole]
            for first, rows, stride in row_groups(chunks):
                s = whole[first]
                meta = target.plan.params[s.param]
                name, where = meta.name, repr(meta.name)
                assert buffer is not None
                region = buffer[s.offset : s.offset + rows * s.nbytes]
                if s.nbytes == meta.nbytes:
                    ready.append((name, _as_tensor(region, meta.dtype, meta.shape)))
                else:
                    whole_tensor = self._reassemble(
                        s.param, meta.nbytes, s.start, region, rows, stride
                    )
                    if whole_tensor is not None:
                        assembled.append(whole_tensor)
                        ready.append((name, _as_tensor(whole_tensor, meta.dtype, meta.shape)))
            if target.transform is not None:
                transformed = []
                for name, tensor in ready:
                    where = repr(name)
                    transformed.append((name, target.transform(name, tensor)))
                ready = transformed
            if target.load_weights is not None:
                if ready:
                    names = [n for n, _ in ready]
                    where = repr(names[0]) if len(names) == 1 else f"one of {names}"
                    with torch.no_grad():
                        target.load_weights(ready)
            else:
                with torch.no_grad():
                    for name, tensor in ready:
                        where = repr(name)
                        target.params[name].data.copy_(tensor, non_blocking=True)
                self._reuse(assembled)  # copied out: the next round may fill them again
        except BaseException as exc:
            raise _Failed(where, exc) from exc
        return where

    def _reassemble(
        self,
        index: int,
        nbytes: int,
        start: int,
        region: torch.Tensor,
        rows: int = 1,
        stride: int = 0,
    ) -> torch.Tensor | None:
        """Collect a chunked parameter; return it whole once its last byte arrived.

        `region` holds bytes `[start, start + len)` of it, or `rows` rows of equal
        length `stride` bytes apart (`row_groups`), landed in one strided copy. The
        parameter is collected on `region`'s device: a GPU receive buffer's bytes
        stay on the GPU instead of going through host memory and back.
        """
        with self._lock:
            whole, got = self._partial.get(index, (None, 0))
            if whole is None:
                spare = self._spare.get((nbytes, region.device))
                whole = (
                    spare.pop()
                    if spare
                    else torch.empty(nbytes, dtype=torch.uint8, device=region.device)
                )
            self._partial[index] = (whole, got)
        if rows > 1:
            row = region.numel() // rows
            at = whole.storage_offset() + start
            whole.as_strided((rows, row), (stride, 1), at).copy_(region.view(rows, row))
        else:
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
                    self._spare.setdefault((buffer.numel(), buffer.device), []).append(buffer)


class _Failed(Exception):
    """An apply failure, with the parameter(s) it was working on."""

    def __init__(self, where: str, cause: BaseException) -> None:
        super().__init__(where)
        self.where = where
        self.cause = cause


def _land(target: ModelTarget, buffer: torch.Tensor | None, piece: Piece) -> None:
    """Transform `piece`'s elements (if there is a transform) and put them in their
    element range of the parameter.

    A direct slice's bytes are in the parameter already: the transform is given
    them there, and nothing is copied when it returns them (it worked in place).
    """
    s = piece.slice
    meta = target.plan.params[s.param]
    destination = target.chunk_destination(s.param, s.start + piece.start, piece.nbytes)
    if target.direct[s.param]:
        elements = destination
    else:
        assert buffer is not None
        at = s.offset + piece.start
        elements = buffer[at : at + piece.nbytes].view(meta.dtype)
    if target.transform is not None:
        elements = _elementwise(target.transform, meta.name, elements)
    if _same_memory(elements, destination):
        return
    with torch.no_grad():
        destination.copy_(elements.reshape(-1), non_blocking=True)


def _elementwise(transform: Transform, name: str, elements: torch.Tensor) -> torch.Tensor:
    """`transform` run on a flat run of a parameter's elements, checked to return as
    many."""
    given = elements.numel()
    out = transform(name, elements)
    if not isinstance(out, torch.Tensor) or out.numel() != given:
        got = out.numel() if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"an elementwise transform should return a tensor of as many elements as it "
            f"is given ({given}, a run of the parameter's elements), got {got}"
        )
    return out


def _row_slice(target: ModelTarget, piece: Piece) -> Slice | None:
    """`piece`'s slice where it may land as a row of a block (`row_groups`): a whole
    slice of a parameter received into the buffer, not in place."""
    s = piece.slice
    if target.direct[s.param] or piece.start != 0 or piece.nbytes != s.nbytes:
        return None
    return s


def _row_groups(target: ModelTarget, slices: list[Slice | None]) -> list[tuple[int, int, int]]:
    """`row_groups` of `slices`, each run of rows cut back to single slices unless its
    rows and their distance are whole elements of the parameter."""
    out: list[tuple[int, int, int]] = []
    for first, rows, stride in row_groups(slices):
        s = slices[first]
        size = target.plan.params[s.param].dtype.itemsize if s is not None else 1
        if rows == 1 or s is None or (s.start | s.nbytes | stride) % size == 0:
            out.append((first, rows, stride))
        else:
            out.extend((first + r, 1, 0) for r in range(rows))
    return out


def _land_rows(
    target: ModelTarget, buffer: torch.Tensor | None, first: Slice, rows: int, stride: int
) -> None:
    """Transform (if there is a transform) and land `rows` row slices from `first`
    on, back to back in `buffer` and `stride` bytes apart in the parameter (a
    `Shard(1)` block of owner senders), in one strided copy instead of one per row."""
    meta = target.plan.params[first.param]
    size = meta.dtype.itemsize
    flat = target.params[meta.name].data.view(-1)
    run = first.nbytes // size
    at = flat.storage_offset() + first.start // size
    destination = flat.as_strided((rows, run), (stride // size, 1), at)
    assert buffer is not None
    elements = buffer[first.offset : first.offset + rows * first.nbytes].view(meta.dtype)
    if target.transform is not None:
        elements = _elementwise(target.transform, meta.name, elements)
    with torch.no_grad():
        destination.copy_(elements.reshape(rows, run), non_blocking=True)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is `b`'s elements as they are (so copying one into the other is moot)."""
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.numel() == b.numel()
        and a.is_contiguous()
    )


def _as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """View `raw` bytes as a tensor of `dtype` and `shape` (no copy)."""
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).reshape(shape)
