"""The torch_dist rendezvous store is closed to strangers (issue 23, finding 9).

The worker is an `asyncwt worker` process of its own; the stranger is this process,
which knows the store's port (as anyone on the host can find it) but not the token.
"""

from __future__ import annotations

import datetime
import secrets
import socket
import threading
from typing import Any

import _models
import anyio
import pytest
import torch.distributed as dist
from _faults import assert_worker_has, info_for, worker_env

from asyncwt import (
    AuthenticationError,
    HttpClient,
    ModuleSource,
    Timeouts,
    TransferPlan,
    trainer_init,
)
from asyncwt._backends.torch_dist_store import StoreClient, StoreServer, store_digest
from asyncwt._transports.wire import (
    CHALLENGE_SIZE,
    RESULT_SIZE,
    check_result,
    pack_hello,
    pack_proof,
)
from asyncwt._worker.launch import worker_process

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])


def snoop(port: int) -> list[str] | str:
    """What a TCPStore client learns from the store: its keys, or why it could not."""
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=3)
        )
        return [str(key) for key in store.list_keys()]
    except (RuntimeError, ValueError, OSError) as exc:  # DistError is a RuntimeError
        return f"{type(exc).__name__}: {exc}"


class SnoopingClient(HttpClient):
    """Once the worker joined, tries the store as a stranger would."""

    snooped: list[str] | str | None = None

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        await super().init_weight_transfer_engine(init_info)
        self.snooped = await anyio.to_thread.run_sync(snoop, init_info["store_port"])
        self.group_key = init_info["group_key"]


@uvloop_only
@pytest.mark.slow
async def test_a_stranger_cannot_list_the_store_or_learn_the_group_key() -> None:
    model = _models.mixed()
    _models.randomize(model, seed=9)
    with worker_process("_models:mixed", "--backend", "torch_dist", env=worker_env()) as url:
        async with SnoopingClient(url, timeout=60) as client:
            info = info_for("torch_dist", timeouts=Timeouts(handshake=2.0))
            with anyio.fail_after(60):
                engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                await engine.send_weights(weight_version="private")
            await assert_worker_has(client, model, "private")
    assert isinstance(client.snooped, str), f"a stranger listed the store's keys: {client.snooped}"
    assert client.group_key not in client.snooped


def _server(token: str, digest: bytes) -> StoreServer:
    return StoreServer(
        "127.0.0.1",
        0,
        token=token,
        digest=digest,
        timeout=5,
        handshake_timeout=2,
        max_pending=4,
        max_peers=1,
    )


@uvloop_only
async def test_the_store_refuses_a_wrong_proof_and_serves_one_that_knows_the_token() -> None:
    token = secrets.token_hex(32)
    plan = TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=1 << 16)
    digest = store_digest(plan.digest)
    server = _server(token, digest)
    await server.start()
    try:
        await anyio.to_thread.run_sync(_talk_to, server, token, digest)
    finally:
        server.close()


def _talk_to(server: StoreServer, token: str, digest: bytes) -> None:
    """A wrong proof is refused; the right token gets the keys, also those set later."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(pack_hello(secrets.token_bytes(32), digest))
        challenge = sock.recv(CHALLENGE_SIZE, socket.MSG_WAITALL)
        assert len(challenge) == CHALLENGE_SIZE
        sock.sendall(pack_proof("not the token" * 4, bytes(32), bytes(32), digest))
        with pytest.raises(
            AuthenticationError, match=r"^the trainer refused this worker's token proof$"
        ):
            check_result(sock.recv(RESULT_SIZE, socket.MSG_WAITALL))
    with pytest.raises(AuthenticationError):
        StoreClient("127.0.0.1", server.port, token="x" * 64, digest=digest, timeout=5)
    client = StoreClient("127.0.0.1", server.port, token=token, digest=digest, timeout=5)
    try:
        server.local_store().set("rank_0", b"address")
        assert client.get("rank_0") == b"address"
        assert client.add("worker_rank", 1) == 1
        assert server.local_store().add("worker_rank", 1) == 2
        later = threading.Timer(0.3, server.local_store().set, ("late", b"there"))
        later.start()
        assert client.get("late") == b"there"  # waited for, on the server's loop
        later.join()
    finally:
        client.close()
