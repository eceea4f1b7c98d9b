"""Owner senders on the worker: one receiver per trainer rank, shards landed in place.

With `senders="owners"` the init info carries the ownership layout and every
rank's endpoint. The worker rebuilds the `OwnersLayout` (and checks its digest),
builds the backend's own receiver for each rank's share plan (each with its own
bounded receive buffers), connects to every rank, and each round receives from
all of them at once, one thread per rank. Every share bucket is handed to the
applier as a bucket of the full plan: each piece's bytes become the contiguous
runs of the full parameter they belong to (`full_slices`), which the applier lands
or reassembles as it does a chunked parameter. `update_weights` returns once every
rank's END arrived, so `finish_weight_update` publishes only after every rank's
share was applied.

A sliced receiver (`slices`) declares the boxes its model holds on every rank's
link (the same declaration, over the full plan) and receives from each rank only
the bytes of its pieces inside those boxes: each rank's receiver plan is `select`'s
(`asyncwt._core.slices`), as the rank derives it, and its buckets land in the
worker's local tensors (its landing plan: what the worker holds of the full plan).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from .._core.owners import MAX_SENDERS, Box, OwnersLayout, full_slices
from .._core.plan import Bucket, Slice, TransferPlan
from .._core.slices import select, wants_of
from .._transports.base import ReceivedBucket, ReceiverTransport
from .slices import select_boxes

__all__ = ["OwnersReceiver", "owners_receiver"]

logger = logging.getLogger("asyncwt")


class _InBuffers:
    """A landing target that takes nothing in place: share buckets land in buffers
    (which user code is given where the model's target hands out buffers)."""

    def __init__(self, count: int, hands_out_buffers: bool) -> None:
        self.direct: Sequence[bool] = (False,) * count
        self.hands_out_buffers = hands_out_buffers

    def landing_view(self, index: int) -> memoryview:
        raise AssertionError("share buckets never land in place")


class OwnersReceiver(ReceiverTransport):
    """Receives a round from every trainer rank at once; yields buckets of the plan
    rounds land by (the full plan, or a sliced receiver's local tensors)."""

    lands_in_place = False

    def __init__(
        self,
        plans: Sequence[TransferPlan],
        receivers: list[ReceiverTransport],
        landing: Sequence[Callable[[Slice], Iterable[Slice]]],
    ) -> None:
        self.plans = plans
        """Per rank, the plan its receiver receives."""
        self.receivers = receivers
        self.landing = landing
        """Per rank: a slice of its plan as slices of the plan rounds land by."""

    @classmethod
    def of_shares(cls, layout: OwnersLayout, receivers: list[ReceiverTransport]) -> OwnersReceiver:
        """Receives each rank's share plan whole, landed in the full plan's parameters."""
        lands = [_to_full(layout, rank) for rank in range(layout.world_size)]
        return cls(layout.share_plans, receivers, lands)

    def connect(self) -> None:
        try:
            for receiver in self.receivers:
                receiver.connect()
        except BaseException:
            self.close()
            raise

    @property
    def usable(self) -> bool:
        return all(r.usable for r in self.receivers)

    def _translate(self, rank: int, received: ReceivedBucket) -> ReceivedBucket:
        """A bucket of `rank`'s plan as one of the landing plan (same buffer, same release)."""
        land = self.landing[rank]
        slices = [out for s in received.bucket.slices for out in land(s)]
        bucket = Bucket(
            received.bucket.index,
            tuple(slices),
            received.bucket.buffer_bytes,
            received.bucket.payload_bytes,
        )
        return ReceivedBucket(bucket, received.buffer, received.release)

    def receive_round(self, round_id: int, target: Any) -> Iterator[ReceivedBucket]:
        """Yield every rank's buckets as they arrive; return after every rank's END.

        A failure on one rank's link is raised once every other rank's round ended
        too (each is bounded by `recv_timeout`): no receive thread outlives the call.
        """
        inbox: queue.SimpleQueue[tuple[int, ReceivedBucket | BaseException | None]] = (
            queue.SimpleQueue()
        )

        shares = [_InBuffers(len(p.params), target.hands_out_buffers) for p in self.plans]

        def pump(rank: int, receiver: ReceiverTransport) -> None:
            try:
                for received in receiver.receive_round(round_id, shares[rank]):
                    inbox.put((rank, self._translate(rank, received)))
            except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
                inbox.put((rank, exc))
            else:
                inbox.put((rank, None))

        threads = [
            threading.Thread(
                target=pump, args=(rank, rx), name=f"asyncwt-owner-rx{rank}", daemon=True
            )
            for rank, rx in enumerate(self.receivers)
        ]
        for thread in threads:
            thread.start()
        pending = len(threads)
        error: BaseException | None = None
        try:
            while pending:
                rank, item = inbox.get()
                if isinstance(item, ReceivedBucket):
                    if error is None:
                        yield item
                    else:
                        item.release()
                    continue
                pending -= 1
                if item is not None and error is None:
                    error = item
                    logger.debug("round %d: rank %d's share failed: %r", round_id, rank, item)
        finally:
            while pending:  # the consumer stopped early: let every thread finish
                rank, item = inbox.get()
                if isinstance(item, ReceivedBucket):
                    item.release()
                else:
                    pending -= 1
            for thread in threads:
                thread.join()
        if error is not None:
            raise error

    def close(self) -> None:
        for receiver in self.receivers:
            receiver.close()


def owners_receiver(
    info: Any,
    parse: Callable[[dict[str, Any]], Any],
    make_receiver: Callable[[Any, TransferPlan], ReceiverTransport],
    boxes: Sequence[Box] | None = None,
) -> tuple[OwnersReceiver, TransferPlan]:
    """The receiver for an init with owner senders, and the plan rounds name and land by.

    `parse(fields)` checks one rank's endpoint fields (its share plan included) with
    the backend's own init info class; `make_receiver(rank_info, plan)` builds that
    rank's receiver of `plan` (its share plan, or with `boxes`, the box this worker
    holds of each parameter of the full plan, what it receives of it: see the module
    docstring). Validates the layout (its digest included: it covers every rank's
    share plan) and every rank's endpoint fields before anything is allocated or
    connected.
    """
    plan: TransferPlan = info.transfer_plan
    owners = info.owners
    layout = OwnersLayout.from_wire(plan, owners)
    senders = owners.get("senders")
    if not isinstance(senders, list) or len(senders) != layout.world_size:
        got = len(senders) if isinstance(senders, list) else type(senders).__name__
        raise ValueError(
            f"owners.senders should list the {layout.world_size} trainer ranks' endpoints, "
            f"got {got}"
        )
    assert layout.world_size <= MAX_SENDERS
    for rank, fields in enumerate(senders):
        if not isinstance(fields, dict) or "owners" in fields or "plan" in fields:
            raise ValueError(
                f"owners.senders[{rank}] should be a dict of one rank's endpoint (without "
                f"'plan' or 'owners': its share plan is derived from the layout)"
            )
    # Each rank's share plan as derived here (the layout's digest covers it).
    rank_infos = [
        parse({**fields, "plan": layout.share_plans[rank].to_wire()})
        for rank, fields in enumerate(senders)
    ]
    if boxes is None:
        landing = dataclasses.replace(layout.plan, digest=layout.digest)
        plans = layout.share_plans
    else:
        landing = dataclasses.replace(select_boxes(plan, boxes).plan, digest=layout.digest)
        plans = tuple(_sliced(layout, rank, boxes) for rank in range(layout.world_size))
    receivers: list[ReceiverTransport] = []
    try:
        for rank_info, rank_plan in zip(rank_infos, plans):
            receivers.append(make_receiver(rank_info, rank_plan))
    except BaseException:
        for receiver in receivers:
            receiver.close()
        raise
    if boxes is None:
        return OwnersReceiver.of_shares(layout, receivers), landing
    return OwnersReceiver(plans, receivers, [_to_local(landing, p) for p in plans]), landing


def _to_full(layout: OwnersLayout, rank: int) -> Callable[[Slice], Iterable[Slice]]:
    """A slice of `rank`'s share plan as runs of the full parameters its piece is of."""
    pieces, params = layout.pieces[rank], layout.plan.params

    def land(s: Slice) -> Iterable[Slice]:
        piece = pieces[s.param]
        return full_slices(piece, params[piece.param], s, piece.param)

    return land


def _sliced(layout: OwnersLayout, rank: int, boxes: Sequence[Box]) -> TransferPlan:
    """What a worker holding `boxes` (of the full plan) receives of `rank`'s share: its
    plan of local tensors, named as the share (as the rank names its links)."""
    share = layout.share_plans[rank]
    held = [piece.box for piece in layout.pieces[rank]]
    wants = wants_of(layout.plan, boxes, share)
    return select(share, held, wants, digest=share.digest).plan


def _to_local(landing: TransferPlan, plan: TransferPlan) -> Callable[[Slice], Iterable[Slice]]:
    """A slice of `plan` (a rank's sliced plan) as the same bytes of the same local
    tensor in `landing` (the worker's plan of every local tensor), by name."""
    index = {meta.name: i for i, meta in enumerate(landing.params)}
    to = [index[meta.name] for meta in plan.params]

    def land(s: Slice) -> Iterable[Slice]:
        return (Slice(to[s.param], s.start, s.nbytes, s.offset),)

    return land
