"""Direct reads on the `"shm"` backend: workers copy buckets out of the trainer's memory.

The shared backend suite (`test_backends.py`, `test_faults.py`) runs `"shm"` with
its defaults, which on this Linux machine are direct reads. Here: the cross-memory
primitives, the ring kept for workers that cannot read directly (or for a trainer
that does not offer it), a round mixing both, and the protocol's checks.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import _models
import anyio
import pytest
import torch
from _faults import assert_worker_has, info_for, proc_threads, shm_leftovers, worker_env
from _fuzzkit import HostRing, trainer_links

from asyncwt import (
    HttpClient,
    ModuleSource,
    ProtocolError,
    ShmTrainerInitInfo,
    ShmWorkerInitInfo,
    TransferError,
    Tuning,
    model_checksum,
    trainer_init,
)
from asyncwt._backends.shm.backend import ShmReceiver, ShmSender
from asyncwt._backends.shm.cma import (
    DEFAULT_STREAMS,
    MAX_STREAMS,
    PROBE_BYTES,
    ReadProbe,
    SplitReader,
    buffer_address,
    default_streams,
    holds_peer_of,
    probe_reads,
    read_from,
    split_ranges,
)
from asyncwt._core.bytes import byte_view
from asyncwt._core.plan import TransferPlan
from asyncwt._transports.link import Peer, WorkerLink
from asyncwt._transports.pool import ReceivePool
from asyncwt._transports.wire import FRAME_SIZE, Frame, FrameKind, digest_prefix
from asyncwt._worker.applier import ModelTarget
from asyncwt._worker.launch import start_worker, stop_worker, worker_process

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _probe_from_child(probe: ReadProbe) -> str:
    code = (
        "import sys; from asyncwt._backends.shm.cma import ReadProbe, probe_reads; "
        "print(probe_reads(ReadProbe(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])))"
    )
    args = [sys.executable, "-c", code, str(probe.pid), str(probe.address), probe.nonce]
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout.strip()


# -- the primitives ----------------------------------------------------------------


def test_read_from_copies_many_slices_of_varied_length() -> None:
    """More slices than one call takes (1024), empty ones among them."""
    source = torch.randint(0, 256, (3000 * 97,), dtype=torch.uint8)
    lengths = [(i * 7) % 97 for i in range(3000)]  # every 97th is empty
    dest = torch.zeros(sum(lengths), dtype=torch.uint8)
    dest_view = byte_view(dest)
    local, remote, expected, offset = [], [], [], 0
    for i, n in enumerate(lengths):
        local.append(dest_view[offset : offset + n])
        remote.append(source.data_ptr() + i * 97)
        expected.append(source[i * 97 : i * 97 + n])
        offset += n
    read_from(os.getpid(), local, remote)
    assert torch.equal(dest, torch.cat(expected))


def test_read_from_an_unmapped_address_is_an_os_error() -> None:
    with pytest.raises(OSError) as caught:
        read_from(os.getpid(), [memoryview(bytearray(16))], [8])
    assert caught.value.errno == errno.EFAULT


def test_read_from_needs_one_address_per_buffer() -> None:
    with pytest.raises(ValueError, match=r"one address per local buffer \(2\), got 1"):
        read_from(os.getpid(), [memoryview(bytearray(1)), memoryview(bytearray(1))], [1])


def _scattered(
    lengths: list[int], skew: int = 3
) -> tuple[torch.Tensor, torch.Tensor, list[memoryview], list[int]]:
    """A source, a zeroed destination, and one (view, address) pair per length: the
    destination's consecutive runs read from `skew` bytes into the source, so no run
    starts on a page boundary."""
    source = torch.randint(0, 256, (sum(lengths) + skew,), dtype=torch.uint8)
    dest = torch.zeros(sum(lengths), dtype=torch.uint8)
    view = byte_view(dest) if dest.numel() else memoryview(bytearray())
    local, remote, offset = [], [], 0
    for n in lengths:
        local.append(view[offset : offset + n])
        remote.append(source.data_ptr() + skew + offset)
        offset += n
    return source[skew:], dest, local, remote


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
@pytest.mark.parametrize(
    "lengths",
    [[1], [5, 0, 4096, 3], [0, 12_345, 1, 0, 99_999, 2], [300_001], [4096] * 9 + [1]],
    ids=["one-byte", "small", "odd", "one-long", "pages"],
)
def test_split_ranges_cover_every_byte_once_in_order(lengths: list[int], parts: int) -> None:
    """At most `parts` runs, none empty, that together are the pairs in order, each
    remote byte at the same offset as its local one; a cut inside a buffer falls on
    a remote page boundary where the buffer holds one before it."""
    _, _, local, remote = _scattered(lengths)
    runs = split_ranges(local, remote, parts)
    assert 1 <= len(runs) <= parts and all(run[0] for run in runs)
    flat = [(view, address) for views, addresses in runs for view, address in zip(views, addresses)]
    assert sum(len(v) for v, _ in flat) == sum(lengths)
    base, offset = remote[0], 0
    for view, address in flat:
        assert address == base + offset
        offset += len(view)
    for views, addresses in runs[1:]:
        start = addresses[0]
        holder = [r for v, r in zip(local, remote) if r < start < r + len(v)]
        assert not holder or start % 4096 == 0 or start // 4096 == holder[0] // 4096


def test_split_ranges_need_at_least_one_part_and_one_address_per_buffer() -> None:
    with pytest.raises(ValueError, match=r"^parts should be >= 1, got 0$"):
        split_ranges([memoryview(bytearray(1))], [1], 0)
    with pytest.raises(ValueError, match=r"one address per local buffer \(1\), got 2"):
        split_ranges([memoryview(bytearray(1))], [1, 2], 2)


@pytest.mark.parametrize("streams", [1, 2, 3, MAX_STREAMS])
def test_a_split_read_copies_every_byte(streams: int) -> None:
    lengths = [7, 0, 1 << 20, 3, 2_000_003, 0, 4099, 1]
    source, dest, local, remote = _scattered(lengths)
    reader = SplitReader(os.getpid(), streams, min_stream_bytes=1)
    try:
        reader.read(local, remote)
    finally:
        reader.close()
    assert torch.equal(dest, source)


def test_a_failed_stream_raises_once_every_stream_returned() -> None:
    """The last range's address is not mapped: its stream's OSError comes out of
    `read`, and only after the other streams wrote their ranges."""
    source, dest, local, remote = _scattered([1 << 20, 1 << 20, 1 << 20])
    remote[2] = 8  # unmapped
    reader = SplitReader(os.getpid(), 3, min_stream_bytes=1)
    try:
        with pytest.raises(OSError) as caught:
            reader.read(local, remote)
    finally:
        reader.close()
    assert caught.value.errno == errno.EFAULT
    assert torch.equal(dest[: 2 << 20], source[: 2 << 20])


def test_split_reader_settings_are_checked_and_its_threads_stop() -> None:
    for bad in (0, MAX_STREAMS + 1, 2.0):
        with pytest.raises(ValueError, match=rf"^streams should be an int in \[1, {MAX_STREAMS}\]"):
            SplitReader(os.getpid(), bad)  # type: ignore[arg-type]
    cores = len(os.sched_getaffinity(0))
    assert default_streams() == max(1, min(DEFAULT_STREAMS, cores))
    source, dest, local, remote = _scattered([3 << 20])
    reader = SplitReader(os.getpid(), 4, min_stream_bytes=1 << 20)
    reader.read(local, remote)
    assert torch.equal(dest, source)
    assert _read_threads()
    reader.close()
    reader.close()  # idempotent
    assert not _read_threads()


def _read_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("asyncwt-shm-read")]


@pytest.mark.slow
def test_a_child_process_reads_the_probe_back() -> None:
    probe, buffer = ReadProbe.create()
    assert buffer.raw.hex() == probe.nonce and len(buffer.raw) == PROBE_BYTES
    assert _probe_from_child(probe) == "None"


@pytest.mark.slow
def test_a_probe_that_does_not_match_says_why() -> None:
    probe, _buffer = ReadProbe.create()
    wrong = ReadProbe(probe.pid, probe.address, "00" * PROBE_BYTES)
    assert "does not hold the trainer's probe" in str(probe_reads(wrong))
    with subprocess.Popen([sys.executable, "-c", "pass"]) as gone:
        gone.wait()
    reason = probe_reads(ReadProbe(gone.pid, probe.address, probe.nonce))
    assert reason is not None and f"pid {gone.pid}" in reason


@pytest.mark.parametrize("family", ["ipv4", "dual-stack"])
@pytest.mark.slow
def test_the_peer_check_finds_which_process_holds_the_other_end(family: str) -> None:
    """A child accepts the connection: it holds the other end, this process does not."""
    code = (
        "import socket, sys; "
        "srv = socket.create_server(('::', 0), family=socket.AF_INET6, dualstack_ipv6=True) "
        "if sys.argv[1] == 'dual-stack' else socket.create_server(('127.0.0.1', 0)); "
        "print(srv.getsockname()[1], flush=True); conn, _ = srv.accept(); "
        "conn.sendall(b'a'); conn.recv(1)"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code, family], stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        with socket.create_connection(("127.0.0.1", port)) as sock:
            assert sock.recv(1) == b"a"  # accepted: the child holds a descriptor
            assert holds_peer_of(child.pid, sock)
            assert not holds_peer_of(os.getpid(), sock)
            sock.sendall(b"x")
        child.wait(timeout=30)


def test_buffer_address_of_a_view_and_of_an_empty_one() -> None:
    data = bytearray(b"abcdef")
    view = memoryview(data)[2:]
    assert ctypes.string_at(buffer_address(view), 4) == b"cdef"
    assert buffer_address(memoryview(bytearray())) == 0


# -- settings ----------------------------------------------------------------------


def test_direct_reads_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"^direct_reads should be a bool, got 'yes'$"):
        ShmTrainerInitInfo(rank=0, direct_reads="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-1, MAX_STREAMS + 1, 1.5])
def test_read_streams_must_be_an_int_in_range(value: object) -> None:
    with pytest.raises(
        ValueError, match=rf"^read_streams should be an int in \[0, {MAX_STREAMS}\], got {value!r}$"
    ):
        ShmTrainerInitInfo(rank=0, read_streams=value)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"trainer_pid": -1}, r"^trainer_pid should be an int in \[0, 2\*\*64\), got -1$"),
        ({"probe_address": "0x10"}, r"^probe_address should be an int in \[0, 2\*\*64\), got '0x10'$"),
        ({"trainer_pid": 12, "probe_nonce": "zz"}, r"^probe_nonce should be 64 lowercase hex digits, got 'zz'$"),
    ],
)  # fmt: skip
def test_worker_init_info_checks_the_probe_fields(fields: dict[str, object], message: str) -> None:
    plan = TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=1 << 16)
    base = {
        "host": "127.0.0.1",
        "port": 5,
        "token": "t" * 32,
        "plan": plan.to_wire(),
        "num_buffers": 1,
        "segments": ["asyncwt_0123456789abcdef_0"],
    }
    with pytest.raises(ValueError, match=message):
        ShmWorkerInitInfo(**{**base, **fields})  # type: ignore[arg-type]


# -- rounds ------------------------------------------------------------------------


async def _push(
    urls: list[str], model: torch.nn.Module, rounds: int, **info: Any
) -> tuple[ShmSender, int]:
    """Push `rounds` bit-exact rounds of `model` over shm; return the trainer's sender
    and the bytes its pipeline allocated for packing."""
    async with HttpClient(urls) as client:
        trainer_info = info_for("shm", workers=len(urls), **info)
        engine = await trainer_init(trainer_info, client=client, source=ModuleSource(model))
        async with engine:
            for r in range(1, rounds + 1):
                _models.randomize(model, seed=r)
                await engine.send_weights(weight_version=f"v{r}")
                await assert_worker_has(client, model, f"v{r}")
            sender = engine.transport
            assert isinstance(sender, ShmSender)
            return sender, engine._pool.allocated_bytes  # type: ignore[attr-defined]


@pytest.mark.asyncio
@pytest.mark.slow
async def test_a_direct_round_packs_nothing_on_the_trainer() -> None:
    model = _models.large_slices()
    assert all(p.is_contiguous() for p in model.parameters())
    with worker_process("_models:large_slices", "--backend", "shm", env=worker_env()) as url:
        sender, packed = await _push([url], model, 2, bucket_bytes=_models.LARGE_BUCKET_BYTES)
    assert sender.direct and [p.reads_directly for p in sender.links.peers] == [True]
    assert packed == 0
    assert not shm_leftovers()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("streams", "transform"),
    [(3, ()), (2, ("--transform", "_models:identity_transform", "--transform-elementwise"))],
    ids=["three-streams", "two-streams-elementwise"],
)  # fmt: skip
@pytest.mark.slow
async def test_split_direct_reads_are_bit_exact_and_leave_no_thread(
    streams: int, transform: tuple[str, ...]
) -> None:
    """Buckets of 4 MiB, read in several streams cut through odd-sized slices (a
    chunked parameter among them), rounds after rounds; a new `trainer_init` closes
    the old receiver's read threads. A leak would add `streams - 1` threads per init,
    so after two more inits the worker would hold two to four more threads; the
    server's own thread pool may start one more (it grows on demand), never two."""
    model = _models.large_slices()
    proc, url = start_worker(
        "_models:large_slices", "--backend", "shm", *transform, env=worker_env()
    )
    try:
        counts = []
        for _ in range(4):
            sender, packed = await _push(
                [url], model, 2, bucket_bytes=_models.LARGE_BUCKET_BYTES, read_streams=streams
            )
            assert sender.direct and packed == 0
            counts.append(proc_threads(proc.pid))
        assert counts[3] <= counts[1] + 1, counts
    finally:
        stop_worker(proc)
    assert not shm_leftovers()


@pytest.mark.asyncio
@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "packed"])
@pytest.mark.slow
async def test_a_trainer_that_offers_no_direct_reads_uses_the_ring(zero_copy: bool) -> None:
    with worker_process("_models:mixed", "--backend", "shm", env=worker_env()) as url:
        sender, _ = await _push(
            [url], _models.mixed(), 2, direct_reads=False, tuning=Tuning(zero_copy=zero_copy)
        )
    assert not sender.direct and not sender.links.peers[0].reads_directly
    assert not shm_leftovers()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "transform", [(), ("--transform", "_models:identity_transform", "--transform-elementwise")],
    ids=["in-place", "elementwise"],
)  # fmt: skip
@pytest.mark.slow
async def test_a_round_with_a_direct_reader_and_a_ring_reader(transform: tuple[str, ...]) -> None:
    """One worker cannot read the trainer's memory: every bucket goes into the ring,
    and the other worker reads the ring slot out of the trainer's memory (before the
    ring worker may release it for the next bucket)."""
    args = ("--backend", "shm", *transform)
    with (
        worker_process("_models:mixed", *args, env=worker_env()) as direct_url,
        worker_process("_models:mixed_reading_the_ring", *args, env=worker_env()) as ring_url,
    ):
        sender, _ = await _push([direct_url, ring_url], _models.mixed(), 4)
    assert not sender.direct
    assert sorted(p.reads_directly for p in sender.links.peers) == [False, True]
    assert not shm_leftovers()


# -- protocol ----------------------------------------------------------------------


def _link_pair(reads_directly: bool) -> tuple[WorkerLink, socket.socket, TransferPlan]:
    plan = TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=1 << 16)
    worker_end, trainer_end = socket.socketpair()
    return WorkerLink(worker_end, plan, 5.0, reads_directly=reads_directly), trainer_end, plan


@pytest.mark.parametrize(
    ("reads_directly", "sent", "expected"),
    [(False, FrameKind.BUCKET_AT, "BUCKET"), (True, FrameKind.BUCKET, "BUCKET_AT")],
)
def test_a_worker_takes_only_its_own_kind_of_bucket_frame(
    reads_directly: bool, sent: FrameKind, expected: str
) -> None:
    link, trainer_end, plan = _link_pair(reads_directly)
    with trainer_end, link.sock:
        digest = digest_prefix(plan.digest)
        trainer_end.sendall(Frame(sent, 1, 0, digest, plan.buckets[0].payload_bytes).pack())
        frames = link.frames(1)
        with pytest.raises(
            ProtocolError, match=rf"unexpected {sent.name} frame \(this worker takes {expected}\)"
        ):
            next(frames)
        ready = Frame.unpack(trainer_end.recv(64))
        assert (ready.kind, ready.slot) == (FrameKind.READY, int(reads_directly))


@pytest.mark.parametrize("offered", [False, True], ids=["not-offered", "offered"])
def test_a_ready_that_claims_direct_reads_needs_the_offer(offered: bool) -> None:
    """READY's slot 1 (the worker reads directly) is a protocol error unless the
    trainer offered direct reads; any other slot always is."""
    links = trainer_links()
    links.direct_reads = offered
    ours, theirs = socket.socketpair()
    with ours, theirs:
        peer = Peer(ours, "worker-a")
        ready = Frame(FrameKind.READY, 0, 0, links.digest, 0, 1)
        if offered:
            assert links.check_from_worker(peer, ready) is ready
        else:
            with pytest.raises(
                ProtocolError, match=r"slot 1; bucket should be 0 and slot at most 0"
            ):
                links.check_from_worker(peer, ready)
        with pytest.raises(ProtocolError, match=rf"slot 2; .* at most {int(offered)}$"):
            links.check_from_worker(peer, Frame(FrameKind.READY, 0, 0, links.digest, 0, 2))


@pytest.fixture
def probe_elsewhere() -> Iterator[ReadProbe]:
    """A read probe held by another process (a child that waits on its stdin)."""
    code = (
        "import sys; from asyncwt._backends.shm.cma import ReadProbe; probe, buffer = ReadProbe.create(); "
        "print(probe.pid, probe.address, probe.nonce, flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as other:
        assert other.stdout is not None and other.stdin is not None
        pid, address, nonce = other.stdout.readline().split()
        yield ReadProbe(int(pid), int(address), nonce)
        other.stdin.close()


@pytest.mark.asyncio
async def test_a_pid_that_does_not_hold_the_link_is_refused(probe_elsewhere: ReadProbe) -> None:
    """The init info names another process that holds a valid probe (a wrong or
    hostile control plane): the worker refuses to read it, naming the pid."""
    plan = TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=1 << 16)
    sender = ShmSender(ShmTrainerInitInfo(rank=0, bucket_bytes=1 << 16, num_buffers=1), plan)
    probe = probe_elsewhere
    refusals: list[str] = []

    async def init_worker(fields: dict[str, Any]) -> None:
        named = {
            "trainer_pid": probe.pid,
            "probe_address": probe.address,
            "probe_nonce": probe.nonce,
        }
        info = ShmWorkerInitInfo(**{**fields, **named})
        pool = ReceivePool(1, plan.bucket_bytes, torch.device("cpu"), 5.0, on_device=False)
        receiver = ShmReceiver(info, plan, pool)
        assert receiver.reads_directly  # the probe itself passes
        with pytest.raises(TransferError) as refused:
            await anyio.to_thread.run_sync(receiver.connect)
        refusals.append(str(refused.value))

    exported = {"plan": plan.to_wire(), "num_buffers": 1}
    try:
        await sender.rendezvous(exported, init_worker)
    finally:
        sender.close()
    assert len(refusals) == 1
    assert (
        f"trainer_pid {probe.pid} from the init info does not hold this worker's link"
        in refusals[0]
    )
    assert "direct_reads=False" in refusals[0]


def test_a_failed_stream_fails_the_bucket_with_a_transfer_error() -> None:
    """A bucket whose last slice's address is not mapped: of the streams that read
    it, one fails; the round ends with a `TransferError` naming the bucket, its
    receive buffer goes back to the pool, and closing the receiver stops the read
    threads."""
    model = _models.large_slices()
    plan = TransferPlan.build(ModuleSource(model).metadata, bucket_bytes=_models.LARGE_BUCKET_BYTES)
    probe, _buffer = ReadProbe.create()
    worker_end, trainer_end = socket.socketpair()
    info = ShmWorkerInitInfo(
        host="127.0.0.1", port=5, token="t" * 32, plan=plan.to_wire(), num_buffers=1,
        segments=["asyncwt_0123456789abcdef_0"], trainer_pid=probe.pid,
        probe_address=probe.address, probe_nonce=probe.nonce, read_streams=3,
    )  # fmt: skip
    pool = ReceivePool(1, plan.bucket_bytes, torch.device("cpu"), 5.0, on_device=False)
    receiver = ShmReceiver(info, plan, pool)
    assert receiver.reads_directly and receiver.reader is not None
    receiver.reader.min_stream_bytes = 1
    receiver.link = WorkerLink(worker_end, plan, 5.0, reads_directly=True)
    target = ModelTarget.resolve(_models.large_slices(), plan, None, in_place=False)
    bucket = max(plan.buckets, key=lambda b: len(b.slices))
    source = {name: p.detach() for name, p in model.named_parameters()}
    addresses = [
        source[plan.params[s.param].name].view(-1).view(torch.uint8)[s.start :].data_ptr()
        for s in bucket.slices
    ]
    addresses[-1] = 8  # unmapped
    with trainer_end:
        header = Frame(
            FrameKind.BUCKET_AT, 1, bucket.index, digest_prefix(plan.digest), bucket.payload_bytes
        )
        trainer_end.sendall(header.pack() + b"".join(a.to_bytes(8, "little") for a in addresses))
        with pytest.raises(
            TransferError, match=rf"reading bucket {bucket.index} from the trainer's memory failed"
        ):
            next(receiver.receive_round(1, target))
        assert pool.try_take() is not None  # the buffer was handed back
        assert _read_threads()
        receiver.close()
    assert not _read_threads()


@pytest.mark.asyncio(loop_factories=["uvloop"])
@pytest.mark.parametrize(
    "elementwise", [True, False], ids=["elementwise", "whole-tensor"]
)  # fmt: skip
@pytest.mark.slow
async def test_ring_workers_with_an_in_place_transform_each_apply_it_once(
    elementwise: bool,
) -> None:
    """Three ring workers whose transform doubles what it is given in place: each
    must hold exactly twice the trainer's weights, round after round (the transform
    is given the worker's own copy of a bucket, never the ring slot the other
    workers read)."""
    args = ["--backend", "shm", "--transform", "_models:doubling_transform"]
    if elementwise:
        args.append("--transform-elementwise")
    with (
        worker_process("_models:mixed", *args, env=worker_env()) as a,
        worker_process("_models:mixed", *args, env=worker_env()) as b,
        worker_process("_models:mixed", *args, env=worker_env()) as c,
    ):
        async with HttpClient([a, b, c]) as client:
            model = _models.mixed()
            info = info_for("shm", workers=3, direct_reads=False)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                for r in range(1, 4):
                    _models.randomize(model, seed=r)
                    await engine.send_weights(weight_version=f"v{r}")
                    multiples = {
                        model_checksum(_models.scaled(model, k)): f"{k}x" for k in (1, 2, 4, 8)
                    }
                    held = [
                        multiples.get(s["checksum"], "?")
                        for s in await client.weights_status(checksum=True)
                    ]
                    assert held == ["2x"] * 3, f"round {r}: the workers hold {held}"
                    await assert_worker_has(client, _models.scaled(model, 2), f"v{r}")
    assert not shm_leftovers()


@pytest.mark.parametrize(
    "transform", [None, _models.doubling_transform], ids=["plain", "transform"]
)
def test_a_ring_slot_reaches_user_code_only_as_a_copy_in_reused_worker_buffers(
    transform: Any,
) -> None:
    """With a transform (or `load_weights`) each announced slot is copied into one of
    the worker's own receive buffers (the same two, bucket after bucket) and released
    at once; without one the applier reads the slot in place and releases it after."""
    plan = TransferPlan.build(ModuleSource(_models.mixed()).metadata, bucket_bytes=1 << 16)
    info = ShmWorkerInitInfo(
        host="127.0.0.1", port=5, token="t" * 32, plan=plan.to_wire(), num_buffers=2,
        segments=["asyncwt_0123456789abcdef_0", "asyncwt_0123456789abcdef_1"],
    )  # fmt: skip
    pool = ReceivePool(2, plan.bucket_bytes, torch.device("cpu"), 5.0, on_device=False)
    ring = HostRing(info, plan, lambda: pool)
    ring.buffers = slots = [torch.randint_like(slot, 0, 256) for slot in ring.map_ring()]
    target = ModelTarget.resolve(_models.mixed(), plan, transform, in_place=False)
    worker_end, trainer_end = socket.socketpair()
    link = WorkerLink(worker_end, plan, 5.0)
    seen = set()
    with trainer_end, worker_end:
        for round_id in (1, 2, 3):
            for bucket in plan.buckets:
                slot = bucket.index % 2
                frame = Frame(
                    FrameKind.BUCKET, round_id, bucket.index, digest_prefix(plan.digest),
                    bucket.payload_bytes, slot,
                )  # fmt: skip
                received = ring.received(link, round_id, frame, target)
                assert received.buffer is not None
                shown = received.buffer[: bucket.buffer_bytes]
                assert torch.equal(shown, slots[slot][: bucket.buffer_bytes])
                if transform is None:
                    assert received.buffer is slots[slot]
                    received.release()  # the applier is done with the slot
                else:
                    assert all(received.buffer.data_ptr() != s.data_ptr() for s in slots)
                    seen.add(received.buffer.data_ptr())
                released = Frame.unpack(trainer_end.recv(FRAME_SIZE, socket.MSG_WAITALL))
                assert (released.kind, released.index, released.slot) == (
                    FrameKind.RELEASE, bucket.index, slot
                )  # fmt: skip
                if transform is not None:
                    received.release()  # the applier is done with the worker's copy
    # 3 rounds of every bucket went through the pool's two buffers, allocated once.
    assert len(seen) == (0 if transform is None else 2) and len(plan.buckets) > 2
