"""The pipelined trainer engine: plan, pipeline and round protocol over any transport.

A backend is not a subclass: it hands the engine a `TransportBackend` (how to
make its `SenderTransport`, what round plans it runs, an optional `Fleet` layer),
and `trainer_engine_class` makes the class users name (`TcpTrainerEngine`) from
it. The rest is here, written once.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, ClassVar, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import torch
from typing_extensions import Self

from .._core.concurrency import single_error
from .._core.device import resolve_device
from .._core.errors import ControlPlaneError
from .._core.lanes import DeviceLane, LaneEvent
from .._core.protocol import AnyWeightSyncClient, call_client, round_keywords
from .._core.round_plan import (
    RoundChoices,
    RoundPlan,
    SendersKind,
    check_choices,
    with_receiver_layouts,
)
from .._core.settings import PipelineSettings
from .._core.source import WeightSource
from .._core.stats import Progress, RoundStats
from .._core.trainer_api import TrainerInitInfo, TrainerWeightTransferEngine
from .._transports.backend import Fleet, TransportBackend, bound_class
from .._transports.base import SenderTransport
from .calls import bounded_call, round_failed
from .owners import OwnerRanks
from .pipeline import PipelineConfig, StagingPool, iterate_and_check, run_pipeline
from .senders import RankZero, SenderSide, sender_layers, share_round

__all__ = ["SENDER_SIDES", "PipelinedTrainerEngine", "trainer_engine_class"]

SENDER_SIDES: dict[SendersKind, type[SenderSide]] = {"rank0": RankZero, "owners": OwnerRanks}
"""What the engine is handed for each kind of senders a round plan has."""

logger = logging.getLogger("asyncwt")

TInfo = TypeVar("TInfo", bound=TrainerInitInfo)


def _paused_s(client: object) -> float | None:
    """How long `client` kept generation paused in the round it just ran, if it says."""
    paused = getattr(client, "paused_s", None)
    return paused if isinstance(paused, float) else None


class PipelinedTrainerEngine(TrainerWeightTransferEngine[TInfo]):
    """Trainer engine that streams full tensors from rank 0 through the pipeline.

    Every rank builds the same plan from `source.metadata`. Rank 0 owns the
    transport; every round it calls `start_weight_update`, then runs
    `update_weights` concurrently with the pipeline (iterate → pack → send), then
    `finish_weight_update(weight_version)`. Other ranks iterate the source so that
    their collectives (FSDP all-gathers) line up with rank 0's, and send nothing.
    """

    init_info_cls: ClassVar[type[TrainerInitInfo]]
    backend: ClassVar[TransportBackend]
    """The transport this class runs over (see `trainer_engine_class`)."""

    def __init__(
        self,
        info: Any,
        *,
        client: AnyWeightSyncClient,
        side: SenderSide,
        device: torch.device,
    ) -> None:
        source = side.source
        super().__init__(client=client, source=source, is_sender=info.is_sender, rank=info.rank)
        settings: PipelineSettings = info
        self.info = info
        self.round_plan: RoundPlan = side.round_plan
        """The round as data, built at init: who sends what to whom, how."""
        self.plan = plan = side.plan
        """What this rank's pipeline and transport carry."""
        self.source: WeightSource = source
        self.device = device
        """Where lanes and staging live: `settings.device` resolved once, with its index."""
        self._iterate_lane = DeviceLane(device)
        self._pack_lane = DeviceLane(device)
        self._pool = StagingPool(settings.num_buffers, settings.bucket_bytes, device)
        self._pipeline = PipelineConfig(
            num_buffers=settings.num_buffers,
            zero_copy=settings.tuning.zero_copy,
            read_ahead=settings.tuning.read_ahead,
        )
        owned = set(source.owned_names(info.rank))
        self._expected = [i for i, m in enumerate(plan.params) if m.name in owned]
        self.transport: SenderTransport | None = None
        self.trainer_id = secrets.token_hex(16)
        """This engine's id, sent to the workers at init and with every round: a worker
        refuses rounds of any other trainer (a stale one, or a stranger)."""
        self.fleet: Fleet | None = None
        """The backend's layer tracking workers one by one, where it has one."""
        self._rounds = 0
        self._busy = False
        self._closed = False

    @classmethod
    async def trainer_init(
        cls,
        init_info: TInfo,
        *,
        client: AnyWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        """Plan from `source.metadata`; on rank 0, open the transport and init the workers.

        The device (`init_info.device`, else the source's) is resolved here, in the
        calling thread: a bare `"cuda"` is this thread's current CUDA device.

        Cancellation: everything the transport opened is closed; no engine results.
        """
        backend = getattr(cls, "backend", None)
        if backend is None:
            raise TypeError(
                f"{cls.__name__} has no backend: make the engine class of one with "
                f"trainer_engine_class(backend), or use asyncwt.trainer_init"
            )
        if not isinstance(init_info, cls.init_info_cls):
            raise TypeError(
                f"init_info should be a {cls.init_info_cls.__name__}, got {type(init_info).__name__}"
            )
        settings: PipelineSettings = init_info  # type: ignore[assignment]
        choices = settings.round_choices()
        check_choices(choices, backend.features, init_info.backend)
        side = SENDER_SIDES[choices.senders].build(init_info, source, choices)
        device = resolve_device(settings.device, side.source)
        fleet = backend.open_fleet(init_info, client, source) if init_info.is_sender else None
        engine = None
        try:
            engine = cls(
                init_info,
                client=fleet.client if fleet is not None else client,
                side=side,
                device=device,
            )
            engine.fleet = fleet
            if side.opens_transport(init_info.is_sender):
                engine.transport = await engine._open_transport(side, choices)
                # The needs, as declared: every sending rank (rank 0, or each owner rank)
                # read them on its own links, and records them in its links' order.
                layouts = engine.transport.receiver_layouts()
                if layouts is not None:
                    engine.round_plan = with_receiver_layouts(engine.round_plan, layouts)
                if fleet is not None:
                    fleet.attach(engine.transport)
        except BaseException:
            if engine is not None and engine.transport is not None:
                engine.transport.close()
            if fleet is not None:
                with anyio.CancelScope(shield=True):
                    await fleet.close()
            raise
        return engine

    async def _open_transport(self, side: SenderSide, choices: RoundChoices) -> SenderTransport:
        """Open this rank's transport (the backend's sender in the layers the plan's
        choices ask for, see `sender_layers`) and init the workers through it."""
        info, backend = self.info, self.backend
        client = self.client

        async def init_all(fields: dict[str, Any]) -> None:
            await bounded_call(
                client,
                "init_weight_transfer_engine",
                fields,
                timeout=info.timeouts.rpc,
                where="trainer_init",
            )

        def make_transport() -> SenderTransport:
            transport = backend.sender(info, self.plan, self.device)
            try:  # the plan's layers around the backend's sender
                for layer in sender_layers(choices, info, side):
                    transport = layer(transport)
            except BaseException:
                transport.close()  # the backend's listener would outlive the init
                raise
            return transport

        return await side.open(
            make_transport, self.prepare_staging, self.worker_init_fields(), init_all
        )

    def prepare_staging(self, transport: SenderTransport) -> None:
        """Allocate (and pin, or register) what rounds pack into, now, in the calling
        thread (a worker thread at init): the transport's own buffers, and on a GPU
        the pool, unless the transport stages every slot itself. A first round
        would otherwise pay for it, on the event loop. A CPU trainer's pool stays
        allocated on first use (scatter-gather sends may never need it)."""
        transport.prepare()
        if self.device.type == "cuda" and not transport.own_staging:
            self._pool.allocate()

    @property
    def num_workers(self) -> int:
        """Workers this (sender) engine reaches; 0 on other ranks."""
        return self.transport.num_workers if self.transport is not None else 0

    def fence(self) -> LaneEvent:
        """Mark the work the calling thread has queued on its current stream (the
        optimizer step, say): a round started with this fence reads the weights only
        after it. `send_weights` takes it itself; a caller that runs the round from
        another thread (the blocking façade) takes it in the training thread."""
        return self._iterate_lane.record_caller()

    def join_caller(self) -> None:
        """Make later work on the calling thread's current stream wait (on the
        device) for everything this engine's lanes enqueued: a rank's collectives and
        copies of a round are over before its next training step touches the weights.
        `send_weights` does it itself; a caller that runs the round from another
        thread (the blocking façade) does it in the training thread."""
        self._iterate_lane.join_caller()
        self._pack_lane.join_caller()

    async def send_weights(  # type: ignore[override]
        self,
        *,
        weight_version: str | None = None,
        after: LaneEvent | None = None,
        join: bool = True,
        progress: Progress | None = None,
    ) -> RoundStats:
        """Run one round and return its stats; call it on every trainer rank.

        `progress(sent_bytes, total_bytes)`, where given, is called after each bucket
        went to the transport, on the event loop (keep it quick: log, move a bar): a
        long round (a 70B model over TCP) shows it is moving. `total_bytes` is this
        rank's payload for the round; the round ends after the workers applied it.

        Every rank first waits (on the device, not the host) for the work queued on
        the calling thread's current stream, or for `after` (see `fence`): the
        weights read are those of the step that came before the call. And every
        rank ends the round, failed or not, with that stream waiting (on the device)
        for the work the round queued on asyncwt's lanes (`join_caller`; `join=False`
        leaves that to the caller): a rank other than 0 returns as soon as it has
        queued its collectives, which may still be reading the weights.

        Every wait is bounded (see `PipelineSettings`): a dead or stalled worker ends
        the round with a `TransferError` (`TransferTimeoutError` for a timeout) or a
        `ControlPlaneError` (a worker's error, or an RPC past `timeouts.rpc`), whose
        message names the round and says whether a new `trainer_init` is needed.

        Cancellation: the round is aborted on every worker (their `update_weights`
        fails, no version is published), staging slots are released, and the
        iterate thread stops at its next tensor; the next round starts clean. If
        `start_weight_update` had not returned yet (the first gathers run during
        it), there is nothing to abort: no `update_weights` was issued. A
        bucket already being written finishes first (bounded by `timeouts.send`). A
        cancellation during `finish_weight_update` cannot be taken back: the
        workers may still publish the round, which arrived completely.
        """
        fence = after if after is not None else self.fence()

        async def attempt(fence: LaneEvent) -> RoundStats:
            return await self._round(weight_version, fence, join=join, progress=progress)

        if self.fleet is not None:  # the fleet decides what a failed try means
            return await self.fleet.run_round(attempt, fence)
        return await attempt(fence)

    async def _round(
        self,
        weight_version: str | None,
        fence: LaneEvent,
        *,
        join: bool,
        progress: Progress | None,
    ) -> RoundStats:
        """One try of a round (see `send_weights`)."""
        if self._closed:
            raise RuntimeError("send_weights called after shutdown()")
        if self._busy:
            raise RuntimeError(
                "send_weights is already running on this engine; rounds cannot overlap"
            )
        self._busy = True
        self._rounds += 1
        round_id = self._rounds
        started = time.perf_counter()
        try:
            if self.transport is None:
                t0 = time.perf_counter()
                await anyio.to_thread.run_sync(
                    iterate_and_check,
                    self.plan,
                    self._expected,
                    self.source,
                    self._iterate_lane,
                    fence,
                )
                busy = {"iterate": time.perf_counter() - t0}
                return self._stats(round_id, weight_version, started, busy, sent=False)
            self.transport.check_usable()
            if self.is_sender:
                try:
                    busy = await self._sender_round(
                        self.transport, round_id, weight_version, fence, progress
                    )
                except BaseException:
                    await round_failed(self.client, self.info.timeouts.rpc)
                    raise
            else:  # a rank sending its share of the round over its own links
                transport = self.transport
                busy = await share_round(
                    transport,
                    round_id,
                    self.rank,
                    lambda opened: self.stream(transport, fence, opened, progress),
                )
            return self._stats(round_id, weight_version, started, busy, sent=True)
        finally:
            self._busy = False
            if join:
                self.join_caller()

    async def _sender_round(
        self,
        transport: SenderTransport,
        round_id: int,
        weight_version: str | None,
        fence: LaneEvent,
        progress: Progress | None = None,
    ) -> dict[str, float]:
        """Open the round while the first tensors are gathered, stream, finish.

        `start_weight_update` and the transport's round opening (every worker
        READY) run concurrently with the pipeline's iterate stage, which may gather
        a few buckets ahead; nothing is packed or sent until the round is open.
        """
        rpc_timeout = self.info.timeouts.rpc
        where = f"round {round_id}"
        update_info = {
            "round_id": round_id,
            "plan_digest": self.round_plan.round_digest,
            "trainer_id": self.trainer_id,
        }
        # The round's ids go to start and finish both, or to neither: a round started
        # with its ids can only be closed by a finish naming them.
        ids = {"round_id": round_id, "trainer_id": self.trainer_id}
        start_ids = round_keywords(self.client, "start_weight_update", **ids)
        finish_ids = round_keywords(self.client, "finish_weight_update", **ids)
        if start_ids != ids or finish_ids != ids:
            start_ids = finish_ids = {}
        failed = False
        update_started = False
        update_done = anyio.Event()
        opened = anyio.Event()
        busy: dict[str, float] = {}

        async def update_rpc() -> None:
            try:
                await call_client(self.client, "update_weights", update_info)
            except Exception as exc:
                if not failed:
                    raise
                logger.debug("round %d: update_weights failed after the abort: %r", round_id, exc)
            finally:
                update_done.set()

        async def open_round(tg: anyio.abc.TaskGroup) -> None:
            nonlocal update_started
            await bounded_call(
                self.client, "start_weight_update", timeout=rpc_timeout, where=where, **start_ids
            )
            tg.start_soon(update_rpc)
            update_started = True
            await transport.begin_round(round_id)
            opened.set()

        with single_error():
            async with anyio.create_task_group() as tg:
                try:
                    with single_error():
                        async with anyio.create_task_group() as stream:
                            stream.start_soon(open_round, tg)
                            busy = await self.stream(transport, fence, opened, progress)
                    await transport.end_round()
                except BaseException as exc:
                    failed = True
                    if update_started:
                        with anyio.CancelScope(shield=True):
                            await transport.abort_round(f"{type(exc).__name__}: {exc}")
                        if not isinstance(exc, anyio.get_cancelled_exc_class()):
                            # Let the workers acknowledge the abort (their update_weights
                            # returns), but no longer than rpc_timeout: the RPC is then
                            # abandoned by the task group (a sync client's thread included).
                            with anyio.move_on_after(rpc_timeout):
                                await update_done.wait()
                    raise
                with anyio.move_on_after(rpc_timeout) as scope:
                    await update_done.wait()
                if scope.cancelled_caught:
                    failed = True
                    raise ControlPlaneError(
                        f"round {round_id}: every bucket was sent but update_weights did not "
                        f"return within timeouts.rpc={rpc_timeout}s (a worker stalled, or its "
                        f"control plane is unreachable); nothing was published. Check the "
                        f"workers, then send again (or trainer_init again if the data plane "
                        f"broke)"
                    )
        await bounded_call(
            self.client,
            "finish_weight_update",
            weight_version,
            timeout=rpc_timeout,
            where=where,
            **finish_ids,
        )
        return busy

    def worker_init_fields(self) -> dict[str, Any]:
        """What every worker's `init_weight_transfer_engine` gets from this engine: its
        plan, the backend's worker fields, the trainer's id and, for an `AdapterSource`,
        the adapter's config (the transport adds the rest: where to connect, a
        member's number)."""
        fields = {
            "plan": self.plan.to_wire(),
            **self.info.worker_fields(),
            "trainer_id": self.trainer_id,
        }
        adapter = self.source.adapter_config()
        if adapter is not None:
            fields["adapter"] = adapter
        return fields

    async def stream(
        self,
        transport: SenderTransport,
        fence: LaneEvent,
        opened: anyio.Event,
        progress: Progress | None = None,
    ) -> dict[str, float]:
        """This rank's pipeline over its plan into `transport` (see `run_pipeline`)."""
        return await run_pipeline(
            self.plan,
            self.source,
            transport,
            pool=self._pool,
            iterate_lane=self._iterate_lane,
            pack_lane=self._pack_lane,
            config=self._pipeline,
            fence=fence,
            opened=opened,
            progress=progress,
        )

    def _stats(
        self,
        round_id: int,
        weight_version: str | None,
        started: float,
        busy: dict[str, float],
        *,
        sent: bool,
    ) -> RoundStats:
        stats = RoundStats(
            round_id=round_id,
            weight_version=weight_version,
            bytes=self.plan.total_bytes if sent else 0,
            wire_bytes=self._wire_bytes() if sent else 0,
            buckets=len(self.plan.buckets) if sent else 0,
            workers=self.num_workers if sent else 0,
            wall_s=time.perf_counter() - started,
            stage_busy_s=busy,
            total_bytes=self._total_bytes() if sent else None,
            paused_s=_paused_s(self.client) if sent else None,
        )
        logger.info("asyncwt rank %d: %s", self.rank, stats.summary())
        return stats

    def _wire_bytes(self) -> int:
        reported = self.transport.round_wire_bytes if self.transport is not None else None
        return reported if reported is not None else self.plan.total_bytes

    def _total_bytes(self) -> int | None:
        """Bytes of a round from every rank together, where several ranks send."""
        return self.round_plan.total_bytes if self.round_plan.layout is not None else None

    async def add_workers(self, client: AnyWeightSyncClient) -> int:
        """Admit the workers `client` reaches, which were not there at `trainer_init`
        (a new engine, or one restarted); they receive the full weights from the next
        round on while the others carry on. Returns how many connected.

        Needs a backend that tracks workers one by one (tcp with `fanout=Chain()` or
        `on_worker_failure="drop"`) and no round running. Cancellation or failure:
        nothing is admitted.
        """
        if self.fleet is None:
            raise ValueError(
                "add_workers needs a tracked fleet: fanout=Chain() or "
                f"on_worker_failure='drop' on the tcp backend (got backend "
                f"{self.info.backend!r}, route={self.round_plan.route!r}, "
                f"on_worker_failure={self.round_plan.on_worker_failure!r})"
            )
        if self._busy:
            raise RuntimeError("add_workers called while a round runs; call it between rounds")
        return await self.fleet.add_workers(
            client, self.worker_init_fields(), self.info.timeouts.rpc
        )

    async def shutdown(self) -> None:
        """Close the transport, once the lanes are past what a round queued on them
        (a cancelled round may have left copies into the transport's buffers queued).
        Idempotent.

        Cancellation: the lanes' wait is shielded (it ends with the queued work);
        the transport and the fleet layer are closed either way.
        """
        self._closed = True
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.drain_lanes)
        finally:
            if self.transport is not None:
                self.transport.close()
            if self.fleet is not None:
                with anyio.CancelScope(shield=True):
                    await self.fleet.close()

    def drain_lanes(self) -> None:
        """Sleep until this engine's lanes have run their queued work: only those
        (a full-device sync would also wait for the trainer's own kernels)."""
        self._iterate_lane.drain()
        self._pack_lane.drain()


def trainer_engine_class(
    backend: TransportBackend, *, name: str, module: str
) -> type[PipelinedTrainerEngine[Any]]:
    """The trainer engine class of `backend` that users name (`name`, in `module`):
    `PipelinedTrainerEngine` bound to the backend, with no code of its own."""
    return bound_class(
        PipelinedTrainerEngine,
        backend,
        init_info_cls=backend.trainer_info,
        name=name,
        module=module,
    )
