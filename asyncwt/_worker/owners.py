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
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .._core.owners import MAX_SENDERS, OwnersLayout, full_slices
from .._core.plan import Bucket, TransferPlan
from .._transports.base import ReceivedBucket, ReceiverTransport

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
    """Receives a round from every trainer rank at once; yields full-plan buckets."""

    lands_in_place = False

    def __init__(self, layout: OwnersLayout, receivers: list[ReceiverTransport]) -> None:
        self.layout = layout
        self.receivers = receivers

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
        """A share bucket as a bucket of the full plan (same buffer, same release)."""
        pieces = self.layout.pieces[rank]
        params = self.layout.plan.params
        slices = []
        for s in received.bucket.slices:
            piece = pieces[s.param]
            slices.extend(full_slices(piece, params[piece.param], s, piece.param))
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

        shares = [
            _InBuffers(len(p.params), target.hands_out_buffers) for p in self.layout.share_plans
        ]

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
) -> tuple[OwnersReceiver, TransferPlan]:
    """The receiver for an init with owner senders, and the plan rounds name.

    `parse(fields)` checks one rank's endpoint fields (its share plan included) with
    the backend's own init info class; `make_receiver(rank_info, share_plan)` builds
    that rank's receiver. Validates the layout (its digest included: it covers every rank's share plan)
    and every rank's endpoint fields before anything is allocated or connected.
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
    receivers = [
        make_receiver(rank_info, layout.share_plans[rank])
        for rank, rank_info in enumerate(rank_infos)
    ]
    return OwnersReceiver(layout, receivers), dataclasses.replace(layout.plan, digest=layout.digest)
