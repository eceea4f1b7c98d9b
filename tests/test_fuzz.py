"""Fuzzing both planes with hypothesis: bad input ends in a clear error, never a crash.

Control plane: every route the worker server registers (read from its router, so a
new route is fuzzed without editing this file) gets arbitrary JSON (deep nesting,
integers past 2**63, NaN and Infinity as raw text, unicode), mutations of that route's
valid body (a key dropped or added, a value of the wrong type or an absurd one),
bytes that are not JSON, any content type, wrong methods and unknown paths, and raw
HTTP with absurd Content-Lengths, bodies cut short and bad Content-Encodings. No
answer may be a 5xx other than a 500 naming an asyncwt error (the engine failing a
well-formed request, which the server documents); every 4xx is JSON whose message
says what is wrong; and afterwards a real trainer still inits the worker and
completes a round.

Data plane: the worker's frame reader (tcp, and the shared ring) gets a valid
round broken in one place (any field of the 48-byte header, nbytes up to 2**64 - 1),
truncated, or preceded by stray bytes; the trainer's listener gets handshakes with
bytes before the HELLO, mutated HELLOs and wrong proofs; a worker's handshake gets a
trainer answering garbage; the trainer's READY reader gets malformed worker frames.
Each must end in a `TransferError` subclass without reading or allocating more than
the plan allows, and the listener must still admit a legitimate worker afterwards.

Repeatable: `derandomize=True` and no example database, so the same tree and the
same pytest command (CI's included) run the same cases, and a failure replays as is.
(Hypothesis also draws constants from the modules loaded, so running this file alone
or within the whole suite picks different cases; their number is the same.)

Fuzz cases run: the terminal summary of

    python -m pytest -q tests/test_fuzz.py

ends with one line `fuzz cases run: N (test: n, ...)`: the examples each test
executed. The bugs this fuzzing found (a malformed plan, an unencodable host, a
replayed round id, a round id past 64 bits, a plan too large to lay out) each have
a regression test below.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import gzip
import http.client
import json
import logging
import math
import socket
import struct
import threading
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import _models
import anyio
import pytest
import torch
from _fuzzkit import (
    EXPECTED,
    EXTREMES,
    RING_SLOTS,
    TOKEN,
    LoopThread,
    bounded_reads,
    fake_trainer,
    frame_receiver,
    loop_thread,
    receive,
    recv_all,
    small_plan,
    trainer_links,
    valid_round,
)
from aiohttp import web
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from asyncwt import (
    AsyncwtError,
    HttpClient,
    ModuleSource,
    ParamMeta,
    TcpTrainerInitInfo,
    Timeouts,
    WeightTransferConfig,
    model_checksum,
    trainer_init,
)
from asyncwt._core.plan import TransferPlan
from asyncwt._transports.link import Peer, connect_link
from asyncwt._transports.pool import ReceivePool
from asyncwt._transports.wire import (
    ABORT_REASON_MAX,
    CHALLENGE_SIZE,
    FRAME_MAGIC,
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
from asyncwt._worker.server import build_app

# -- how many cases ran -----------------------------------------------------------------

CASES: Counter[str] = Counter()
"""Examples executed, per fuzz test (printed once at the end of the session)."""


class _CaseSummary:
    """A pytest plugin that ends the terminal summary with the fuzz cases run."""

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if CASES:
            each = ", ".join(f"{name}: {count}" for name, count in CASES.items())
            terminalreporter.write_line(f"fuzz cases run: {sum(CASES.values())} ({each})")


_SUMMARY = _CaseSummary()


@pytest.fixture(scope="module", autouse=True)
def _print_case_counts(request: pytest.FixtureRequest) -> None:
    """Register the summary line (once per session)."""
    if not request.config.pluginmanager.is_registered(_SUMMARY):
        request.config.pluginmanager.register(_SUMMARY, "asyncwt-fuzz-cases")


def fuzz(max_examples: int) -> settings:
    """Hypothesis settings of every test here: repeatable, no deadline, no database."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=False,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.filter_too_much,
        ],
    )


# == control plane: the worker server ===================================================

# -- JSON values ------------------------------------------------------------------------


class Raw(str):
    """JSON text sent verbatim: numbers Python's json module would not write itself."""


ABSURD_INTS = [
    0,
    -1,
    1,
    2**31,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63),
    10**30,
]
RAW_NUMBERS = [
    Raw(t) for t in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1E-400", "-0", "9" * 5000)
]
NASTY_STRINGS = [
    "",
    "\x00",
    "a\x00b",
    "\udcff",
    "\ud800x",
    "a" * 300,
    "x" * 5000,
    "0",
    "::1",
    "0x7f.1",
]
"""Strings that fail or resolve without DNS (one may land in a host field)."""

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from(ABSURD_INTS),
    st.floats(),  # NaN and ±Infinity included: json.dumps writes them as raw NaN/Infinity
    st.sampled_from(RAW_NUMBERS),
    st.text(max_size=16),
    st.sampled_from(NASTY_STRINGS),
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)


def dumps(value: Any) -> str:
    """`value` as JSON text, `Raw` leaves written as they are."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {dumps(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(dumps(v) for v in value) + "]"
    return json.dumps(value)


def _kind(value: Any) -> str:
    """The JSON kind of a value, as the server names it in its errors."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float, Raw)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _other_kind(kind: str, value: Any) -> bool:
    return _kind(value) != kind


PathKey = tuple[Any, ...]


def _at(value: Any, path: PathKey) -> Any:
    for step in path:
        value = value[step]
    return value


def _absurd(value: Any) -> list[Any]:
    """Values of the same JSON kind as `value` at the edges (for a string: nasty ones
    and near misses), or of any kind for the rest."""
    numbers = [*ABSURD_INTS, *RAW_NUMBERS, math.nan, -0.5, 1.5]
    if _kind(value) == "number":
        return numbers
    if isinstance(value, str):
        return [*NASTY_STRINGS, value.upper(), value.swapcase()]
    return [*numbers, *NASTY_STRINGS]


@st.composite
def _places(draw: st.DrawFn, value: Any) -> PathKey:
    """A place in a JSON value, by a walk from the root that goes one level deeper with
    probability 3/4: each field of an object is as likely as its siblings, however
    much sits under them. The root itself only when it is empty or not a container."""
    path: PathKey = ()
    while isinstance(value, (dict, list)) and value and (not path or draw(st.integers(0, 3)) > 0):
        step = draw(st.sampled_from(list(value) if isinstance(value, dict) else range(len(value))))
        path, value = (*path, step), value[step]
    return path


@st.composite
def mutated(draw: st.DrawFn, valid: Any) -> Any:
    """`valid` with 1-3 mutations anywhere in it: a key or element dropped, an unknown
    key added, a value of another JSON type, an absurd number or a nasty string."""
    value = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(_places(value))
        target = _at(value, path)
        op = draw(st.sampled_from(["drop", "add", "retype", "absurd"]))
        if op == "drop" and path:
            del _at(value, path[:-1])[path[-1]]
            continue
        if op == "add" and isinstance(target, dict):
            target[draw(st.text(max_size=10))] = draw(json_values)
            continue
        if op == "add" and isinstance(target, list):
            target.append(draw(json_values))
            continue
        if op == "absurd":
            new = draw(st.sampled_from(_absurd(target)))
        else:
            new = draw(json_values.filter(functools.partial(_other_kind, _kind(target))))
        if not path:
            value = new
        else:
            _at(value, path[:-1])[path[-1]] = new
    return value


CONTENT_TYPES = [
    None,
    "application/json",
    "application/json; charset=utf-16",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=zz",
    "application/octet-stream",
    "*/*",
    "nonsense",
]
NOT_JSON = st.one_of(
    st.binary(max_size=64),
    st.sampled_from(
        [
            b"{",
            b'{"a":',
            b"[" * 5000 + b"]" * 5000,
            b"\xef\xbb\xbf{}",
            b"\xff\xfe{\x00}\x00",
            b"{}{}",
            b"nul",
            b"'x'",
        ]
    ),
)


# -- the server under fuzz --------------------------------------------------------------


@dataclass
class Reply:
    status: int
    content_type: str
    text: str


class Recording(HttpClient):
    """An HttpClient that keeps the last init info it sent (a real trainer's)."""

    sent: ClassVar[dict[str, Any]] = {}

    async def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        Recording.sent = copy.deepcopy(init_info)
        await super().init_weight_transfer_engine(init_info)


class Worker:
    """A worker server (tcp backend, `_models.mixed`) served from a loop thread.

    `valid` holds each POST route's valid body. The init body is a real trainer's init
    info pointing at `dead_port`, bound but never listening, so an init that passes
    every check fails fast (connection refused) instead of reaching a trainer.
    """

    def __init__(self, looper: LoopThread) -> None:
        self.looper = looper
        self.app = build_app(_models.mixed(), config=WeightTransferConfig())
        self.runner = web.AppRunner(self.app)
        self.port = looper.run(self._start())
        self.url = f"http://127.0.0.1:{self.port}"
        self.routes = sorted(
            {
                (r.method, r.resource.canonical)
                for r in self.app.router.routes()
                if r.resource is not None
            }
        )
        self._dead = socket.socket()
        self._dead.bind(("127.0.0.1", 0))
        self.dead_port: int = self._dead.getsockname()[1]
        self.initialised = False
        self.rounds = 0
        self._seed = 0
        self.ensure_initialised()
        init_info = dict(Recording.sent, port=self.dead_port)
        self.digest: str = init_info["plan"]["digest"]
        self.valid: dict[str, Any] = {
            "/init_weight_transfer_engine": {"init_info": init_info},
            "/update_weights": {"update_info": {"round_id": 2, "plan_digest": self.digest}},
            "/finish_weight_update": {"weight_version": "v"},
        }

    async def _start(self) -> int:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        port: int = self.runner.addresses[0][1]
        return port

    def close(self) -> None:
        self.looper.run(self.runner.cleanup())
        self._dead.close()

    def request(
        self, method: str, path: str, body: bytes = b"", content_type: str | None = None
    ) -> Reply:
        """One HTTP request on a fresh connection; the reply, error statuses included."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            headers = {} if content_type is None else {"Content-Type": content_type}
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            text = response.read().decode("utf-8", "replace")
            return Reply(response.status, response.msg.get_content_type(), text)
        finally:
            conn.close()

    def status(self) -> dict[str, Any]:
        reply = self.request("GET", "/weights_status?checksum=1")
        assert reply.status == 200, reply
        status: dict[str, Any] = json.loads(reply.text)
        return status

    def legitimate_round(self, version: str) -> None:
        """A real trainer inits the worker and completes a round; the worker shows it."""
        self._seed += 1  # new weights each time: the checksum proves this round landed
        model = _models.mixed()
        _models.randomize(model, self._seed)
        info = TcpTrainerInitInfo(
            rank=0,
            bucket_bytes=_models.BUCKET_BYTES,
            timeouts=Timeouts(connect=5.0, recv=5.0, rpc=20.0),
        )

        async def run() -> None:
            async with Recording(self.url, timeout=20) as client:
                engine = await trainer_init(info, client=client, source=ModuleSource(model))
                async with engine:
                    await engine.send_weights(weight_version=version)

        self.looper.run(run())
        status = self.status()
        assert status["weight_version"] == version
        assert status["checksum"] == model_checksum(model)
        assert status["initialized"] is True and status["weights_incomplete"] is False
        self.initialised, self.rounds = True, 1

    def ensure_initialised(self) -> None:
        """After a fuzzed shutdown, init again so the next cases reach the engine."""
        if not self.initialised:
            self.legitimate_round("fuzz-setup")

    def answered(self, path: str, reply: Reply) -> None:
        """Track the engine's state from a reply the fuzzer provoked: after a shutdown, or
        a failed update (which may break the data connection), init again."""
        if path == "/shutdown_weight_transfer_engine" and reply.status == 200:
            self.initialised = False
        if path == "/update_weights" and reply.status == 500:
            self.initialised = False


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    """One worker server for every control-plane test (not one per example)."""
    with loop_thread() as looper:
        served = Worker(looper)
        try:
            yield served
        finally:
            served.close()


# -- what every answer must look like ---------------------------------------------------

ALLOWED_KEYS = {
    "/init_weight_transfer_engine": {"init_info"},
    "/start_weight_update": set(),
    "/update_weights": {"update_info"},
    "/finish_weight_update": {"weight_version"},
    "/shutdown_weight_transfer_engine": set(),
}
"""The body keys of each POST route the server documents."""

DOCUMENTED_4XX = {400, 404, 405, 409, 413}


def _asyncwt_errors() -> set[str]:
    found, todo = set(), [AsyncwtError]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return found


ASYNCWT_ERRORS = _asyncwt_errors()


def expected_error(path: str, raw: bytes) -> str | None:
    """How the 400 for `raw` must start, per the checks every route makes on its body;
    None when the body passes them (or `path` is not a documented POST route)."""
    if path not in ALLOWED_KEYS or not raw.strip():
        return None
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return "request body should be a JSON object: "
    if not isinstance(value, dict):
        return f"request body should be a JSON object, got a JSON {_kind(value)}"
    unknown = sorted(set(value) - ALLOWED_KEYS[path])
    if unknown:
        return f"unknown keys {unknown} in request body; expected keys: "
    for key in ("init_info", "update_info"):
        if key in value and not isinstance(value[key], dict):
            return f"{key} should be a JSON object, got a JSON {_kind(value[key])}"
    version = value.get("weight_version")
    if version is not None and not isinstance(version, str):
        return f"weight_version should be a string or null, got a JSON {_kind(version)}"
    return None


REPLIES: Counter[str] = Counter()
"""Replies the route fuzzing got, by route and status (printed per test: `-rP`)."""


def check_reply(method: str, path: str, reply: Reply, *, expected: str | None = None) -> None:
    """Never a 5xx but a 500 naming an asyncwt error; a 4xx is JSON naming the problem."""
    REPLIES[f"{method} {path} {reply.status}"] += 1
    assert "Traceback" not in reply.text, reply
    if method == "HEAD":
        assert reply.status < 500, reply
        return
    if (method, path, reply.status) == ("GET", "/metrics", 200):  # Prometheus' text format
        assert reply.content_type == "text/plain", reply
        assert "asyncwt_worker_rounds_total" in reply.text, reply
        return
    assert reply.content_type == "application/json", reply
    body = json.loads(reply.text)
    if expected is not None:
        assert reply.status == 400 and body["error"].startswith(expected), (expected, reply)
    if reply.status < 300:
        assert reply.status == 200 and isinstance(body, dict), reply
        return
    assert list(body) == ["error"] and isinstance(body["error"], str), reply
    error = body["error"]
    if reply.status in DOCUMENTED_4XX:
        assert error.strip(), reply
        return
    assert reply.status == 500, reply  # no other 5xx, ever
    name = error.split(":", 1)[0]
    assert name in ASYNCWT_ERRORS, (
        f"{method} {path}: a bare {name} (the server's bug branch): {error}"
    )


def _starts_a_round(worker: Worker, body: Any) -> bool:
    """Whether an update body is a legitimate next round (it would wait for a trainer)."""
    info = (
        body.get("update_info") if isinstance(body, dict) and set(body) == {"update_info"} else None
    )
    if not isinstance(info, dict) or set(info) != {"round_id", "plan_digest"}:
        return False
    round_id = info["round_id"]
    return (
        type(round_id) is int
        and worker.rounds < round_id < 2**64
        and info["plan_digest"] == worker.digest
    )


def _plan_explodes(body: Any) -> bool:
    """Whether an init body's plan declares a parameter far larger than any model here:
    building it would take long (plans past MAX_BUCKETS are refused up front, see
    test_a_huge_plan_is_refused_before_it_is_built)."""
    try:
        params = body["init_info"]["plan"]["params"]
        sizes = [math.prod(abs(int(d)) for d in entry[2]) for entry in params]
    except (KeyError, IndexError, TypeError, ValueError, OverflowError):
        return False  # malformed: refused before anything is built
    return max(sizes, default=0) > 2**24


# -- control-plane fuzz tests -----------------------------------------------------------


def test_the_router_is_enumerated(worker: Worker) -> None:
    """The fuzz tests cover what the router registers: every documented route at least."""
    assert {path for _, path in worker.routes} >= {*ALLOWED_KEYS, "/weights_status"}
    assert ("GET", "/weights_status") in worker.routes


def test_every_route_answers_arbitrary_bodies_with_a_clear_json_error(worker: Worker) -> None:
    """Arbitrary JSON, non-JSON and empty bodies, any content type, any method, unknown
    paths: a documented 4xx whose message names the problem, or a success."""
    methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])
    paths = st.sampled_from(sorted({p for _, p in worker.routes}))
    unknown = st.text("abcxyz_/-.0123456789", min_size=1, max_size=20).map(lambda s: "/" + s)
    requests = st.one_of(
        st.sampled_from(worker.routes),
        st.sampled_from(worker.routes),
        st.tuples(methods, paths),
        st.tuples(methods, unknown),
    )
    bodies = st.one_of(
        json_values.map(lambda v: dumps(v).encode()), NOT_JSON, st.sampled_from([b"", b" \n"])
    )

    @fuzz(400)
    @given(request=requests, raw=bodies, content_type=st.sampled_from(CONTENT_TYPES))
    def one(request: tuple[str, str], raw: bytes, content_type: str | None) -> None:
        CASES["routes: arbitrary bodies"] += 1
        method, path = request
        worker.ensure_initialised()
        reply = worker.request(method, path, raw, content_type)
        worker.answered(path, reply)
        registered = {p for _, p in worker.routes}
        if path not in registered:
            assert reply.status == 404, reply
        elif (method, path) not in worker.routes:
            assert reply.status == 405, reply
        elif path == "/weights_status" and method == "GET":
            assert reply.status == 200 and set(json.loads(reply.text)) == {
                "weight_version",
                "weights_incomplete",
                "checksum",
                "backend",
                "initialized",
                "untouched_params",
            }
        check_reply(
            method, path, reply, expected=expected_error(path, raw) if method == "POST" else None
        )

    REPLIES.clear()
    one()
    print(f"arbitrary bodies: {dict(sorted(REPLIES.items()))}")
    worker.legitimate_round("after-arbitrary-bodies")


def test_mutated_valid_bodies_reach_the_engine_and_never_break_the_server(worker: Worker) -> None:
    """Each route's valid body, mutated (keys dropped or added, wrong types, absurd
    numbers up to 2**64 and beyond, NaN, nasty strings), on an initialised worker."""
    posts = [path for method, path in worker.routes if method == "POST"]
    # Every POST route; those with a body worth mutating (init, update, finish) twice as often.
    paths = st.one_of(st.sampled_from(posts), st.sampled_from(sorted(worker.valid)))

    @fuzz(600)
    @given(path=paths, data=st.data(), content_type=st.sampled_from(CONTENT_TYPES))
    def one(path: str, data: st.DataObject, content_type: str | None) -> None:
        body = data.draw(mutated(worker.valid.get(path, {})), label="body")
        # A legitimate round would wait for a trainer that sends nothing; a plan that
        # explodes is the known unbounded build, pinned by its own test.
        assume(not (path == "/update_weights" and _starts_a_round(worker, body)))
        assume(not (path == "/init_weight_transfer_engine" and _plan_explodes(body)))
        CASES["routes: mutated valid bodies"] += 1
        worker.ensure_initialised()
        raw = dumps(body).encode()
        reply = worker.request("POST", path, raw, content_type)
        worker.answered(path, reply)
        check_reply("POST", path, reply, expected=expected_error(path, raw))

    REPLIES.clear()
    one()
    print(f"mutated valid bodies: {dict(sorted(REPLIES.items()))}")
    worker.legitimate_round("after-mutations")


CONTENT_LENGTHS = [
    str(2**63 - 1),
    str(2**63),
    str(2**64),
    "-1",
    "abc",
    "1e3",
    "+5",
    "0x10",
    "9" * 40,
]


@dataclass
class RawRequest:
    """Raw HTTP bytes; `cut` when the body is shorter than the request declares."""

    data: bytes
    cut: bool


@st.composite
def raw_requests(draw: st.DrawFn, routes: list[tuple[str, str]]) -> RawRequest:
    """POSTs with absurd or lying Content-Lengths, bad chunking and bad Content-Encodings."""
    _, path = draw(st.sampled_from([r for r in routes if r[0] == "POST"]))
    body = draw(st.one_of(json_values.map(lambda v: dumps(v).encode()), st.binary(max_size=32)))
    head = f"POST {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n"
    style = draw(st.sampled_from(["absurd-length", "short-body", "chunked", "encoded"]))
    if style == "absurd-length":
        length = draw(st.sampled_from(CONTENT_LENGTHS))
        cut = length.isdigit() and int(length) > len(body)
        return RawRequest(f"{head}Content-Length: {length}\r\n\r\n".encode() + body, cut)
    if style == "short-body":
        extra = draw(st.integers(1, 2**20))
        return RawRequest(
            f"{head}Content-Length: {len(body) + extra}\r\n\r\n".encode() + body, True
        )
    if style == "chunked":
        size = draw(
            st.sampled_from(
                ["7fffffffffffffff", "ffffffffffffffffff", "-1", "zz", f"{len(body):x}"]
            )
        )
        chunk = f"{size}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        cut = size == "7fffffffffffffff"
        return RawRequest(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + chunk, cut)
    encoding = draw(st.sampled_from(["gzip", "deflate", "br", "identity", "bogus"]))
    payload = gzip.compress(body) if draw(st.booleans()) and encoding == "gzip" else body
    data = (
        f"{head}Content-Encoding: {encoding}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return RawRequest(data, False)


def test_raw_http_with_absurd_lengths_and_cut_bodies_is_refused_cleanly(
    worker: Worker, caplog: pytest.LogCaptureFixture
) -> None:
    """Content-Length up to 2**64 and garbage, bodies cut short, chunk sizes past 2**63,
    Content-Encodings the body does not match: a 4xx or a closed connection, never a
    5xx, never a traceback in the server log; the server keeps serving."""

    @fuzz(150)
    @given(request=raw_requests(worker.routes))
    def one(request: RawRequest) -> None:
        CASES["routes: raw HTTP"] += 1
        with socket.create_connection(("127.0.0.1", worker.port), timeout=10) as sock:
            sock.sendall(request.data)
            if request.cut:
                return  # the client gives up mid-body: closing is all there is to see
            answer = recv_all(sock, 1 << 16)
        if answer:  # aiohttp closes on what its parser refuses (no answer) or says 400
            status = int(answer.split(b" ", 2)[1])
            assert status < 500, answer

    with caplog.at_level(logging.ERROR, logger="asyncwt.server"):
        one()
        worker.status()
        worker.looper.run(_settle())
    assert [r.getMessage() for r in caplog.records if r.name == "asyncwt.server"] == []
    worker.legitimate_round("after-raw-http")


async def _settle() -> None:
    """Let the server's loop process the connections the fuzzer closed."""
    await asyncio.sleep(0.2)


# -- the bugs the fuzzing found outside the server (reported; pinned until fixed) --------


def _post_json(worker: Worker, path: str, body: Any) -> Reply:
    return worker.request("POST", path, dumps(body).encode(), "application/json")


def test_a_malformed_plan_at_init_is_a_400(worker: Worker) -> None:
    """A plan without params, or with a dimension of Infinity, is the caller's error."""
    init_info = worker.valid["/init_weight_transfer_engine"]["init_info"]
    plan = init_info["plan"]
    for bad in (
        {k: v for k, v in plan.items() if k != "params"},
        {**plan, "params": [["w", "float32", [Raw("1e400")]]]},
    ):
        reply = _post_json(
            worker, "/init_weight_transfer_engine", {"init_info": {**init_info, "plan": bad}}
        )
        assert reply.status == 400, reply


def test_an_unencodable_host_at_init_is_a_400(worker: Worker) -> None:
    init_info = worker.valid["/init_weight_transfer_engine"]["init_info"]
    reply = _post_json(
        worker, "/init_weight_transfer_engine", {"init_info": {**init_info, "host": "a" * 300}}
    )
    assert reply.status == 400, reply


def test_a_replayed_round_id_is_a_4xx(worker: Worker) -> None:
    worker.ensure_initialised()
    reply = _post_json(
        worker, "/update_weights", {"update_info": {"round_id": 1, "plan_digest": worker.digest}}
    )
    assert 400 <= reply.status < 500, reply


def test_a_round_id_past_64_bits_is_a_4xx_and_keeps_the_link(worker: Worker) -> None:
    worker.ensure_initialised()
    try:
        body = {"update_info": {"round_id": 2**64, "plan_digest": worker.digest}}
        reply = _post_json(worker, "/update_weights", body)
        assert 400 <= reply.status < 500, reply
        _post_json(worker, "/start_weight_update", {})
        reply = _post_json(
            worker,
            "/update_weights",
            {"update_info": {"round_id": 2, "plan_digest": worker.digest}},
        )
        assert "broke the connection" not in reply.text, reply  # the link survived
    finally:
        worker.initialised = False  # whatever happened, start the next test afresh


def test_a_huge_plan_is_refused_before_it_is_built(worker: Worker) -> None:
    """An init whose plan declares 2**63 elements (as a fuzzed init may): a 400 naming
    MAX_BUCKETS, decided before any bucket is laid out (that layout would never end)."""
    init_info = worker.valid["/init_weight_transfer_engine"]["init_info"]
    plan = {**init_info["plan"], "params": [["w32", "float32", [2**63]]]}
    tracemalloc.start()
    try:
        reply = _post_json(
            worker, "/init_weight_transfer_engine", {"init_info": {**init_info, "plan": plan}}
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reply.status == 400, reply
    assert "MAX_BUCKETS" in reply.text, reply
    assert peak < 1 << 20, f"{peak} bytes allocated for a plan that is refused"


def test_a_plan_that_does_not_fit_the_model_is_a_409_naming_the_parameter(worker: Worker) -> None:
    """A well-formed plan for another model (a 2 GiB parameter this model lacks) is
    refused with a 409 Conflict that names the parameter, and nothing changes."""
    init_info = worker.valid["/init_weight_transfer_engine"]["init_info"]
    plan = TransferPlan.build([ParamMeta("w32", torch.float32, (2**29,))], bucket_bytes=256 << 10)
    reply = _post_json(
        worker, "/init_weight_transfer_engine", {"init_info": {**init_info, "plan": plan.to_wire()}}
    )
    assert reply.status == 409, reply
    assert "PlanMismatchError" in reply.text and "'w32'" in reply.text, reply


# == data plane ==========================================================================

u32 = st.one_of(st.sampled_from([v for v in EXTREMES if v < 2**32]), st.integers(0, 2**32 - 1))
u64 = st.one_of(st.sampled_from(EXTREMES), st.integers(0, 2**64 - 1))
HEADER = struct.Struct("<4sB3sQII16sQ")
assert HEADER.size == FRAME_SIZE


@st.composite
def near(draw: st.DrawFn, original: Frame) -> bytes:
    """A frame header like `original` with any of its fields (magic, kind, reserved
    bytes, round, index, slot, digest, nbytes) replaced, extremes favoured."""

    def field(keep: Any, other: st.SearchStrategy[Any]) -> Any:
        return draw(st.one_of(st.just(keep), other))

    return HEADER.pack(
        field(FRAME_MAGIC, st.binary(min_size=4, max_size=4)),
        field(
            int(original.kind),
            st.one_of(st.sampled_from([int(k) for k in FrameKind]), st.integers(0, 255)),
        ),
        field(bytes(3), st.binary(min_size=3, max_size=3)),
        field(original.round_id, u64),
        field(original.index, u32),
        field(original.slot, u32),
        field(original.digest, st.binary(min_size=16, max_size=16)),
        field(original.nbytes, u64),
    )


class Stream:
    """A trainer → worker stream; `valid` when it is a whole round the reader must take."""

    def __init__(self, what: str, data: bytes, valid: bool = False) -> None:
        self.what, self.data, self.valid = what, data, valid

    def __repr__(self) -> str:
        head = self.data[:FRAME_SIZE].hex()
        return f"Stream({self.what!r}, {len(self.data)} bytes from {head}..., valid={self.valid})"


PLAN = small_plan()
DIGEST = digest_prefix(PLAN.digest)
PAYLOAD = bytes(range(256)) * (PLAN.bucket_bytes // 256)


def _round_parts(transport: str) -> list[bytes]:
    """Round 1 as the trainer sends it: headers and payloads; headers only for the ring
    (its payload sits in the shared slots)."""
    parts = valid_round(PLAN, 1, lambda n: PAYLOAD[:n])
    return parts if transport == "tcp" else parts[::2]


@st.composite
def frame_streams(draw: st.DrawFn, transport: str) -> Stream:
    """A valid round broken in one way: one header replaced, truncated, stray bytes in
    front, an ABORT (with an absurd reason length), or garbage."""
    parts = _round_parts(transport)
    headers = range(0, len(parts), 2 if transport == "tcp" else 1)
    style = draw(
        st.sampled_from(["header", "header", "header", "truncated", "prefix", "abort", "garbage"])
    )
    if style == "header":
        at = draw(st.sampled_from(headers))
        original = parts[at]
        header = draw(
            st.one_of(
                near(Frame.unpack(original)), st.binary(min_size=FRAME_SIZE, max_size=FRAME_SIZE)
            )
        )
        parts[at] = header
        # The one change a reader must accept: another valid ring slot for a bucket.
        slot = struct.unpack_from("<I", header, 20)[0]
        same_but_slot = header[:20] + header[24:] == original[:20] + original[24:]
        ring_slot = (
            transport == "ring" and at < len(parts) - 1 and same_but_slot and slot < RING_SLOTS
        )
        return Stream(f"header of part {at}", b"".join(parts), header == original or ring_slot)
    stream = b"".join(parts)
    if style == "truncated":
        return Stream("truncated", stream[: draw(st.integers(0, len(stream) - 1))])
    if style == "prefix":
        return Stream(
            "bytes before the first frame",
            draw(st.binary(min_size=1, max_size=2 * FRAME_SIZE)) + stream,
        )
    if style == "abort":
        nbytes = draw(
            st.one_of(st.sampled_from([ABORT_REASON_MAX + 1, 2**32, 2**63, 2**64 - 1]), u64)
        )
        reason = draw(st.binary(max_size=64))
        if draw(st.booleans()):
            nbytes = len(reason)
        return Stream(
            f"abort of {nbytes}", Frame(FrameKind.ABORT, 1, 0, DIGEST, nbytes).pack() + reason
        )
    return Stream("garbage", draw(st.binary(max_size=4 * FRAME_SIZE)))


@pytest.mark.parametrize("transport", ["tcp", "ring"])
def test_fuzzed_frames_end_in_a_transfer_error_without_large_allocations(transport: str) -> None:
    """Each broken round ends in a TransferError (the link broken, or the round
    aborted); no read past a header or a bounded ABORT reason, no allocation beyond
    the plan's two receive buffers, none of them leaked; then a valid round on a new
    connection is received whole."""
    model = _models.mixed()
    pool = ReceivePool(2, PLAN.bucket_bytes, torch.device("cpu"), 2.0, on_device=False)
    outcomes: Counter[str] = Counter()

    def run(stream: bytes, receivers: list[Any]) -> int:
        """Feed `stream` to a new receiver (appended to `receivers`); buckets it yielded."""
        sock, feed = socket.socketpair()
        receiver, target = frame_receiver(transport, PLAN, model, sock, pool)
        receivers.append(receiver)
        try:
            return receive(receiver, target, stream, sock, feed)
        finally:
            sock.close()
            feed.close()

    with bounded_reads(ABORT_REASON_MAX) as sizes:

        @fuzz(250)
        @given(case=frame_streams(transport))
        def one(case: Stream) -> None:
            CASES[f"frames: {transport}"] += 1
            receivers: list[Any] = []
            tracemalloc.start()
            try:
                if case.valid:
                    assert run(case.data, receivers) == len(PLAN.buckets), case.what
                    outcomes["valid"] += 1
                    return
                with pytest.raises(EXPECTED) as caught:
                    run(case.data, receivers)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < 256 << 10, f"{case.what}: {peak} bytes allocated"
            assert len(pool._buffers) <= 2 and all(
                b.numel() == PLAN.bucket_bytes for b in pool._buffers
            )
            assert pool._free.qsize() == 2, f"{case.what}: a receive buffer was not released"
            assert receivers[0].link.broken or "aborted" in str(caught.value), case.what
            outcomes[type(caught.value).__name__] += 1

        one()
        assert run(b"".join(_round_parts(transport)), []) == len(
            PLAN.buckets
        )  # a legitimate trainer
    assert max(sizes) <= ABORT_REASON_MAX
    assert outcomes["ProtocolError"] > 0 and outcomes["TransferError"] > 0, outcomes
    print(f"{transport}: {dict(outcomes)}")


@st.composite
def worker_handshakes(draw: st.DrawFn) -> tuple[bytes, bytes, Callable[[bytes], bytes]]:
    """(stray bytes first, the HELLO sent, what becomes of the right PROOF): the proof is
    always wrong (mutated, random or cut short), so no such worker may get in."""
    nonce = draw(st.binary(min_size=32, max_size=32))
    hello = pack_hello(nonce, bytes.fromhex(PLAN.digest))
    # Mostly no stray bytes and the right HELLO, so that most cases reach the proof.
    none, stray = st.just(b""), st.binary(min_size=1, max_size=2 * HELLO_SIZE)
    prefix = draw(st.one_of(none, none, none, stray))
    sent = draw(
        st.one_of(st.just(hello), st.just(hello), _xored(hello), st.binary(max_size=HELLO_SIZE + 8))
    )
    style = draw(st.sampled_from(["xor", "random", "cut"]))
    mask = draw(_mask(PROOF_SIZE))
    junk = draw(st.binary(max_size=2 * PROOF_SIZE))
    cut = draw(st.integers(0, PROOF_SIZE - 1))

    def proof(right: bytes) -> bytes:
        if style == "xor":
            return bytes(a ^ b for a, b in zip(right, mask, strict=True))
        if style == "random" and junk != right:
            return junk
        return right[:cut]

    return prefix, sent, proof


def _mask(size: int) -> st.SearchStrategy[bytes]:
    """An XOR mask that changes at least one byte."""
    return st.binary(min_size=size, max_size=size).filter(any)


def _xored(data: bytes) -> st.SearchStrategy[bytes]:
    return _mask(len(data)).map(lambda m: bytes(a ^ b for a, b in zip(data, m, strict=True)))


def test_fuzzed_handshakes_never_get_in_and_the_listener_keeps_admitting() -> None:
    """The trainer's real listener (its rendezvous): stray bytes before the HELLO,
    mutated or random HELLOs, wrong proofs, connections cut mid-handshake. None is
    admitted, and a legitimate worker connecting afterwards is."""
    links = trainer_links(handshake_timeout=2.0)
    with loop_thread() as looper:
        port_known = threading.Event()
        ports: list[int] = []
        admitting: list[asyncio.Event] = []  # set: the init is over, the listener closes

        async def init_workers(init_info: dict[str, Any]) -> None:
            admitting.append(asyncio.Event())
            ports.append(init_info["port"])
            port_known.set()
            await admitting[0].wait()

        rendezvous = looper.submit(links.rendezvous({}, init_workers))
        assert port_known.wait(10)

        @fuzz(250)
        @given(case=worker_handshakes())
        def one(case: tuple[bytes, bytes, Callable[[bytes], bytes]]) -> None:
            CASES["handshakes: trainer's listener"] += 1
            prefix, sent, wrong_proof = case
            with socket.create_connection(("127.0.0.1", ports[0]), timeout=5) as sock:
                sock.sendall(prefix + sent)
                whole = len(prefix) + len(sent) >= HELLO_SIZE
                if not whole:
                    sock.shutdown(socket.SHUT_WR)
                challenge = recv_all(sock, CHALLENGE_SIZE)
                if whole and len(challenge) == CHALLENGE_SIZE:
                    right = pack_proof(
                        TOKEN, sent[8:40], challenge[4:36], bytes.fromhex(PLAN.digest)
                    )
                    with contextlib.suppress(OSError):
                        sock.sendall(wrong_proof(right))
                        sock.shutdown(socket.SHUT_WR)
                answer = recv_all(sock, RESULT_SIZE + 64)
            assert answer != pack_result(HandshakeStatus.OK)

        one()
        legit = connect_link("127.0.0.1", ports[0], TOKEN, PLAN, timeout=5)
        try:
            looper.loop.call_soon_threadsafe(admitting[0].set)
            rendezvous.result(10)
            assert len(links.peers) == 1  # the legitimate worker, and no fuzzed one
        finally:
            legit.close()
            links.close()


@st.composite
def trainer_replies(draw: st.DrawFn) -> Callable[[bytes], bytes]:
    """What a fake trainer answers a worker's HELLO: never a proper CHALLENGE and OK."""
    digest = bytes.fromhex(PLAN.digest)
    trainer_nonce = draw(st.binary(min_size=32, max_size=32))
    style = draw(st.sampled_from(["random", "challenge", "status", "result", "cut", "prefix"]))
    junk = draw(st.binary(max_size=CHALLENGE_SIZE + RESULT_SIZE + 8))
    challenge_mask = draw(_mask(CHALLENGE_SIZE))
    result_mask = draw(_mask(RESULT_SIZE))
    status = draw(st.one_of(st.sampled_from([1, 2, 3, 4, 2**32 - 1]), st.integers(1, 2**32 - 1)))
    prefix = draw(st.binary(min_size=1, max_size=CHALLENGE_SIZE))

    def reply(hello: bytes) -> bytes:
        good = pack_challenge(TOKEN, hello[8:40], trainer_nonce, digest)
        ok = pack_result(HandshakeStatus.OK)
        if style == "random":
            return junk
        if style == "challenge":
            return bytes(a ^ b for a, b in zip(good, challenge_mask, strict=True)) + ok
        if style == "status":
            return good + struct.pack("<4sI", b"AWTR", status)
        if style == "result":
            return good + bytes(a ^ b for a, b in zip(ok, result_mask, strict=True))
        if style == "cut":
            return (good + ok)[: len(junk) % (CHALLENGE_SIZE + RESULT_SIZE)]
        return prefix + good + ok

    return reply


def test_fuzzed_challenges_and_results_fail_the_worker_with_a_transfer_error() -> None:
    """The worker's side of the handshake against a trainer that answers garbage."""

    @fuzz(100)
    @given(reply=trainer_replies())
    def one(reply: Callable[[bytes], bytes]) -> None:
        CASES["handshakes: worker"] += 1
        port, thread = fake_trainer(reply)
        with pytest.raises(EXPECTED):
            connect_link("127.0.0.1", port, TOKEN, PLAN, timeout=2)
        thread.join(10)

    one()


@st.composite
def broken(draw: st.DrawFn, frame: Frame, buckets: int) -> bytes:
    """`frame` (a worker's READY or RELEASE for round 1) with one field made invalid:
    the magic, kind, reserved bytes, digest, a round ahead of the trainer's, payload
    bytes announced, a bucket past the plan, a slot past the ring (a READY's must be 0)."""
    field = draw(
        st.sampled_from(["magic", "kind", "reserved", "round", "digest", "nbytes", "index", "slot"])
    )
    first_bad = {"index": buckets if frame.kind == FrameKind.RELEASE else 1, "slot": 1}
    if frame.kind == FrameKind.RELEASE:
        first_bad["slot"] = RING_SLOTS
    values = {
        "magic": st.binary(min_size=4, max_size=4).filter(lambda v: v != FRAME_MAGIC),
        "kind": st.integers(0, 255).filter(lambda v: v not in (FrameKind.READY, FrameKind.RELEASE)),
        "reserved": st.binary(min_size=3, max_size=3).filter(any),
        "round": st.integers(2, 2**64 - 1),
        "digest": st.binary(min_size=16, max_size=16).filter(lambda v: v != frame.digest),
        "nbytes": st.one_of(st.sampled_from([2**63, 2**64 - 1]), st.integers(1, 2**64 - 1)),
        "index": st.integers(first_bad["index"], 2**32 - 1),
        "slot": st.integers(first_bad["slot"], 2**32 - 1),
    }
    fields = {
        "magic": FRAME_MAGIC,
        "kind": int(frame.kind),
        "reserved": bytes(3),
        "round": frame.round_id,
        "index": frame.index,
        "slot": frame.slot,
        "digest": frame.digest,
        "nbytes": frame.nbytes,
    }
    fields[field] = draw(values[field])
    return HEADER.pack(*fields.values())


def test_fuzzed_worker_frames_end_in_a_transfer_error_on_the_trainer() -> None:
    """READY/RELEASE frames from a worker, any field fuzzed, or random bytes, with no
    valid READY among them; or one invalid frame before a valid READY: the connection
    breaks with a typed error, and nothing else is read or allocated on its account."""
    links = trainer_links()
    digest = digest_prefix(links.plan.digest)
    buckets = len(links.plan.buckets)
    ready = Frame(FrameKind.READY, 1, 0, digest, 0)
    release = Frame(FrameKind.RELEASE, 1, 0, digest, 0)
    frames = st.one_of(near(ready), near(release), st.binary(max_size=2 * FRAME_SIZE))
    without_ready = st.lists(frames, min_size=1, max_size=3).filter(
        lambda fs: ready.pack() not in fs
    )
    bad_then_ready = st.one_of(broken(ready, buckets), broken(release, buckets)).map(
        lambda b: [b, ready.pack()]
    )
    inputs = st.one_of(without_ready, bad_then_ready)

    def on_release(peer: Peer, frame: Frame) -> None:
        if frame.slot >= RING_SLOTS:
            raise links.protocol_error(peer, f"released slot {frame.slot}")

    with loop_thread() as looper:

        async def wait_ready() -> None:
            with anyio.fail_after(5):
                await links.wait_ready(1, on_release)

        @fuzz(250)
        @given(inbound=inputs)
        def one(inbound: list[bytes]) -> None:
            CASES["frames: trainer reads READY"] += 1
            ours, theirs = socket.socketpair()
            ours.setblocking(False)
            peer = Peer(ours, "fuzz")
            links.peers = [peer]
            tracemalloc.start()
            try:
                theirs.sendall(b"".join(inbound))
                theirs.shutdown(socket.SHUT_WR)
                with pytest.raises(EXPECTED):
                    looper.run(wait_ready())
                _, peak = tracemalloc.get_traced_memory()
                assert peer.broken is not None
            finally:
                tracemalloc.stop()
                peer.close("done")
                theirs.close()
            assert peak < 256 << 10, f"{peak} bytes allocated"

        one()
