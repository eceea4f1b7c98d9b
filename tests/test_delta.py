"""Delta rounds (`delta=True`): the codec, and rounds across real processes.

Two workers serve every end-to-end case: one whose model takes the wire bytes in
place (its base is its live weights) and one with a transform (its base is a
shadow copy). Every round is checked bit-exact on both; a delta round must put
fewer bytes on the wire than its payload, and anything that breaks a worker's
base (a digest mismatch, a cut or cancelled round) must end in a full round that
is bit-exact again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import _models
import anyio
import pytest
import torch
import xxhash
import zstandard
from _faults import (
    SMALL_TIMEOUTS,
    FaultySource,
    ProxyClient,
    assert_worker_has,
    info_for,
    open_fds,
    threads_in_asyncwt,
    wait_until,
    worker_env,
)

from asyncwt import (
    AsyncwtError,
    CudaIpcTrainerInitInfo,
    Delta,
    HttpClient,
    LocalClient,
    ModuleSource,
    RoundStats,
    TcpTrainerInitInfo,
    TorchDistTrainerInitInfo,
    WeightTransferConfig,
    create_worker_engine,
    model_checksum,
    trainer_init,
)
from asyncwt._core.bytes import byte_view
from asyncwt._core.errors import ProtocolError
from asyncwt._core.meta import ParamMeta
from asyncwt._core.plan import Bucket, Slice, TransferPlan
from asyncwt._core.trainer_api import TrainerInitInfo
from asyncwt._delta.codec import (
    DELTA_HEADER_SIZE,
    DeltaHeader,
    Encoded,
    Encoding,
    apply_sparse,
    encode,
    sparse_chunks,
    unit_of,
)
from asyncwt._delta.sender import DeltaSender
from asyncwt._transports.wire import FRAME_SIZE
from asyncwt._worker.launch import start_worker, stop_worker

uvloop_only = pytest.mark.asyncio(loop_factories=["uvloop"])

SEED = 20261202


# -- the codec --------------------------------------------------------------------------


def _bucket(*lengths: int) -> Bucket:
    slices, at = [], 0
    for i, n in enumerate(lengths):
        slices.append(Slice(i, 0, n, at))
        at += -(-n // 64) * 64
    return Bucket(0, tuple(slices), at, sum(lengths))


def _decode(
    coded_header: DeltaHeader, body: bytes, base: torch.Tensor, unit: int, chunk: int = 1 << 18
) -> torch.Tensor:
    out = base.clone()
    units = out.numel() // unit
    for positions, values in sparse_chunks(
        coded_header, memoryview(body), units, unit, chunk=chunk
    ):
        apply_sparse([out], positions, values, unit)
    return out


@pytest.mark.parametrize("unit", [1, 2])
@pytest.mark.parametrize("changed", [0.0005, 0.01, 0.2, 0.9])
def test_encode_picks_the_smallest_lossless_encoding(unit: int, changed: float) -> None:
    generator = torch.Generator().manual_seed(int(changed * 1e4) + unit)
    old = torch.randint(0, 256, (200_000,), dtype=torch.uint8, generator=generator)
    new = old.clone()
    mask = torch.rand(old.numel(), generator=generator) < changed
    new[mask] = new[mask] + 1
    base = old.clone()
    coded = encode([new[:70_000], new[70_000:]], base, unit)
    assert torch.equal(base, new), "the trainer's copy holds what was sent"
    header = coded.header
    if header.encoding == Encoding.RAW:
        assert changed >= 0.2
        assert header.body_bytes == new.numel()
        return
    assert changed <= 0.2 and header.body_bytes < new.numel() * 0.75
    assert isinstance(coded.body, bytes) and len(coded.body) == header.body_bytes
    assert torch.equal(_decode(header, coded.body, old, unit), new)


def test_an_unchanged_payload_is_an_empty_sparse_body_with_its_digest() -> None:
    data = torch.arange(1000, dtype=torch.int16).view(torch.uint8)
    coded = encode([data], data.clone(), 2)
    assert coded.header.encoding == Encoding.SPARSE and coded.header.count == 0
    assert (
        coded.body == b""
        and coded.header.digest == xxhash.xxh3_128(bytes(byte_view(data))).digest()
    )
    assert torch.equal(_decode(coded.header, b"", data, 2), data)


def test_apply_sparse_spreads_positions_over_the_slices() -> None:
    destinations = [torch.zeros(6, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)]
    positions = torch.tensor([0, 2, 3, 4])  # 2-byte units across both slices
    values = torch.tensor([1, 2, 3, 4], dtype=torch.int16)
    apply_sparse(destinations, positions, values, 2)
    assert destinations[0].view(torch.int16).tolist() == [1, 0, 2]
    assert destinations[1].view(torch.int16).tolist() == [3, 4]


def _header(encoding: int, body: int, count: int) -> bytes:
    return (
        DeltaHeader(Encoding.RAW, body, count, bytes(16)).pack()[:4]
        + bytes([encoding])
        + DeltaHeader(Encoding.RAW, body, count, bytes(16)).pack()[5:]
    )


@pytest.mark.parametrize(
    ("data", "body", "message"),
    [
        (b"x" * 10, 10, r"^delta header should be 40 bytes, got 10$"),
        (
            b"XXXX" + _header(0, 100, 0)[4:],
            100,
            r"^bucket 0: delta header magic should be b'AWTD', got b'XXXX'$",
        ),
        (_header(9, 100, 0), 100, r"^bucket 0: delta encoding 9 is not one of \[0, 1, 2\]$"),
        (
            _header(0, 100, 0),
            99,
            r"^bucket 0: delta header says 100 body bytes, the frame carries 99$",
        ),
        (
            _header(0, 50, 0),
            50,
            r"^bucket 0: a RAW body should be the payload \(100 bytes, count 0\), got 50 bytes and count 0$",
        ),
        (
            _header(1, 60, 51),
            60,
            r"^bucket 0: a SPARSE body should hold 0 to 50 changes in fewer than 100 bytes, got 51 changes in 60 bytes$",
        ),
        (
            _header(2, 100, 5),
            100,
            r"^bucket 0: a ZSPARSE body should hold 0 to 50 changes in fewer than 100 bytes, got 5 changes in 100 bytes$",
        ),
        (
            _header(1, 31, 5),
            31,
            r"^bucket 0: a SPARSE body of 5 changes should be 30 bytes, got 31$",
        ),
    ],
)
def test_delta_header_is_checked_against_the_plan_before_the_body(
    data: bytes, body: int, message: str
) -> None:
    with pytest.raises(ProtocolError, match=message):
        DeltaHeader.unpack(data, _bucket(100), 2, body)


def test_sparse_body_positions_are_checked() -> None:
    header = DeltaHeader(Encoding.SPARSE, 12, 2, bytes(16))
    backwards = torch.tensor([3, 0], dtype=torch.int32).view(torch.uint8).tolist() + [0] * 4
    with pytest.raises(
        ProtocolError, match=r"^a sparse body's positions should increase strictly$"
    ):
        list(sparse_chunks(header, memoryview(bytes(backwards)), 50, 2))
    beyond = torch.tensor([10, 40], dtype=torch.int32).view(torch.uint8).tolist() + [0] * 4
    with pytest.raises(ProtocolError, match=r"^a sparse body names unit 50; the payload has 50$"):
        list(sparse_chunks(header, memoryview(bytes(beyond)), 50, 2))
    zipped = DeltaHeader(Encoding.ZSPARSE, 5, 2, bytes(16))
    with pytest.raises(ProtocolError, match=r"^a ZSPARSE body does not decompress"):
        list(sparse_chunks(zipped, memoryview(b"12345"), 50, 2))
    # A later chunk is checked on its own too: its first gap continues the last chunk.
    gaps = [0, 1, 1, 0]
    stalled = torch.tensor(gaps, dtype=torch.int32).view(torch.uint8).tolist() + [0] * 8
    four = DeltaHeader(Encoding.SPARSE, 24, 4, bytes(16))
    chunks = sparse_chunks(four, memoryview(bytes(stalled)), 50, 2, chunk=2)
    positions, _ = next(chunks)
    assert positions.tolist() == [0, 1]
    with pytest.raises(ProtocolError, match=r"^a sparse body's positions should increase"):
        next(chunks)


def _bomb(units: int, unit: int, **compressor: Any) -> tuple[DeltaHeader, bytes]:
    """A ZSPARSE body claiming every unit changed: it decompresses to (4 + unit)
    times the payload of zeros from a few dozen bytes."""
    body = zstandard.ZstdCompressor(**compressor).compress(bytes(units * (4 + unit)))
    return DeltaHeader(Encoding.ZSPARSE, len(body), units, bytes(16)), body


def test_a_zsparse_body_is_bounded_by_the_payload_before_it_is_decompressed() -> None:
    header, body = _bomb(50_000, 2)
    assert len(body) < 1000 and header.count * 6 == 300_000
    with pytest.raises(
        ProtocolError,
        match=r"^a ZSPARSE body of 50000 changes would decode to 300000 bytes; a sparse body "
        r"should be shorter than the payload \(100000 bytes\)$",
    ):
        next(sparse_chunks(header, memoryview(body), 50_000, 2))
    # Within the bound, the frame must declare the size its count implies.
    declared = zstandard.ZstdCompressor().compress(bytes(60))
    with pytest.raises(
        ProtocolError,
        match=r"^a ZSPARSE body of 2 changes should declare 12 bytes of content, its frame "
        r"declares 60$",
    ):
        next(
            sparse_chunks(
                DeltaHeader(Encoding.ZSPARSE, 9, 2, bytes(16)), memoryview(declared), 50, 2
            )
        )
    undeclared = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(12))
    with pytest.raises(ProtocolError, match=r"its frame declares no size$"):
        next(
            sparse_chunks(
                DeltaHeader(Encoding.ZSPARSE, 9, 2, bytes(16)), memoryview(undeclared), 50, 2
            )
        )


@pytest.mark.parametrize("encoding_changed", [0.01, 0.2])
def test_sparse_bodies_decode_the_same_in_any_chunk_size(encoding_changed: float) -> None:
    generator = torch.Generator().manual_seed(3)
    old = torch.randint(0, 1 << 15, (5000,), dtype=torch.int16, generator=generator)
    new = old.clone()
    changed = torch.randperm(5000, generator=generator)[: int(5000 * encoding_changed)]
    new[changed] += 1
    coded = encode([new.view(torch.uint8)], old.view(torch.uint8).clone(), 2)
    assert coded.header.encoding in (Encoding.SPARSE, Encoding.ZSPARSE)
    assert isinstance(coded.body, bytes)
    for chunk in (1, 7, 1 << 18):
        decoded = _decode(coded.header, coded.body, old.view(torch.uint8), 2, chunk=chunk)
        assert torch.equal(decoded, new.view(torch.uint8))


def test_delta_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"^delta should be a Delta, a bool or None, got 1$"):
        TcpTrainerInitInfo(rank=0, delta=1)  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"^delta\.full_every should be an int in \[0, 2147483648\], got -1$"
    ):
        Delta(full_every=-1)
    with pytest.raises(
        ValueError, match=r"^delta\.policy should be one of \['auto', 'always'\], got 'never'$"
    ):
        Delta(policy="never")
    with pytest.raises(TypeError, match=r"delta_full_every=4; it moved to delta=Delta\(full_every"):
        TcpTrainerInitInfo(rank=0, delta=True, delta_full_every=4)  # type: ignore[call-arg]
    assert TcpTrainerInitInfo(rank=0, delta=True).delta == Delta()
    assert TcpTrainerInitInfo(rank=0, delta=False).delta is None


def test_auto_policy_keeps_a_copy_and_sends_deltas_only_once_the_wire_is_slow() -> None:
    plan = TransferPlan.build([ParamMeta("w", torch.bfloat16, (4 << 20,))], bucket_bytes=8 << 20)
    state = DeltaSender(plan, policy="auto")
    assert state._rates.encode is not None, "the encoder is measured when the sender is made"
    state._rates.encode = 1e-9  # as if measured: 1 GB/s
    new = torch.randn(4 << 20).to(torch.bfloat16).view(torch.uint8)
    # Round 1: the wire is not measured yet, so the round keeps nothing.
    assert state.begin(1, [0]) == [False] and not state.keeping and state.keeps_nothing
    state.sent_raw(1 << 20, 1.0)  # too few bytes to measure the wire on their own
    state.sent_raw(7 << 20, 7.0)  # with the round's first: a slow wire, 1 MiB/s
    state.end(1)
    assert state.base_round == 0, "a round not kept leaves the copy of no round"
    # Round 2 keeps the copy (a delta pays on that wire); round 3 codes.
    assert state.begin(2, [0]) == [False] and state.keeping
    state.keep(plan.buckets[0], [new])
    state.end(2)
    assert state.base_round == 2 and state.host_bytes == plan.total_bytes
    assert state.begin(3, [2, 0]) == [True, False]
    state.abort()
    assert state.base_round == 2, "an aborted round that wrote nothing keeps the copy's round"
    # One round on a fast wire moves nothing (the median of the recent rounds counts)...
    state.sent_raw(8 << 20, 1e-6)
    state.abort()
    assert state.begin(3, [2]) == [True]
    state.abort()
    # ...a fast wire round after round stops the deltas and gives the copy back.
    for _ in range(3):
        state.sent_raw(8 << 20, 1e-6)
        state.abort()
    assert state.begin(3, [2]) == [False] and not state.keeping
    assert state.host_bytes == 0, "a copy no longer kept gives its memory back"
    state.end(3)
    assert state.base_round == 0
    always = DeltaSender(plan, policy="always")
    assert always.begin(1, [0]) == [False] and always.keeping
    always.keep(plan.buckets[0], [new])
    always.end(1)
    always.sent_raw(8 << 20, 1e-6)
    assert always.begin(2, [1, 0]) == [True, False]


# -- across processes -------------------------------------------------------------------


def both_workers(backend: str) -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """A plain `backend` worker (base: its live weights) and one with a transform
    (base: a shadow), as processes, until the generator closes."""
    started = []
    try:
        for extra in ([], ["--transform", "_models:identity_transform"]):
            started.append(
                start_worker("_models:mixed", "--backend", backend, *extra, env=worker_env())
            )
        yield started
    finally:
        for proc, _ in started:
            stop_worker(proc)


@pytest.fixture(scope="module")
def workers() -> Iterator[list[tuple[subprocess.Popen[bytes], str]]]:
    yield from both_workers("tcp")


def nudge(model: torch.nn.Module, seed: int, fraction: float) -> None:
    """Change about `fraction` of every parameter's elements (an optimizer step's shape)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.numel():
                mask = torch.rand(param.shape, generator=generator) < fraction
                param.add_(mask.to(param.dtype) * 0.25)


def delta_info(full_every: int = 0, **kwargs: object) -> TcpTrainerInitInfo:
    # policy "always": deterministic, every round that can be a delta is one
    info = info_for("tcp", delta=Delta(full_every=full_every, policy="always"), **kwargs)
    assert isinstance(info, TcpTrainerInitInfo)
    return info


def is_delta(stats: RoundStats) -> bool:
    return stats.wire_bytes < stats.bytes // 4


@uvloop_only
async def test_delta_rounds_are_bit_exact_and_small_on_both_kinds_of_worker(
    workers: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    await delta_trajectory([url for _, url in workers], delta_info(full_every=4))


async def delta_trajectory(urls: list[str], info: TrainerInitInfo) -> Any:
    """Nine rounds with `Delta(full_every=4)` in `info`, each bit-exact on every worker,
    each a delta where it can be; returns the engine's transport."""
    async with HttpClient(urls) as client:
        model = _models.mixed()
        _models.randomize(model, seed=1)
        engine = await trainer_init(info, client=client, source=ModuleSource(model))
        async with engine:
            kinds = []
            for i in range(9):
                if i:
                    nudge(model, seed=i, fraction=0.9 if i == 5 else 0.01)
                stats = await engine.send_weights(weight_version=f"v{i}")
                await assert_worker_has(client, model, f"v{i}")
                kinds.append(is_delta(stats))
                assert 0 < stats.wire_bytes <= stats.bytes + 64 * len(engine.plan.buckets)
            # 0: no base yet; 4 and 8: full_every; 5: most units changed (raw)
            assert kinds == [False, True, True, True, False, False, True, True, False]
            return engine.transport


@uvloop_only
async def test_a_worker_whose_base_differs_fails_the_digest_then_gets_a_full_round(
    workers: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    await digest_failure_then_full([url for _, url in workers], delta_info())


async def digest_failure_then_full(urls: list[str], info: TrainerInitInfo) -> None:
    """The trainer's copy of bucket 0 is made to claim the workers hold the new bytes
    already: it sends no change there, their rebuilt bucket differs, the round is not
    published, and the next round is full and bit-exact, the one after a delta."""
    async with HttpClient(urls) as client:
        model = _models.mixed()
        _models.randomize(model, seed=2)
        engine = await trainer_init(info, client=client, source=ModuleSource(model))
        async with engine:
            await engine.send_weights(weight_version="v0")
            nudge(model, seed=3, fraction=0.01)
            params = dict(model.named_parameters())
            bucket = engine.plan.buckets[0]
            new = torch.cat(
                [
                    params[engine.plan.params[s.param].name]
                    .detach()
                    .contiguous()
                    .reshape(-1)
                    .view(torch.uint8)[s.start : s.end]
                    for s in bucket.slices
                ]
            )
            copy = engine.transport.state._copy  # type: ignore[attr-defined]
            copy[: bucket.payload_bytes] = new
            with pytest.raises(AsyncwtError, match=r"does not match the trainer's digest"):
                await engine.send_weights(weight_version="bad")
            for status in await client.weights_status(checksum=True):
                assert status["weight_version"] == "v0"
            nudge(model, seed=4, fraction=0.01)
            stats = await engine.send_weights(weight_version="v1")
            assert not is_delta(stats), "a worker that failed its check gets a full round"
            await assert_worker_has(client, model, "v1")
            nudge(model, seed=5, fraction=0.01)
            stats = await engine.send_weights(weight_version="v2")
            assert is_delta(stats)
            await assert_worker_has(client, model, "v2")


@uvloop_only
async def test_a_zsparse_bomb_fails_its_round_before_decompressing_and_the_next_is_full(
    workers: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    """The trainer's coder is made to send bucket 0 as a ZSPARSE body of a few dozen
    bytes that claims every unit changed (3x the payload once decompressed): each
    worker refuses it for its size before decompressing, the round publishes
    nothing, and the next rounds (full, then a delta) are bit-exact without a new
    trainer_init."""
    async with HttpClient([url for _, url in workers]) as client:
        model = _models.mixed()
        _models.randomize(model, seed=8)
        engine = await trainer_init(delta_info(), client=client, source=ModuleSource(model))
        async with engine:
            await engine.send_weights(weight_version="v0")
            state = engine.transport.state  # type: ignore[attr-defined]
            coder = state.encode
            bucket = engine.plan.buckets[0]
            units = bucket.payload_bytes // unit_of(bucket)

            def crafted(b: Bucket, segments: list[torch.Tensor]) -> Encoded:
                coded = coder(b, segments)
                if b.index != 0:
                    return coded
                header, body = _bomb(units, unit_of(b))
                return Encoded(dataclasses.replace(header, digest=coded.header.digest), body)

            state.encode = crafted
            nudge(model, seed=9, fraction=0.01)
            size = units * (4 + unit_of(bucket))
            with pytest.raises(
                AsyncwtError,
                match=rf"a ZSPARSE body of {units} changes would decode to {size} bytes; a "
                rf"sparse body should be shorter than the payload \({bucket.payload_bytes} bytes\)",
            ):
                await engine.send_weights(weight_version="bomb")
            del state.encode
            for status in await client.weights_status():
                assert status["weight_version"] == "v0"
            stats = await engine.send_weights(weight_version="v1")
            assert not is_delta(stats), "a worker that failed a delta gets a full round"
            await assert_worker_has(client, model, "v1")
            nudge(model, seed=10, fraction=0.01)
            assert is_delta(await engine.send_weights(weight_version="v2"))
            await assert_worker_has(client, model, "v2")


@uvloop_only
async def test_a_new_trainer_sends_a_full_round_first(
    workers: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    urls = [url for _, url in workers]
    async with HttpClient(urls) as client:
        model = _models.mixed()
        for seed in (6, 7):
            _models.randomize(model, seed=seed)
            engine = await trainer_init(delta_info(), client=client, source=ModuleSource(model))
            async with engine:
                stats = await engine.send_weights(weight_version=f"first-{seed}")
                assert stats.wire_bytes == stats.bytes
                await assert_worker_has(client, model, f"first-{seed}")
                nudge(model, seed=seed, fraction=0.01)
                assert is_delta(await engine.send_weights(weight_version=f"next-{seed}"))
                await assert_worker_has(client, model, f"next-{seed}")


# -- faults -----------------------------------------------------------------------------

CUTS = 8


@uvloop_only
async def test_a_delta_round_cut_at_seeded_offsets_publishes_nothing_and_recovers(
    workers: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    _, url = workers[1]  # the shadowed worker: a cut may leave its shadow half-written
    rng = random.Random(SEED)
    async with ProxyClient(url, timeout=30) as client:
        model = _models.mixed()
        for i in range(CUTS):
            info = delta_info(timeouts=SMALL_TIMEOUTS)
            engine = await trainer_init(info, client=client, source=ModuleSource(model))
            async with engine:
                _models.randomize(model, seed=100 + i)
                await engine.send_weights(weight_version=f"full-{i}")
                nudge(model, seed=200 + i, fraction=0.01)
                stats = await engine.send_weights(weight_version=f"good-{i}")
                assert is_delta(stats)
                await assert_worker_has(client, model, f"good-{i}")
                headers = (len(engine.plan.buckets) + 1) * FRAME_SIZE
                headers += DELTA_HEADER_SIZE * len(engine.plan.buckets)
                assert client.proxy is not None
                # The same units change again (their values differ): about as many bytes.
                client.proxy.arm(rng.randrange(int(0.9 * (stats.wire_bytes + headers))))
                nudge(model, seed=200 + i, fraction=0.01)
                with anyio.fail_after(15), pytest.raises(AsyncwtError):
                    await engine.send_weights(weight_version=f"cut-{i}")
                (status,) = await client.weights_status(checksum=True)
                assert status["weight_version"] == f"good-{i}"
            client.close_proxy()
            # A new init (the connection broke): its first round is full and bit-exact.
            engine = await trainer_init(delta_info(), client=client, source=ModuleSource(model))
            async with engine:
                stats = await engine.send_weights(weight_version=f"after-{i}")
                assert stats.wire_bytes == stats.bytes
                await assert_worker_has(client, model, f"after-{i}")
            client.close_proxy()


CANCELS = 10


@uvloop_only
async def test_a_delta_round_cancelled_at_seeded_points_leaves_the_previous_version(
    workers: list[tuple[subprocess.Popen[bytes], str]],
) -> None:
    kinds = await cancelled_rounds([url for _, url in workers], delta_info(), SEED + 1, CANCELS)
    print(f"rounds after a cancel that went as deltas: {kinds}")


async def cancelled_rounds(
    urls: list[str], info: TrainerInitInfo, seed: int, cancels: int
) -> list[bool]:
    """Cancel `cancels` delta rounds at seeded points: each leaves every worker on the
    previous version (or, finished after all, on its own), and the next round is
    bit-exact and leaks no thread, task or descriptor. Whether each next round went
    as a delta, in order."""
    rng = random.Random(seed)
    delay = 0.03  # per parameter: a round of ~0.25 s
    async with HttpClient(urls) as client:
        model = _models.mixed()
        _models.randomize(model, seed=9)
        source = FaultySource(model)
        engine = await trainer_init(info, client=client, source=source)
        async with engine:
            await engine.send_weights(weight_version="v0")
            fds, tasks = open_fds(), asyncio.all_tasks()
            kinds = []
            for i in range(1, cancels + 1):
                good = model_checksum(model)
                source.delay = delay
                nudge(model, seed=400 + i, fraction=0.01)
                with anyio.fail_after(20), anyio.move_on_after(rng.uniform(0.0, delay * 10)):
                    await engine.send_weights(weight_version=f"cancelled-{i}")
                for status in await client.weights_status(checksum=True):
                    if status["weight_version"] != f"cancelled-{i}":
                        assert status["weight_version"] == f"v{i - 1}"
                        assert status["weights_incomplete"] or status["checksum"] == good
                source.delay = 0.0
                nudge(model, seed=500 + i, fraction=0.01)
                started = time.monotonic()
                stats = await engine.send_weights(weight_version=f"v{i}")
                assert time.monotonic() - started < 10
                kinds.append(is_delta(stats))
                await assert_worker_has(client, model, f"v{i}")
                wait_until(lambda: not threads_in_asyncwt(), 10, "asyncwt threads to finish")
                assert asyncio.all_tasks() == tasks
                assert open_fds() <= fds + 1
            return kinds


def _worker(backend: str = "tcp") -> Any:
    return create_worker_engine(WeightTransferConfig(backend=backend), model=_models.mixed())


def test_backends_without_delta_rounds_have_no_delta_setting() -> None:
    for cls in (TorchDistTrainerInitInfo, CudaIpcTrainerInitInfo):
        assert "delta" not in {f.name for f in dataclasses.fields(cls)}
        with pytest.raises(TypeError, match="unexpected keyword argument 'delta'"):
            cls(rank=0, delta=True)  # type: ignore[call-arg]


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", ["tcp", "shm"])
async def test_only_the_worker_that_lost_its_base_gets_a_full_round(backend: str) -> None:
    workers = [_worker(backend), _worker(backend)]
    model = _models.mixed()
    _models.randomize(model, seed=11)
    client = LocalClient(workers)
    info = info_for(backend, delta=Delta(policy="always"))
    engine = await trainer_init(info, client=client, source=ModuleSource(model))
    try:
        await engine.send_weights(weight_version="v0")
        nudge(model, seed=12, fraction=0.01)
        workers[1]._delta.base_round = 0  # as after a failed round on that worker alone
        stats = await engine.send_weights(weight_version="v1")
        # The mean of a delta to one worker and the payload to the other.
        assert stats.bytes / 2 < stats.wire_bytes < stats.bytes * 0.6
        for worker in workers:
            assert worker.weight_version == "v1"
            assert model_checksum(worker.model) == model_checksum(model)
        nudge(model, seed=13, fraction=0.01)
        assert is_delta(await engine.send_weights(weight_version="v2"))
    finally:
        await engine.shutdown()
        for worker in workers:
            worker.shutdown()
