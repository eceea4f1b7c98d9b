"""The `"tcp"` backend, worker side: connect, authenticate, receive rounds in place."""

from __future__ import annotations

import contextlib
import logging
import queue
import secrets
import socket
import threading
from typing import Any

import torch

from ._applier import DeferredApplier, ModelTarget
from ._bytes import byte_view
from ._exceptions import (
    ProtocolError,
    TransferAbortedError,
    TransferError,
    TransferTimeoutError,
)
from ._lanes import staging_buffer
from ._plan import Bucket, TransferPlan
from ._sockio import recv_exact, recv_segments, send_all
from ._tcp_info import TcpUpdateInfo, TcpWorkerInitInfo
from ._wire import (
    ABORT_REASON_MAX,
    CHALLENGE_SIZE,
    FRAME_SIZE,
    RESULT_SIZE,
    Frame,
    FrameKind,
    check_result,
    digest_prefix,
    pack_hello,
    pack_proof,
    verify_challenge,
)
from ._worker import WeightTransferConfig, WeightTransferEngine

__all__ = ["TcpWorkerEngine"]

logger = logging.getLogger("asyncwt")


class TcpWorkerEngine(WeightTransferEngine[TcpWorkerInitInfo, TcpUpdateInfo]):
    """Worker engine of the `"tcp"` backend, with deferred (background) apply.

    `update_weights` returns once every byte of the round is received; unpacking,
    the optional transform and loading run on `config.apply_threads` threads.
    `finish_weight_update(weight_version)` drains them, re-raises the first error
    naming the parameter, and only then publishes `weight_version`.
    """

    init_info_cls = TcpWorkerInitInfo
    update_info_cls = TcpUpdateInfo
    defers_processing = True

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: Any | None,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self.weight_version: str | None = None
        """The version of the last round that finished completely."""
        self.weights_incomplete = False
        """True after a round that started changing the weights and did not finish."""
        self._applier = DeferredApplier(config.apply_threads)
        self._sock: socket.socket | None = None
        self._plan: TransferPlan | None = None
        self._target: ModelTarget | None = None
        self._buffers: list[torch.Tensor] = []
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._recv_timeout = 300.0
        self._last_round = 0
        self._round_error: BaseException | None = None
        self._received_round = 0
        self._receiving = threading.Lock()
        """Held while a round is received: a late call waits for an aborted one to end."""

    # -- init -------------------------------------------------------------------------

    def init_transfer_engine(self, init_info: TcpWorkerInitInfo) -> None:
        """Rebuild the trainer's plan, match it to the model, connect and authenticate.

        Replaces any previous connection (a new `trainer_init` reconnects).
        """
        plan = TransferPlan.from_wire(init_info.plan)
        target = ModelTarget.resolve(self.model, plan, self.config.transform)
        self._close_socket()
        sock = self._connect(init_info, plan)
        self._drain_quietly()
        self._plan, self._target, self._sock = plan, target, sock
        self._recv_timeout = float(init_info.recv_timeout)
        self._buffers = []
        self._free = queue.SimpleQueue()
        for slot in range(init_info.num_buffers):
            self._free.put(slot)
        self._last_round = self._received_round = 0

    def _connect(self, info: TcpWorkerInitInfo, plan: TransferPlan) -> socket.socket:
        digest = bytes.fromhex(plan.digest)
        try:
            sock = socket.create_connection((info.host, info.port), timeout=info.connect_timeout)
        except OSError as exc:
            raise TransferError(f"could not connect to the trainer at {info.host}:{info.port}: {exc}") from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = secrets.token_bytes(32)
            send_all(sock, pack_hello(nonce, digest))
            trainer_nonce = verify_challenge(info.token, nonce, digest, recv_exact(sock, CHALLENGE_SIZE))
            send_all(sock, pack_proof(info.token, nonce, trainer_nonce, digest))
            check_result(recv_exact(sock, RESULT_SIZE))
        except TimeoutError as exc:
            sock.close()
            raise TransferTimeoutError(
                f"handshake with the trainer at {info.host}:{info.port} timed out after "
                f"{info.connect_timeout}s"
            ) from exc
        except BaseException:
            sock.close()
            raise
        return sock

    # -- rounds -----------------------------------------------------------------------

    def start_weight_update(self) -> None:
        """Begin a round: leftovers of an aborted round are drained and forgotten."""
        self._drain_quietly()
        self._round_error = None

    def receive_weights(self, update_info: TcpUpdateInfo) -> None:
        """Receive every bucket of the round; queue each for background apply.

        Raises `PlanMismatchError` (before any byte is read) when the round was
        planned differently, `TransferAbortedError` when the trainer aborts, and
        `TransferTimeoutError` when the trainer goes quiet for `recv_timeout`.
        """
        plan, target, sock = self._require_init()
        plan.check_digest(update_info.plan_digest, where=f"round {update_info.round_id}")
        if update_info.round_id <= self._last_round:
            raise ValueError(
                f"round_id should increase: got {update_info.round_id} after {self._last_round}"
            )
        round_id = self._last_round = update_info.round_id
        try:
            with self._receiving:
                self._receive_round(sock, plan, target, round_id)
        except TransferAbortedError as exc:
            self._round_error = exc
            raise
        except BaseException as exc:
            self._round_error = exc
            self._close_socket()
            if isinstance(exc, socket.timeout):
                raise TransferTimeoutError(
                    f"round {round_id}: no data from the trainer for recv_timeout="
                    f"{self._recv_timeout}s; the connection is closed, re-run init"
                ) from exc
            if isinstance(exc, OSError):
                raise TransferError(f"round {round_id}: the data connection failed: {exc}") from exc
            raise

    def _receive_round(
        self, sock: socket.socket, plan: TransferPlan, target: ModelTarget, round_id: int
    ) -> None:
        digest = digest_prefix(plan.digest)
        sock.settimeout(self._recv_timeout)
        send_all(sock, Frame(FrameKind.READY, round_id, 0, digest, 0).pack())
        self.weights_incomplete = True
        expected = 0
        while True:
            frame = Frame.unpack(recv_exact(sock, FRAME_SIZE))
            if frame.kind == FrameKind.ABORT:
                reason = self._read_abort_reason(sock, frame)
                if frame.round_id < round_id:
                    continue  # left over from a round this worker never joined
                raise TransferAbortedError(f"round {round_id}: the trainer aborted the round: {reason}")
            if frame.round_id != round_id or frame.digest != digest:
                raise ProtocolError(
                    f"round {round_id}: got a {frame.kind.name} frame for round {frame.round_id} "
                    f"(plan {frame.digest.hex()})"
                )
            if frame.kind == FrameKind.END:
                if frame.index != len(plan.buckets) or expected != len(plan.buckets):
                    raise ProtocolError(
                        f"round {round_id}: END after {expected} buckets, plan has "
                        f"{len(plan.buckets)} (END says {frame.index})"
                    )
                self._received_round = round_id
                return
            if frame.kind != FrameKind.BUCKET:
                raise ProtocolError(f"round {round_id}: unexpected {frame.kind.name} frame")
            if frame.index != expected or expected >= len(plan.buckets):
                raise ProtocolError(
                    f"round {round_id}: expected bucket {expected}, got bucket {frame.index}"
                )
            bucket = plan.buckets[expected]
            if frame.nbytes != bucket.payload_bytes:
                raise ProtocolError(
                    f"round {round_id}: bucket {expected} should carry {bucket.payload_bytes} "
                    f"bytes, the header says {frame.nbytes}"
                )
            self._receive_bucket(sock, target, round_id, bucket)
            expected += 1

    def _read_abort_reason(self, sock: socket.socket, frame: Frame) -> str:
        if frame.nbytes > ABORT_REASON_MAX:
            raise ProtocolError(
                f"ABORT reason should be at most {ABORT_REASON_MAX} bytes, header says {frame.nbytes}"
            )
        return recv_exact(sock, frame.nbytes).decode("utf-8", "replace")

    def _receive_bucket(
        self, sock: socket.socket, target: ModelTarget, round_id: int, bucket: Bucket
    ) -> None:
        needs_buffer = not all(target.direct[s.param] for s in bucket.slices)
        slot = self._take_slot() if needs_buffer else -1
        buffer = self._buffer(slot) if needs_buffer else None
        try:
            segments = []
            staging = byte_view(buffer) if buffer is not None else None
            for s in bucket.slices:
                if target.direct[s.param]:
                    segments.append(target.landing_view(s.param)[s.start : s.end])
                else:
                    assert staging is not None
                    segments.append(staging[s.offset : s.offset + s.nbytes])
            recv_segments(sock, segments)
        except BaseException:
            if slot >= 0:
                self._free.put(slot)
            raise
        release = (lambda: self._free.put(slot)) if slot >= 0 else _nothing
        self._applier.submit(target, round_id, bucket, buffer, release)

    def _take_slot(self) -> int:
        try:
            return self._free.get(timeout=self._recv_timeout)
        except queue.Empty:
            raise TransferTimeoutError(
                f"no receive buffer came free within {self._recv_timeout}s: background apply "
                f"is stuck (a transform or load_weights that never returns?)"
            ) from None

    def _buffer(self, slot: int) -> torch.Tensor:
        assert self._plan is not None
        while len(self._buffers) <= slot:
            self._buffers.append(staging_buffer(self._plan.bucket_bytes, self.device))
        return self._buffers[slot]

    def drain_pending(self) -> None:
        """Block until every received bucket is applied; re-raise the first error.

        Idempotent: a second call returns at once (an error is raised once).
        """
        self._applier.drain()

    def finish_weight_update(self, weight_version: str | None = None) -> None:  # type: ignore[override]
        """Drain background apply, then publish `weight_version`.

        Raises the first apply error (naming the parameter) or the error that ended
        the round's receive; either way the version is not published.
        """
        if self._round_error is not None:
            error, self._round_error = self._round_error, None
            self._drain_quietly()
            raise TransferError(f"the round did not complete: {error}") from error
        self.drain_pending()
        if self._received_round != self._last_round or self._last_round == 0:
            raise TransferError("finish_weight_update called without a completely received round")
        self.weight_version = weight_version
        self.weights_incomplete = False

    def _drain_quietly(self) -> None:
        try:
            self._applier.drain()
        except Exception as exc:  # reported already, or belongs to an aborted round
            logger.debug("dropping an error from an abandoned round: %r", exc)

    def _require_init(self) -> tuple[TransferPlan, ModelTarget, socket.socket]:
        if self._plan is None or self._target is None or self._sock is None:
            raise TransferError(
                "the tcp worker engine has no connection: call init_weight_transfer_engine first"
                + (" (the previous connection failed)" if self._plan is not None else "")
            )
        return self._plan, self._target, self._sock

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        super().set_weight_update_target(model, model_config)
        if self._plan is not None:
            self._target = ModelTarget.resolve(model, self._plan, self.config.transform)

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        if self._plan is not None:
            self._target = ModelTarget.resolve(self.model, self._plan, self.config.transform)

    def _close_socket(self) -> None:
        """Close the data connection; a receive blocked on it in another thread fails."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked recv; close() alone may not
            sock.close()

    def shutdown(self) -> None:
        """Close the connection and stop the apply threads (after queued work)."""
        self._close_socket()
        self._applier.shutdown()
        self._buffers = []


def _nothing() -> None:
    return None
