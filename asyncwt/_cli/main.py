"""The `asyncwt` command line: `asyncwt worker` serves a model; `asyncwt demo` shows a round trip."""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import importlib.util
import logging
import os
import signal
import socket
import sys
import typing
from collections.abc import Callable, Sequence

import anyio
import torch

from .._core.concurrency import unwrap_group
from .._core.logs import add_log_level_option, configure_logging
from .._core.registry import worker_engine_class
from .._core.validate import check_port
from .._core.worker_api import WeightTransferConfig
from .._worker.server import API_KEY_ENV, check_api_key, format_url, serve
from .._worker.server_limits import ServerLimits
from .group import run_group

if sys.version_info < (3, 11):  # pragma: no cover - the builtin arrived in 3.11
    from exceptiongroup import BaseExceptionGroup

__all__ = ["main"]

logger = logging.getLogger("asyncwt.cli")

Command = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


class UsageError(Exception):
    """A mistake in the command line: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (`PROG: error: ...; see PROG --help`), not the
    usage block followed by the error."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `asyncwt` command line with `argv` (default `sys.argv[1:]`); the exit status.

    A mistake (an unknown backend, a port in use, a module that cannot be imported)
    ends in one line on stderr, `asyncwt COMMAND: error: ...`, naming what was given,
    what is accepted and what to do, and exit status 2; a failure after startup in
    one line too, and status 1.
    """
    parser = _Parser(
        prog="asyncwt", description="Move a trainer's weights into running inference workers."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    worker = commands.add_parser(
        "worker",
        help="serve a model behind vLLM's weight-transfer HTTP routes",
        description=(
            "Build a model from a factory and serve it behind vLLM's weight-transfer "
            "routes. Prints 'asyncwt worker listening on http://HOST:PORT' once "
            "listening; stops cleanly (exit 0) on SIGTERM or SIGINT."
        ),
    )
    add_log_level_option(worker)
    worker.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help=(
            "zero-argument callable returning a torch.nn.Module, e.g. mypkg.models:tiny "
            "(imported from the current folder first, as `python -m` does)"
        ),
    )
    worker.add_argument(
        "--import",
        dest="imports",
        action="append",
        default=[],
        metavar="MODULE",
        help=(
            "import MODULE first, e.g. one that registers a worker engine backend with "
            "asyncwt.register_worker_engine (repeatable; the --model module is imported "
            "before the engine is built too, so it may register backends itself)"
        ),
    )
    worker.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    worker.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=(
            f"require 'Authorization: Bearer KEY' on every route (default: ${API_KEY_ENV}); "
            "required unless --host is loopback"
        ),
    )
    worker.add_argument(
        "--port", type=int, default=0, help="port to bind; 0 picks a free one (default %(default)s)"
    )
    worker.add_argument(
        "--backend",
        default="tcp",
        help="worker engine backend: tcp, shm, torch_dist, cuda_ipc (default %(default)s)",
    )
    worker.add_argument(
        "--apply-threads",
        type=int,
        default=WeightTransferConfig.apply_threads,
        metavar="N",
        help="background threads applying received weights (default %(default)s)",
    )
    worker.add_argument(
        "--transform",
        metavar="MODULE:FUNCTION",
        help=(
            "per-parameter hook (name, tensor) -> tensor run on the apply threads before "
            "loading, e.g. a cast or a quantiser"
        ),
    )
    worker.add_argument(
        "--transform-elementwise",
        action="store_true",
        help=(
            "the --transform works element by element (a cast): it may be given any run "
            "of a parameter's elements, flat, so chunks land as they arrive and a bucket's "
            "work is shared among the apply threads"
        ),
    )
    worker.add_argument(
        "--staged",
        action="store_true",
        help=(
            "receive each round into a shadow copy of the weights and move it into the "
            "model only when the round completed: a failed round leaves the previous "
            "weights intact (costs one extra copy of the weights)"
        ),
    )
    worker.add_argument(
        "--relay-host",
        default=None,
        help=(
            "address a tcp chain worker listens on for its predecessor (the worker before it "
            "in the chain connects there; default: --host, or the address it reaches the "
            "trainer from when --host is a wildcard)"
        ),
    )
    defaults = ServerLimits()
    worker.add_argument(
        "--header-timeout",
        type=float,
        default=defaults.header_timeout,
        metavar="S",
        help="seconds a new connection has to send its request's headers (default %(default)s)",
    )
    worker.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.body_timeout,
        metavar="S",
        help="seconds to read a request's body (default %(default)s)",
    )
    worker.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="connections open at once (default: half of ulimit -n, at most 1024)",
    )
    worker.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        metavar="N",
        help="largest body of init_weight_transfer_engine and update_weights (default %(default)s)",
    )
    worker.add_argument(
        "--ranks",
        type=int,
        default=1,
        metavar="N",
        help=(
            "serve a model sharded over N ranks (tensor parallelism): N worker processes, "
            "rank r calling the factory with rank=r, world_size=N and serving on --port + r "
            "(each on a free port with --port 0); prints each rank's URL (default %(default)s)"
        ),
    )
    worker.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    worker.set_defaults(run=_worker_command)

    demo = commands.add_parser(
        "demo",
        help="train a small model and push its weights to a worker process after each step",
    )
    add_log_level_option(demo)
    demo.add_argument("--steps", type=int, default=5, help="training steps (default %(default)s)")
    demo.set_defaults(run=_demo_command)

    bench = commands.add_parser(
        "bench",
        add_help=False,
        help="benchmark weight transfer across processes (asyncwt bench --help)",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(run=_bench_command)

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The benchmark has its own options, --log-level among them (argparse would
        # not pass `--help` through).
        return _bench_command(argparse.Namespace(bench_args=argv[1:]), parser)
    args = parser.parse_args(argv)
    if args.command == "worker":  # a group's ranks get the same arguments
        args.worker_argv = argv[argv.index("worker") + 1 :]
    run: Command = args.run
    try:
        try:
            configure_logging(args.log_level)
        except ValueError as exc:
            raise UsageError(f"{exc}; unset it or pass --log-level") from None
        return run(args, parser)
    except UsageError as exc:
        print(f"asyncwt {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _demo_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.steps < 1:
        raise UsageError(f"--steps should be >= 1, got {args.steps}")
    from .demo import main as demo_main

    return demo_main(args.steps)


def _bench_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._bench import main as bench_main

    result: int = bench_main(args.bench_args)
    return result


def _worker_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Check every option (names, addresses, the port) before the model is built, then serve."""
    # As `python -m` does: `--model quickstart:make_model` works from the folder that
    # holds quickstart.py.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, "")
    for module in args.imports:
        _import_module(module, f"--import {module}")
    transform = _import_object(args.transform, "--transform") if args.transform else None
    factory = _import_object(args.model, "--model")
    try:
        worker_engine_class(args.backend)
    except ValueError as exc:
        raise UsageError(
            f"{exc}; pass one that runs here to --backend (tcp and shm need only a CPU), "
            "or --import the module that registers yours"
        ) from None
    try:
        check_port("--port", args.port, allow_zero=True)
        config = WeightTransferConfig(
            backend=args.backend,
            apply_threads=args.apply_threads,
            transform=transform,  # type: ignore[arg-type]  # checked callable; signature is the user's
            transform_elementwise=args.transform_elementwise,
            staged=args.staged,
            relay_host=args.relay_host or args.host,
        )
        limits = ServerLimits(
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            max_connections=args.max_connections,
            max_body_bytes=args.max_body_bytes,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    group = _check_ranks(args.ranks, args.rank)
    if not group:
        _check_bindable(args.host, args.port)
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:
        check_api_key(api_key, args.host)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if group:  # this process supervises the ranks; each builds its own shard
        return run_group(args.model, args.worker_argv, args.ranks, args.port)
    shard = {} if args.rank is None else {"rank": args.rank, "world_size": args.ranks}
    model = _build_model(factory, args.model, **shard)
    try:
        anyio.run(
            _serve_until_signal,
            model,
            config,
            args.host,
            args.port,
            api_key,
            limits,
            backend="asyncio",
            backend_options={"use_uvloop": _uvloop_installed()},
        )
    except KeyboardInterrupt:  # before the signal handlers were installed
        return 130
    except Exception as exc:
        logger.debug("the worker failed", exc_info=True)
        print(f"asyncwt worker: error: {_describe(exc)}", file=sys.stderr)
        return 1
    return 0


def _check_bindable(host: str, port: int) -> None:
    """Bind `host:port` once and let go: a bad address or a port in use is reported now,
    before the model is built, not as a failure of the server after it."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        raise UsageError(
            f"--host {host!r} is not an address: {exc}; give an IP address or a name of this "
            "machine, e.g. 127.0.0.1 (this host only, the default) or 0.0.0.0 (every "
            "interface, with --api-key)"
        ) from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
        try:
            probe.bind(address)
        except OSError as exc:
            if port and exc.errno == errno.EADDRINUSE:
                raise UsageError(
                    f"--port {port} is already in use on {host}: another process listens "
                    "there; stop it, pick another port, or pass --port 0 for a free one"
                ) from None
            raise UsageError(
                f"cannot listen on --host {host!r} --port {port}: {exc.strerror or exc}; give "
                "an address of this machine (127.0.0.1, or 0.0.0.0 with --api-key) and a "
                "free port (--port 0 picks one)"
            ) from None


def _import_module(name: str, option: str) -> object:
    """Import `name` for `option`; a failure says how to make the module importable."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        if missing is not None and name.split(".")[0] == missing.split(".")[0]:
            raise UsageError(
                f"{option}: cannot import {name} ({exc}); it should be importable from "
                f"{os.getcwd()}: run from the folder holding {name.split('.')[0]}.py or its "
                "package, add that folder to PYTHONPATH, or pip install the package"
            ) from None
        raise UsageError(
            f"{option}: importing {name} failed: {type(exc).__name__}: {exc}"
        ) from None


def _import_object(spec: str, option: str) -> Callable[..., object]:
    """Import `MODULE:NAME` (NAME may be dotted) and check that it is callable."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise UsageError(f"{option} should be MODULE:NAME, e.g. mypkg.models:tiny, got {spec!r}")
    target = _import_module(module_name, f"{option} {spec}")
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise UsageError(
                f"{option} {spec}: {module_name} has no attribute {attr_path!r}; name a "
                f"function defined in {module_name}"
            ) from None
    if not callable(target):
        raise UsageError(
            f"{option} {spec}: {attr_path} should be callable, got {type(target).__name__}"
        )
    return target


def _check_ranks(ranks: int, rank: int | None) -> bool:
    """Whether this process starts a group of ranks (`--ranks` above 1, no `--rank`)."""
    if not isinstance(ranks, int) or ranks < 1:
        raise UsageError(f"--ranks should be an int >= 1, got {ranks!r}")
    if rank is not None and not 0 <= rank < ranks:
        raise UsageError(f"--rank should be in [0, {ranks}), got {rank}")
    return ranks > 1 and rank is None


def _build_model(factory: Callable[..., object], spec: str, **shard: int) -> torch.nn.Module:
    """Call the `--model` factory (with `rank` and `world_size` for a rank of a
    group); anything but a module (or an error) is a usage error."""
    try:
        model = factory(**shard)
    except TypeError as exc:
        if not shard:
            raise UsageError(
                f"--model {spec}: the factory raised TypeError: {exc} (--log-level DEBUG "
                f"shows the traceback)"
            ) from None
        raise UsageError(
            f"--model {spec} with --ranks: the factory should accept rank= and world_size= "
            f"(and return that rank's shard), got TypeError: {exc}"
        ) from None
    except Exception as exc:
        logger.debug("--model %s failed", spec, exc_info=True)
        raise UsageError(
            f"--model {spec}: the factory raised {type(exc).__name__}: {exc} "
            "(--log-level DEBUG shows the traceback)"
        ) from None
    if not isinstance(model, torch.nn.Module):
        raise UsageError(
            f"--model {spec}: the factory returned {type(model).__name__}; it should return "
            "a torch.nn.Module"
        )
    return model


def _uvloop_installed() -> bool:
    """Whether uvloop can be imported: the worker runs on it when it can."""
    return importlib.util.find_spec("uvloop") is not None


async def _serve_until_signal(
    model: torch.nn.Module,
    config: WeightTransferConfig,
    host: str,
    port: int,
    api_key: str | None,
    limits: ServerLimits | None = None,
) -> None:
    """Serve until SIGTERM or SIGINT; then stop cleanly."""

    def ready(bound_host: str, bound_port: int) -> None:
        print(f"asyncwt worker listening on {format_url(bound_host, bound_port)}", flush=True)

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                functools.partial(
                    serve,
                    model,
                    config=config,
                    host=host,
                    port=port,
                    ready=ready,
                    api_key=api_key,
                    limits=limits,
                )
            )
            async for signum in signals:
                logger.info("received %s, stopping", signal.Signals(signum).name)
                break
            tg.cancel_scope.cancel()


def _describe(exc: BaseException) -> str:
    """One line per underlying error of `exc` (task groups wrap them)."""
    if isinstance(exc, BaseExceptionGroup):
        exc = unwrap_group(exc)
    notes = "".join(f"; {note}" for note in getattr(exc, "__notes__", ()))
    return f"{type(exc).__name__}: {exc}{notes}"
