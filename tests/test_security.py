"""No way in: authentication, bounded inputs, loopback by default, no pickle.

The fuzz cases throw random and mutated frame headers and handshake messages at
each reader (in-process, over socket pairs): every input must end in one of the
transfer errors, never in another exception, a hang or a large allocation.
Seeded, so a failure replays.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import random
import secrets
import socket
import struct
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _models
import aiohttp
import anyio
import pytest
import torch
from _faults import info_for, open_fds

import asyncwt
from asyncwt import (
    AuthenticationError,
    LocalClient,
    ModuleSource,
    PlanMismatchError,
    ProtocolError,
    TcpTrainerInitInfo,
    TransferError,
    TransferPlan,
    WeightTransferConfig,
    _link,
    _sockio,
    create_worker_engine,
    trainer_init,
)
from asyncwt._applier import ModelTarget
from asyncwt._link import LinkSettings, Peer, TrainerLinks, WorkerLink, connect_link
from asyncwt._ring import RingReceiver
from asyncwt._server import DEFAULT_MAX_BODY_BYTES, build_app
from asyncwt._tcp_info import TcpWorkerInitInfo
from asyncwt._tcp_worker import TcpReceiver
from asyncwt._wire import (
    ABORT_REASON_MAX,
    CHALLENGE_SIZE,
    FRAME_SIZE,
    HELLO_SIZE,
    PROOF_SIZE,
    RESULT_SIZE,
    Frame,
    FrameKind,
    HandshakeStatus,
    digest_prefix,
    pack_challenge,
    pack_hello,
    pack_proof,
    pack_result,
)
from asyncwt._worker_engine import ReceivePool

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])
PACKAGE = Path(asyncwt.__file__).resolve().parent
SEED = 7_2026
TOKEN = "t" * 32
EXPECTED = (ProtocolError, AuthenticationError, PlanMismatchError, TransferError)
"""What a bad input may end in (TransferError covers aborts, timeouts and EOF)."""


# -- no pickle, no eval -----------------------------------------------------------------

FORBIDDEN_MODULES = {"pickle", "_pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
FORBIDDEN_CALLS = {"eval", "exec", "__import__"}
FORBIDDEN_ATTRIBUTES = {("torch", "load"), ("pickle", "loads"), ("pickle", "load"), ("marshal", "loads")}


def _violations(path: Path) -> Iterator[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in FORBIDDEN_MODULES:
                    yield f"{path.name}:{node.lineno}: import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in FORBIDDEN_MODULES:
                yield f"{path.name}:{node.lineno}: from {node.module} import ..."
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in FORBIDDEN_CALLS:
                yield f"{path.name}:{node.lineno}: {func.id}(...)"
            if (
                isinstance(func, ast.Attribute)
                and isinstance(func.value, ast.Name)
                and (func.value.id, func.attr) in FORBIDDEN_ATTRIBUTES
            ):
                yield f"{path.name}:{node.lineno}: {func.value.id}.{func.attr}(...)"


def test_the_package_never_unpickles_or_evaluates() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    found = [v for path in files for v in _violations(path)]
    assert found == []


def test_the_scan_catches_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom marshal import loads\neval('1')\ntorch.load('x')\n")
    assert len(list(_violations(bad))) == 4


# -- loopback by default ----------------------------------------------------------------


def _listening_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc shows them) listening on `port`."""
    found = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.rsplit(":", 1)
                if state == "0A" and int(hex_port, 16) == port:
                    found.append(address)
    return found


LOOPBACK_V4 = "0100007F"


@uvloop_only
@pytest.mark.parametrize("backend", ["tcp", "shm", "torch_dist"])
async def test_every_trainer_listener_binds_loopback_by_default(backend: str) -> None:
    """The link's listener and (torch_dist) the group's store: 127.0.0.1 only."""
    seen: dict[str, list[str]] = {}
    engines = [create_worker_engine(WeightTransferConfig(backend=backend), model=_models.mixed())]

    class Recording(LocalClient):
        async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            seen["link"] = _listening_addresses(init_info["port"])
            if "store_port" in init_info:
                seen["store"] = _listening_addresses(init_info["store_port"])
            await super().init_weight_transfer_engine(init_info)

    try:
        info = info_for(backend)
        assert info.host == "127.0.0.1"  # type: ignore[attr-defined]
        engine = await trainer_init(info, client=Recording(engines), source=ModuleSource(_models.mixed()))
        await engine.shutdown()
    finally:
        engines[0].shutdown()
    assert seen["link"] == [LOOPBACK_V4]
    if backend == "torch_dist":
        assert seen["store"] == [LOOPBACK_V4]


def test_the_worker_server_binds_loopback_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    import inspect

    from asyncwt import _cli, _server

    assert inspect.signature(_server.serve).parameters["host"].default == "127.0.0.1"
    with pytest.raises(SystemExit):
        _cli.main(["worker", "--help"])
    assert "address to bind (default 127.0.0.1)" in " ".join(capsys.readouterr().out.split())


# -- mutual authentication --------------------------------------------------------------


def _plan() -> TransferPlan:
    return TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=_models.BUCKET_BYTES)


def _fake_trainer(reply: Callable[[bytes], bytes]) -> tuple[int, threading.Thread]:
    """A listener that reads a HELLO and answers `reply(hello)`, then closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        with listener:
            listener.settimeout(10)
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    hello = _recv_all(conn, HELLO_SIZE)
                    conn.sendall(reply(hello))
                    conn.shutdown(socket.SHUT_WR)
                    _recv_all(conn, 1 << 16)  # until the worker closes

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def _recv_all(conn: socket.socket, nbytes: int) -> bytes:
    """Up to `nbytes`, until EOF or a reset (a peer closing with unread input resets)."""
    data = b""
    while len(data) < nbytes:
        try:
            chunk = conn.recv(nbytes - len(data))
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def test_the_worker_refuses_a_trainer_that_does_not_know_the_token() -> None:
    plan = _plan()
    digest = bytes.fromhex(plan.digest)

    def wrong_token(hello: bytes) -> bytes:
        worker_nonce = hello[8:40]
        return pack_challenge("not-the-token-at-all", worker_nonce, secrets.token_bytes(32), digest)

    port, thread = _fake_trainer(wrong_token)
    with pytest.raises(AuthenticationError, match=r"^the trainer failed the token challenge"):
        connect_link("127.0.0.1", port, TOKEN, plan, timeout=5)
    thread.join(10)


def _links(**overrides: Any) -> TrainerLinks:
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "advertise_host": None,
        "token": TOKEN,
        "max_workers": 4,
        "connect_timeout": 5.0,
        "send_timeout": 2.0,
        "ready_timeout": 2.0,
        "max_pending_handshakes": 4,
        "handshake_timeout": 0.5,
    }
    settings.update(overrides)
    return TrainerLinks(LinkSettings(**settings), _plan())


async def _run_trainer_handshake(links: TrainerLinks, inbound: bytes) -> tuple[list[Peer], bytes]:
    """Feed `inbound` to the trainer's handshake (then EOF); what it admitted and said."""
    ours, theirs = socket.socketpair()
    peers: list[Peer] = []
    slots = anyio.Semaphore(1)
    await slots.acquire()
    try:
        theirs.sendall(inbound)
        theirs.shutdown(socket.SHUT_WR)
        with anyio.fail_after(5):
            await links._handshake(ours, "fuzz", peers, slots)
        theirs.settimeout(2)
        answer = _recv_all(theirs, 1 << 16)
    finally:
        theirs.close()
    assert slots.value == 1  # the handshake slot came back
    return peers, answer


@uvloop_only
async def test_a_replayed_proof_is_refused() -> None:
    """The trainer's nonce is fresh per handshake: a recorded proof does not verify."""
    links = _links()
    digest = bytes.fromhex(links.plan.digest)
    nonce = secrets.token_bytes(32)
    old_trainer_nonce = secrets.token_bytes(32)
    replay = pack_hello(nonce, digest) + pack_proof(TOKEN, nonce, old_trainer_nonce, digest)
    peers, answer = await _run_trainer_handshake(links, replay)
    assert peers == []
    assert answer[CHALLENGE_SIZE:] == pack_result(HandshakeStatus.BAD_PROOF)


# -- fuzz: the trainer's handshake ------------------------------------------------------


def _mutate(data: bytes, rng: random.Random) -> bytes:
    """`data` with 1-4 random bytes changed (always different from `data`)."""
    out = bytearray(data)
    while bytes(out) == data:
        for _ in range(rng.randint(1, 4)):
            out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def _handshake_inputs(digest: bytes, rng: random.Random) -> Iterator[bytes]:
    nonce = secrets.token_bytes(32)
    hello = pack_hello(nonce, digest)
    proof = pack_proof(TOKEN, nonce, secrets.token_bytes(32), digest)  # wrong trainer nonce
    for _ in range(40):
        yield rng.randbytes(rng.randrange(HELLO_SIZE + PROOF_SIZE + 8))
    for _ in range(40):
        yield _mutate(hello, rng) + proof
    for _ in range(40):
        yield hello + _mutate(proof, rng)
    for _ in range(20):
        yield (hello + proof)[: rng.randrange(HELLO_SIZE + PROOF_SIZE)]


@uvloop_only
async def test_fuzzed_handshakes_never_get_in_and_never_break_the_trainer() -> None:
    rng = random.Random(SEED)
    links = _links()
    digest = bytes.fromhex(links.plan.digest)
    for inbound in _handshake_inputs(digest, rng):
        peers, answer = await _run_trainer_handshake(links, inbound)
        assert peers == []
        if len(answer) > CHALLENGE_SIZE:
            assert answer[CHALLENGE_SIZE:] != pack_result(HandshakeStatus.OK)


def test_fuzzed_challenges_and_results_fail_the_worker_with_a_transfer_error() -> None:
    """The worker's side of the handshake against a trainer that answers garbage."""
    rng = random.Random(SEED + 1)
    plan = _plan()
    digest = bytes.fromhex(plan.digest)
    replies: list[Callable[[bytes], bytes]] = []
    for _ in range(15):
        size = rng.randrange(CHALLENGE_SIZE + RESULT_SIZE + 8)
        replies.append(lambda hello, size=size: rng.randbytes(size))
    for _ in range(15):

        def mutated_challenge(hello: bytes) -> bytes:
            good = pack_challenge(TOKEN, hello[8:40], secrets.token_bytes(32), digest)
            return _mutate(good, rng) + pack_result(HandshakeStatus.OK)

        replies.append(mutated_challenge)
    for status in (1, 2, 3, 4, 2**32 - 1):

        def refusing(hello: bytes, status: int = status) -> bytes:
            good = pack_challenge(TOKEN, hello[8:40], secrets.token_bytes(32), digest)
            return good + struct.pack("<4sI", b"AWTR", status)

        replies.append(refusing)
    for reply in replies:
        port, thread = _fake_trainer(reply)
        with pytest.raises(EXPECTED):
            connect_link("127.0.0.1", port, TOKEN, plan, timeout=2)
        thread.join(10)


# -- fuzz: the worker's frame reader ----------------------------------------------------


def _valid_round(plan: TransferPlan, round_id: int, rng: random.Random) -> list[bytes]:
    """The trainer → worker stream of a valid round: [header, payload, header, ...]."""
    digest = digest_prefix(plan.digest)
    parts = []
    for bucket in plan.buckets:
        parts.append(Frame(FrameKind.BUCKET, round_id, bucket.index, digest, bucket.payload_bytes).pack())
        parts.append(rng.randbytes(bucket.payload_bytes))
    parts.append(Frame(FrameKind.END, round_id, len(plan.buckets), digest, 0).pack())
    return parts


_FIELDS = {  # offset, struct format of each header field after the magic
    "kind": (4, "<B"),
    "reserved": (5, "<3s"),
    "round": (8, "<Q"),
    "index": (16, "<I"),
    "slot": (20, "<I"),
    "digest": (24, "<16s"),
    "nbytes": (40, "<Q"),
}
_EXTREMES = [0, 1, 2, 3, 4, 5, 6, 255, 2**31, 2**32 - 1, 2**63, 2**64 - 1]


def _set_field(header: bytes, field: str, rng: random.Random) -> bytes:
    offset, fmt = _FIELDS[field]
    size = struct.calcsize(fmt)
    out = bytearray(header)
    while bytes(out) == header:
        if fmt.endswith("s"):
            out[offset : offset + size] = rng.randbytes(size)
        else:
            limit = 2 ** (8 * size) - 1
            value = rng.choice([v for v in _EXTREMES if v <= limit] + [rng.randint(0, limit)])
            out[offset : offset + size] = struct.pack(fmt, value)
    return bytes(out)


def _frame_inputs(plan: TransferPlan, rng: random.Random) -> Iterator[tuple[str, bytes]]:
    """(what, stream) pairs: each stream is a valid round broken in one way."""
    headers = [i for i in range(0, 2 * len(plan.buckets) + 1, 2)]  # header positions
    for field in _FIELDS:
        for _ in range(12):
            parts = _valid_round(plan, 1, rng)
            at = rng.choice(headers)
            parts[at] = _set_field(parts[at], field, rng)
            yield f"{field} of part {at}", b"".join(parts)
    for _ in range(40):
        parts = _valid_round(plan, 1, rng)
        at = rng.choice(headers)
        parts[at] = _mutate(parts[at], rng)
        yield f"bytes of part {at}", b"".join(parts)
    for _ in range(20):
        parts = _valid_round(plan, 1, rng)
        at = rng.choice(headers)
        parts[at] = rng.randbytes(FRAME_SIZE)
        yield f"random header {at}", b"".join(parts)
    for _ in range(20):
        stream = b"".join(_valid_round(plan, 1, rng))
        yield "truncated", stream[: rng.randrange(len(stream))]
    digest = digest_prefix(plan.digest)
    for nbytes in (ABORT_REASON_MAX + 1, 2**32, 2**64 - 1):
        yield f"abort of {nbytes}", Frame(FrameKind.ABORT, 1, 0, digest, nbytes).pack()
    yield "abort", Frame(FrameKind.ABORT, 1, 0, digest, 5).pack() + b"stop!"
    for _ in range(20):
        yield "garbage", rng.randbytes(rng.randrange(4 * FRAME_SIZE))


@contextlib.contextmanager
def _bounded_reads(limit: int) -> Iterator[list[int]]:
    """Record every `recv_exact` size the link asks for."""
    sizes: list[int] = []
    original = _sockio.recv_exact

    def recording(sock: socket.socket, nbytes: int) -> bytes:
        sizes.append(nbytes)
        assert nbytes <= limit, f"asked to read {nbytes} bytes at once"
        return original(sock, nbytes)

    _link.recv_exact = recording  # type: ignore[attr-defined]
    try:
        yield sizes
    finally:
        _link.recv_exact = original  # type: ignore[attr-defined]


def _receive(receiver: Any, target: ModelTarget, stream: bytes, sock: socket.socket, feed: socket.socket) -> None:
    """Write `stream` (then EOF) from a thread while `receiver` reads round 1."""

    def write() -> None:
        with contextlib.suppress(OSError):
            feed.sendall(stream)
            feed.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        for received in receiver.receive_round(1, target):
            received.release()
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        writer.join(10)


class _HostRing(RingReceiver):
    """The shared ring's receiver over two plain host buffers (no shared memory)."""

    def map_ring(self) -> list[torch.Tensor]:
        return [torch.empty(self.plan.bucket_bytes, dtype=torch.uint8) for _ in range(2)]


@pytest.mark.parametrize("transport", ["tcp", "ring"])
def test_fuzzed_frames_end_in_a_transfer_error_without_large_allocations(transport: str) -> None:
    rng = random.Random(SEED + 2 + (transport == "ring"))
    plan = _plan()
    model = _models.mixed()
    info = TcpWorkerInitInfo(plan=plan.to_wire(), host="127.0.0.1", port=1, token=TOKEN, recv_timeout=2.0)
    outcomes: dict[str, int] = {}
    with _bounded_reads(ABORT_REASON_MAX) as sizes:
        for what, stream in _frame_inputs(plan, rng):
            sock, feed = socket.socketpair()
            pool = ReceivePool(2, plan.bucket_bytes, torch.device("cpu"), 2.0, on_device=False)
            if transport == "tcp":
                receiver: Any = TcpReceiver(info, plan, pool)
                receiver.link = WorkerLink(sock, plan, 2.0, slots=1)
                target = ModelTarget.resolve(model, plan, None)
            else:
                receiver = _HostRing(info, plan)
                receiver.buffers = receiver.map_ring()
                receiver.link = WorkerLink(sock, plan, 2.0, slots=2)
                target = ModelTarget.resolve(model, plan, None, in_place=False)
            tracemalloc.start()
            try:
                with pytest.raises(EXPECTED) as caught:
                    _receive(receiver, target, stream, sock, feed)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
                sock.close()
                feed.close()
            assert peak < 256 << 10, f"{what}: {peak} bytes allocated"
            assert len(pool._buffers) <= 2 and all(b.numel() == plan.bucket_bytes for b in pool._buffers)
            assert receiver.link.broken or "aborted" in str(caught.value), what
            name = type(caught.value).__name__
            outcomes[name] = outcomes.get(name, 0) + 1
    assert sum(outcomes.values()) > 150
    assert max(sizes) <= ABORT_REASON_MAX
    print(f"{transport}: {outcomes}")


# -- fuzz: what the trainer reads from a worker -----------------------------------------


@uvloop_only
async def test_fuzzed_worker_frames_end_in_a_transfer_error_on_the_trainer() -> None:
    """READY/RELEASE frames from a worker: anything malformed breaks that connection
    with a typed error; nothing else is read or allocated on its account."""
    rng = random.Random(SEED + 3)
    links = _links()
    digest = digest_prefix(links.plan.digest)
    ready = Frame(FrameKind.READY, 1, 0, digest, 0).pack()
    inputs = [rng.randbytes(rng.randrange(2 * FRAME_SIZE)) for _ in range(30)]
    inputs += [_mutate(ready, rng) for _ in range(40)]
    inputs += [_set_field(ready, field, rng) for field in _FIELDS for _ in range(6)]
    buckets = len(links.plan.buckets)
    bad_releases = [(buckets, 0, 1), (2**32 - 1, 0, 1), (0, 1, 1), (0, 2**64 - 1, 1), (0, 0, 2), (0, 0, 2**32 - 1)]
    inputs += [
        Frame(FrameKind.RELEASE, 1, index, digest, nbytes, slot).pack() + ready
        for index, nbytes, slot in bad_releases
    ]
    errors = 0
    for inbound in inputs:
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        peer = Peer(ours, "fuzz")
        links.peers = [peer]
        def on_release(p: Peer, frame: Frame) -> None:
            if frame.slot >= 2:
                raise links.protocol_error(p, f"released slot {frame.slot}")

        try:
            theirs.sendall(inbound)
            theirs.shutdown(socket.SHUT_WR)
            try:
                with anyio.fail_after(5):
                    await links.wait_ready(1, on_release)
            except EXPECTED:
                errors += 1
                assert peer.broken is not None

        finally:
            peer.close("done")
            theirs.close()
    assert errors == len(inputs)


# -- bounded inputs on the control plane ------------------------------------------------


@uvloop_only
async def test_the_worker_server_refuses_an_oversized_body_with_a_json_413() -> None:
    assert DEFAULT_MAX_BODY_BYTES == 64 << 20
    from aiohttp import web

    app = build_app(_models.mixed(), config=WeightTransferConfig(), max_body_bytes=4096)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{port}/init_weight_transfer_engine"
            big = json.dumps({"init_info": {"plan": {"pad": "x" * 8192}}})
            async with session.post(url, data=big, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 413
                assert "error" in await r.json()
    finally:
        await runner.cleanup()


@uvloop_only
async def test_deeply_nested_json_is_a_400_not_a_500() -> None:
    from aiohttp import web

    app = build_app(_models.mixed(), config=WeightTransferConfig())
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            deep = '{"update_info": ' + "[" * 100_000 + "]" * 100_000 + "}"
            async with session.post(f"http://127.0.0.1:{port}/update_weights", data=deep) as r:
                assert r.status == 400, await r.text()
                assert (await r.json())["error"].endswith("nested too deeply")
    finally:
        await runner.cleanup()


# -- connection limits ------------------------------------------------------------------


@uvloop_only
async def test_a_flood_of_idle_connections_during_init_holds_few_trainer_descriptors() -> None:
    """Idle connections occupy at most `max_pending_handshakes` accepted sockets, each
    for `handshake_timeout`; the real worker still gets in once they time out."""
    flood = 24
    limit = 4
    worker = create_worker_engine(WeightTransferConfig(), model=_models.mixed())
    idle: list[socket.socket] = []
    during: list[int] = []

    class Flooding(LocalClient):
        async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            before = open_fds()
            for _ in range(flood):
                idle.append(socket.create_connection(("127.0.0.1", init_info["port"])))
            await anyio.sleep(0.2)  # the trainer accepts what it will accept
            during.append(open_fds() - before - flood)  # the trainer's share
            await super().init_weight_transfer_engine(init_info)

    info = TcpTrainerInitInfo(
        rank=0, bucket_bytes=_models.BUCKET_BYTES, max_pending_handshakes=limit, handshake_timeout=0.3
    )
    try:
        with anyio.fail_after(30):
            engine = await trainer_init(info, client=Flooding([worker]), source=ModuleSource(_models.mixed()))
        async with engine:
            assert engine.num_workers == 1
            await engine.send_weights(weight_version="through")
    finally:
        for sock in idle:
            sock.close()
        worker.shutdown()
    assert during and during[0] <= limit
    assert worker.weight_version == "through"
    await asyncio.sleep(0)
