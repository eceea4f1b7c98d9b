"""The `"tcp"` backend, trainer side: listen, authenticate workers, stream rounds."""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from ._client import AnyWeightSyncClient, call_client
from ._concurrency import single_error
from ._exceptions import (
    AsyncwtError,
    ProtocolError,
    TransferError,
    TransferTimeoutError,
)
from ._lanes import DeviceLane
from ._pipeline import PipelineConfig, StagingPool, iterate_and_check, run_pipeline
from ._plan import Bucket, TransferPlan
from ._sockio import async_recv_exact, async_send_segments
from ._source import WeightSource
from ._stats import RoundStats
from ._tcp_info import TcpTrainerInitInfo
from ._trainer import TrainerWeightTransferEngine
from ._wire import (
    ABORT_REASON_MAX,
    FRAME_SIZE,
    HELLO_SIZE,
    PROOF_SIZE,
    Frame,
    FrameKind,
    HandshakeStatus,
    digest_prefix,
    pack_challenge,
    pack_result,
    proof_is_valid,
    unpack_hello,
)

__all__ = ["TcpTrainerEngine"]

logger = logging.getLogger("asyncwt")


def _default_device(name: str | None) -> torch.device:
    if name is not None:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(eq=False)
class _Peer:
    """One authenticated worker connection."""

    sock: socket.socket
    address: str
    broken: str | None = None

    def close(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self.sock.close()


class _Fanout:
    """Sends each frame to every worker at once; a bucket is done when all have it."""

    def __init__(self, peers: list[_Peer], plan: TransferPlan, info: TcpTrainerInitInfo) -> None:
        self.peers = peers
        self.plan = plan
        self.info = info
        self.digest = digest_prefix(plan.digest)
        self.round_id = 0

    def check_usable(self) -> None:
        for peer in self.peers:
            if peer.broken is not None:
                raise TransferError(
                    f"the connection to worker {peer.address} is closed ({peer.broken}); "
                    f"call trainer_init again to reconnect"
                )

    async def _each(self, fn: Any, *args: Any) -> None:
        with single_error():
            async with anyio.create_task_group() as tg:
                for peer in self.peers:
                    tg.start_soon(fn, peer, *args)

    async def _send_frame(self, peer: _Peer, segments: list[memoryview], what: str) -> None:
        """Send one whole frame, or break the connection: never leave it mid-frame.

        Shielded from cancellation (a half-sent frame would desynchronise the
        stream), bounded by `send_timeout` instead.
        """
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(self.info.send_timeout):
                    await async_send_segments(peer.sock, segments)
            except TimeoutError:
                peer.close(f"timed out sending {what}")
                raise TransferTimeoutError(
                    f"round {self.round_id}: worker {peer.address} did not take {what} within "
                    f"send_timeout={self.info.send_timeout}s"
                ) from None
            except TransferError as exc:
                peer.close(str(exc))
                raise TransferError(
                    f"round {self.round_id}: sending {what} to worker {peer.address} failed: {exc}"
                ) from exc

    async def wait_ready(self, round_id: int) -> None:
        """Wait for every worker's READY for `round_id` (stale READYs are skipped)."""
        self.round_id = round_id
        await self._each(self._wait_ready_one, round_id)

    async def _wait_ready_one(self, peer: _Peer, round_id: int) -> None:
        try:
            with anyio.fail_after(self.info.ready_timeout):
                while True:
                    frame = Frame.unpack(await async_recv_exact(peer.sock, FRAME_SIZE))
                    if frame.kind != FrameKind.READY or frame.round_id > round_id:
                        raise ProtocolError(
                            f"worker {peer.address} sent {frame.kind.name} for round "
                            f"{frame.round_id} while the trainer waited for READY {round_id}"
                        )
                    if frame.round_id == round_id:
                        if frame.digest != self.digest:
                            raise ProtocolError(f"worker {peer.address} is READY for another plan")
                        return
        except TimeoutError:
            peer.close("did not start receiving")
            raise TransferTimeoutError(
                f"round {round_id}: worker {peer.address} did not start receiving within "
                f"ready_timeout={self.info.ready_timeout}s"
            ) from None
        except TransferError as exc:
            peer.close(str(exc))
            raise

    async def send_bucket(self, bucket: Bucket, segments: list[memoryview]) -> None:
        header = Frame(FrameKind.BUCKET, self.round_id, bucket.index, self.digest, bucket.payload_bytes)
        frame = [memoryview(header.pack()), *segments]
        await self._each(self._send_frame_copy, frame, f"bucket {bucket.index}")

    async def _send_frame_copy(self, peer: _Peer, frame: list[memoryview], what: str) -> None:
        await self._send_frame(peer, list(frame), what)

    async def end_round(self) -> None:
        header = Frame(FrameKind.END, self.round_id, len(self.plan.buckets), self.digest, 0)
        await self._each(self._send_frame_copy, [memoryview(header.pack())], "the end of the round")

    async def abort_round(self, reason: str) -> None:
        """Tell every worker the round is off; errors here are logged, not raised."""
        text = reason.encode("utf-8", "replace")[:ABORT_REASON_MAX]
        header = Frame(FrameKind.ABORT, self.round_id, 0, self.digest, len(text))
        for peer in self.peers:
            if peer.broken is not None:
                continue
            try:
                await self._send_frame(peer, [memoryview(header.pack()), memoryview(text)], "abort")
            except AsyncwtError as exc:
                logger.warning("could not abort round %d on %s: %s", self.round_id, peer.address, exc)

    def close(self) -> None:
        for peer in self.peers:
            peer.close("engine shut down")


class TcpTrainerEngine(TrainerWeightTransferEngine[TcpTrainerInitInfo]):
    """Trainer engine of the `"tcp"` backend.

    Rank 0 listens during `trainer_init` only; each worker connects and proves the
    token while its `init_weight_transfer_engine` call runs. Each round, every worker
    receives every bucket over its own connection, all concurrently.
    """

    init_info_cls = TcpTrainerInitInfo

    def __init__(
        self,
        info: TcpTrainerInitInfo,
        *,
        client: AnyWeightSyncClient,
        source: WeightSource,
        plan: TransferPlan,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender, rank=info.rank)
        self.info = info
        self.plan = plan
        self.source: WeightSource = source
        device = _default_device(info.device)
        self._iterate_lane = DeviceLane(device)
        self._pack_lane = DeviceLane(device)
        self._pool = StagingPool(info.num_buffers, info.bucket_bytes, device)
        self._pipeline = PipelineConfig(num_buffers=info.num_buffers, zero_copy=info.zero_copy)
        names = set(source.owned_names(info.rank))
        self._expected = [i for i, m in enumerate(plan.params) if m.name in names]
        self._fanout: _Fanout | None = None
        self._rounds = 0
        self._busy = False
        self._closed = False

    @classmethod
    async def trainer_init(
        cls,
        init_info: TcpTrainerInitInfo,
        *,
        client: AnyWeightSyncClient,
        source: WeightSource | None = None,
    ) -> TcpTrainerEngine:
        """Plan from `source.metadata`; on rank 0, listen and initialise the workers.

        Cancellation: the listener and every accepted connection are closed.
        """
        if source is None or not source.implements_iter_full():
            raise ValueError(
                f"source should be a WeightSource implementing iter_full (the tcp backend "
                f"sends full tensors from rank 0), got {type(source).__name__}"
            )
        plan = TransferPlan.build(
            source.metadata, bucket_bytes=init_info.bucket_bytes, alignment=init_info.alignment
        )
        if init_info.is_sender:
            owned = set(source.owned_names(0))
            for meta in plan.params:
                if meta.name not in owned:
                    raise ValueError(
                        f"parameter {meta.name!r} is not owned by rank 0 (owners {meta.owners}); "
                        f"the tcp backend sends every full tensor from rank 0"
                    )
        engine = cls(init_info, client=client, source=source, plan=plan)
        if init_info.is_sender:
            await engine._rendezvous()
        return engine

    def worker_init_info(self, port: int) -> dict[str, Any]:
        """The `init_info` dict the workers receive."""
        info = self.info
        return {
            "host": info.advertise_host or info.host,
            "port": port,
            "token": info.token,
            "plan": self.plan.to_wire(),
            "num_buffers": info.num_buffers,
            "connect_timeout": info.connect_timeout,
            "recv_timeout": info.recv_timeout,
        }

    async def _rendezvous(self) -> None:
        listener = socket.create_server((self.info.host, self.info.port), backlog=128)
        listener.setblocking(False)
        peers: list[_Peer] = []
        try:
            port = listener.getsockname()[1]
            with single_error():
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._accept, listener, peers)
                    await call_client(self.client, "init_weight_transfer_engine", self.worker_init_info(port))
                    tg.cancel_scope.cancel()
        except BaseException:
            for peer in peers:
                peer.close("init failed")
            raise
        finally:
            listener.close()
        if not peers:
            raise TransferError(
                "no worker connected during init_weight_transfer_engine; check that the "
                f"workers can reach {self.info.advertise_host or self.info.host}"
            )
        logger.info("asyncwt tcp: %d worker(s) connected and authenticated", len(peers))
        self._fanout = _Fanout(peers, self.plan, self.info)

    async def _accept(self, listener: socket.socket, peers: list[_Peer]) -> None:
        loop = asyncio.get_running_loop()
        async with anyio.create_task_group() as tg:
            while True:
                sock, address = await loop.sock_accept(listener)
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                tg.start_soon(self._handshake, sock, f"{address[0]}:{address[1]}", peers)

    async def _handshake(self, sock: socket.socket, address: str, peers: list[_Peer]) -> None:
        """Authenticate one worker; a failure refuses it without stopping init."""
        loop = asyncio.get_running_loop()
        digest = bytes.fromhex(self.plan.digest)
        registered = False
        try:
            with anyio.fail_after(self.info.connect_timeout):
                worker_nonce, worker_digest = unpack_hello(await async_recv_exact(sock, HELLO_SIZE))
                trainer_nonce = secrets.token_bytes(32)
                await loop.sock_sendall(sock, pack_challenge(self.info.token, worker_nonce, trainer_nonce, digest))
                proof = await async_recv_exact(sock, PROOF_SIZE)
                if not proof_is_valid(self.info.token, worker_nonce, trainer_nonce, digest, proof):
                    status = HandshakeStatus.BAD_PROOF
                elif worker_digest != digest:
                    status = HandshakeStatus.PLAN_MISMATCH
                elif len(peers) >= self.info.max_workers:
                    status = HandshakeStatus.FULL
                else:
                    status = HandshakeStatus.OK
                    peers.append(_Peer(sock, address))
                    registered = True
                await loop.sock_sendall(sock, pack_result(status))
                if status != HandshakeStatus.OK:
                    logger.warning("asyncwt tcp: refused worker %s: %s", address, status.name)
        except (TimeoutError, OSError, AsyncwtError) as exc:
            logger.warning("asyncwt tcp: handshake with %s failed: %r", address, exc)
        finally:
            if not registered:
                sock.close()

    async def send_weights(self, *, weight_version: str | None = None) -> RoundStats:  # type: ignore[override]
        """Run one round and return its stats; call it on every trainer rank.

        Rank 0 calls `start_weight_update`, then streams every bucket while
        `update_weights` runs, then `finish_weight_update(weight_version)`. Other
        ranks iterate the source (their collectives line up with rank 0's) and send
        nothing.

        Cancellation: the round is aborted on every worker (their `update_weights`
        fails, no version is published), staging slots are released, and the
        iterate thread stops at its next tensor; the next round starts clean. A
        bucket already being written finishes first (bounded by `send_timeout`).
        """
        if self._closed:
            raise RuntimeError("send_weights called after shutdown()")
        if self._busy:
            raise RuntimeError("send_weights is already running on this engine; rounds cannot overlap")
        self._busy = True
        self._rounds += 1
        round_id = self._rounds
        started = time.perf_counter()
        try:
            if not self.is_sender:
                busy = await self._iterate_only()
                return self._stats(round_id, weight_version, started, busy, sent=False)
            assert self._fanout is not None
            self._fanout.check_usable()
            busy = await self._sender_round(round_id, weight_version)
            return self._stats(round_id, weight_version, started, busy, sent=True)
        finally:
            self._busy = False

    async def _iterate_only(self) -> dict[str, float]:
        t0 = time.perf_counter()
        await anyio.to_thread.run_sync(
            iterate_and_check, self.plan, self._expected, self.source, self._iterate_lane
        )
        return {"iterate": time.perf_counter() - t0}

    async def _sender_round(self, round_id: int, weight_version: str | None) -> dict[str, float]:
        assert self._fanout is not None
        fanout = self._fanout
        await call_client(self.client, "start_weight_update")
        update_info = {"round_id": round_id, "plan_digest": self.plan.digest}
        failed = False
        busy: dict[str, float] = {}

        async def update_rpc() -> None:
            try:
                await call_client(self.client, "update_weights", update_info)
            except Exception as exc:
                if not failed:
                    raise
                logger.debug("round %d: update_weights failed after the abort: %r", round_id, exc)

        with single_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(update_rpc)
                try:
                    await fanout.wait_ready(round_id)
                    busy = await run_pipeline(
                        self.plan,
                        self.source,
                        fanout,
                        pool=self._pool,
                        iterate_lane=self._iterate_lane,
                        pack_lane=self._pack_lane,
                        config=self._pipeline,
                    )
                    await fanout.end_round()
                except BaseException as exc:
                    failed = True
                    with anyio.CancelScope(shield=True):
                        await fanout.abort_round(f"{type(exc).__name__}: {exc}")
                    raise
        await call_client(self.client, "finish_weight_update", weight_version)
        return busy

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
            buckets=len(self.plan.buckets) if sent else 0,
            workers=len(self._fanout.peers) if sent and self._fanout else 0,
            wall_s=time.perf_counter() - started,
            stage_busy_s=busy,
        )
        logger.info("asyncwt rank %d: %s", self.rank, stats.summary())
        return stats

    @property
    def num_workers(self) -> int:
        """Workers connected to this (sender) engine."""
        return len(self._fanout.peers) if self._fanout else 0

    async def shutdown(self) -> None:
        """Close every worker connection. Idempotent."""
        self._closed = True
        if self._fanout is not None:
            self._fanout.close()
