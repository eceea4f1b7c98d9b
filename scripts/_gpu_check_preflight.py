"""`gpu-check --preflight`: will every check's code load on the GPU machine?

Read statically (no check is run, no CUDA is touched), from the source of
`scripts/gpu-check`, `scripts/_gpu_check_*.py` and `scripts/_gpu_checks/*.py`:

- every `import` and `from ... import` anywhere (in function bodies too, and in
  string constants that parse as Python with imports: the probes a check runs
  with `python -c`), and every attribute chain read through an imported name
  (`_pipeline._copy_into`, `torch.cuda._sleep`): a rename breaks them too;
- the worker factories (`workers(("staging", "tcp"))`: `_gpu_check_models.staging`)
  and backends (`tcp`, registered by `import asyncwt`) the checks start workers with.

Each reference belongs to the check whose function holds it, or to every check
(`ALL`) when it sits outside one. `probe` resolves them all in the interpreter the
checks will run under, with the carried wheels first on its path, then runs each
check's own `preflight` hook (`cuda-tests` collects the tests pytest would run).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import json
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

ALL = "*"
"""The owner of a reference outside any check's function: every check needs it."""

MODELS = "_gpu_check_models"
"""The module whose factories the checks' workers load (`--model MODULE:NAME`)."""


@dataclasses.dataclass(frozen=True, order=True)
class Ref:
    """Something a check needs to resolve: `module` (imported), then `attrs` read
    from it in turn (each may be a submodule); or a worker backend (`backend=True`:
    `module` is its name)."""

    module: str
    attrs: tuple[str, ...] = ()
    backend: bool = False

    def __str__(self) -> str:
        if self.backend:
            return f"backend {self.module!r}"
        return ".".join((self.module, *self.attrs)) if self.attrs else self.module


def sources(scripts: Path) -> list[Path]:
    """The files whose code a gpu-check run executes, the script first."""
    found = [scripts / "gpu-check", *sorted(scripts.glob("_gpu_check*.py"))]
    return found + sorted((scripts / "_gpu_checks").glob("*.py"))


def check_names(tree: ast.Module) -> dict[str, str]:
    """Function name -> check name, for every function decorated `@check("NAME", ...)`."""
    names = {}
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Name)
                and deco.func.id == "check"
                and deco.args
                and isinstance(deco.args[0], ast.Constant)
                and isinstance(deco.args[0].value, str)
            ):
                names[node.name] = deco.args[0].value
    return names


def _imports(node: ast.AST, package: str) -> Iterator[tuple[str, Ref]]:
    """(name bound, what it refers to) for every import under `node`."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Import):
            for alias in sub.names:
                if alias.asname:
                    yield alias.asname, Ref(alias.name)
                else:  # `import a.b.c` binds `a` and needs `a.b.c`
                    yield alias.name.split(".")[0], Ref(alias.name.split(".")[0])
                    yield "", Ref(alias.name)
        elif isinstance(sub, ast.ImportFrom):
            module = sub.module or ""
            if sub.level:  # relative: within the check package
                module = ".".join([package, module] if module else [package])
            if module == "__future__":
                continue
            for alias in sub.names:
                if alias.name == "*":
                    yield "", Ref(module)
                else:
                    yield alias.asname or alias.name, Ref(module, (alias.name,))


def _chains(node: ast.AST, names: dict[str, Ref]) -> Iterator[Ref]:
    """Every attribute chain `NAME.a.b` under `node` whose `NAME` is an import."""
    for sub in ast.walk(node):
        if not isinstance(sub, ast.Attribute) or not isinstance(sub.ctx, ast.Load):
            continue
        attrs: list[str] = []
        base: ast.expr = sub
        while isinstance(base, ast.Attribute):
            attrs.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in names:
            ref = names[base.id]
            yield Ref(ref.module, ref.attrs + tuple(reversed(attrs)))


def _code_strings(node: ast.AST) -> Iterator[ast.Module]:
    """String constants under `node` that are Python code with an import in it."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and "import" in sub.value:
            with contextlib.suppress(SyntaxError, ValueError):
                code = ast.parse(sub.value)
                if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(code)):
                    yield code


WORKER_MAIN = "asyncwt._cli.main"
"""What every worker child runs (`python -m asyncwt worker`)."""


def _worker_specs(node: ast.AST) -> Iterator[Ref]:
    """The worker command's module, and the factory and backend of every
    `workers((FACTORY, BACKEND, ...), ...)` call."""
    for sub in ast.walk(node):
        if not (isinstance(sub, ast.Call) and getattr(sub.func, "id", None) == "workers"):
            continue
        yield Ref(WORKER_MAIN)
        for spec in sub.args:
            if not isinstance(spec, ast.Tuple) or len(spec.elts) < 2:
                continue  # built at run time: its parts are read where they are written
            factory, backend = spec.elts[:2]
            if isinstance(factory, ast.Constant) and isinstance(factory.value, str):
                yield Ref(MODELS, (factory.value,))
            if isinstance(backend, ast.Constant) and isinstance(backend.value, str):
                yield Ref(backend.value, backend=True)


def _refs_in(node: ast.AST, names: dict[str, Ref], package: str) -> set[Ref]:
    scope = dict(names)
    refs: set[Ref] = set()
    for code in [node, *_code_strings(node)]:
        for bound, ref in _imports(code, package):
            refs.add(ref)
            if bound:
                scope[bound] = ref
    for code in [node, *_code_strings(node)]:
        refs.update(_chains(code, scope))
    refs.update(_worker_specs(node))
    return refs


def _defined_name(node: ast.stmt) -> str | None:
    """The name a top-level function, class or `NAME = ...` defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        target = node.targets[0]
        return target.id if isinstance(target, ast.Name) else None
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _module_key(path: Path) -> str:
    """The name a source file is imported by (`_gpu_checks.perf`, `_gpu_check_core`)."""
    if path.parent.name == "_gpu_checks":
        return f"_gpu_checks.{path.stem}"
    return path.stem


def _uses(
    node: ast.stmt, key: str, local: dict[str, tuple[str, str]], mods: dict[str, str]
) -> set[tuple[str, str]]:
    """The (module, name) definitions `node` names: its own module's, those imported by
    name from a source module, and `alias.NAME` of a source module imported whole."""
    used = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            used.add(local.get(sub.id, (key, sub.id)))
        elif (
            isinstance(sub, ast.Attribute)
            and isinstance(sub.value, ast.Name)
            and sub.value.id in mods
        ):
            used.add((mods[sub.value.id], sub.attr))
    return used


def discover(paths: Iterable[Path]) -> dict[Ref, set[str]]:
    """Every reference in `paths`, with the checks that need it (`ALL`: every one).

    A check needs what its function holds and what the top-level functions, classes
    and constants it names hold, in turn (the helpers of `_gpu_check_core`, a probe's
    code string); what no check reaches, and every top-level import (each check's
    child imports every check module), is `ALL`'s.
    """
    paths = list(paths)
    keys = {_module_key(path) for path in paths}
    defs: dict[tuple[str, str], tuple[set[Ref], set[tuple[str, str]]]] = {}
    checks: dict[tuple[str, str], str] = {}
    owners: dict[Ref, set[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        key = _module_key(path)
        checks.update(((key, f), name) for f, name in check_names(tree).items())
        module_names: dict[str, Ref] = {}
        local: dict[str, tuple[str, str]] = {}  # `from SOURCE import NAME`
        mods: dict[str, str] = {}  # `import SOURCE [as ALIAS]`
        for node in tree.body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for bound, ref in _imports(node, path.parent.name):
                    if not bound:
                        continue
                    module_names[bound] = ref
                    if ref.attrs and ref.module in keys:
                        local[bound] = (ref.module, ref.attrs[0])
                    elif not ref.attrs and ref.module in keys:
                        mods[bound] = ref.module
        for node in tree.body:
            refs = _refs_in(node, module_names, path.parent.name)
            name = _defined_name(node)
            if name is None:
                for ref in refs:
                    owners.setdefault(ref, set()).add(ALL)
                continue
            used = _uses(node, key, local, mods) - {(key, name)}
            old_refs, old_used = defs.get((key, name), (set(), set()))
            defs[key, name] = (old_refs | refs, old_used | used)
    reached: set[tuple[str, str]] = set()
    for function, check_name in checks.items():
        todo, seen = [function], set()
        while todo:
            at = todo.pop()
            if at in seen or at not in defs:
                continue
            seen.add(at)
            refs, used = defs[at]
            for ref in refs:
                owners.setdefault(ref, set()).add(check_name)
            todo.extend(used)
        reached |= seen
    for at, (refs, _) in defs.items():
        if at not in reached:
            for ref in refs:
                owners.setdefault(ref, set()).add(ALL)
    return owners


# -- the probe: resolves the references in the interpreter the checks run under ---------------


def resolve(ref: Ref) -> None:
    """Import `ref.module` and read its attributes in turn (importing `a.b` where `b`
    is not yet an attribute of `a`, as a later import in the check would have); raise
    what fails. A backend must be registered once asyncwt is imported."""
    if ref.backend:
        from asyncwt._core.registry import registered_backends

        known = registered_backends()
        if not any(ref.module in names for names in known.values()):
            raise LookupError(f"no backend {ref.module!r} is registered: {known}")
        return
    obj: Any = importlib.import_module(ref.module)
    path = ref.module
    for attr in ref.attrs:
        path = f"{path}.{attr}"
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            try:
                obj = importlib.import_module(path)
            except ModuleNotFoundError as exc:
                if exc.name != path:
                    raise
                raise AttributeError(
                    f"{path[: -len(attr) - 1]} has no attribute {attr!r}"
                ) from None


def probe(refs: Sequence[Ref], hooks: Sequence[str]) -> dict[str, Any]:
    """In the child: resolve every ref, then run each named check's preflight hook;
    each failure as `{"what": ..., "error": ...}`, and the versions found."""
    failures: list[dict[str, str]] = []
    for ref in refs:
        try:
            resolve(ref)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported
            failures.append({"what": str(ref), "error": f"{type(exc).__name__}: {exc}"})
    if hooks:
        from _gpu_check_core import CHECKS

        for name in hooks:
            hook = CHECKS[name].preflight
            try:
                if hook is not None:
                    hook()
            except BaseException as exc:  # noqa: BLE001 - every failure is reported
                error = "".join(traceback.format_exception_only(exc)).strip()
                what = f"check {name}'s preflight"
                failures.append({"what": what, "error": error, "check": name})
    return {"failures": failures, "versions": versions()}


def versions() -> dict[str, Any]:
    """torch's, CUDA's and NCCL's versions as this interpreter's torch states them."""
    found: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch
    except ImportError as exc:
        return {**found, "torch": f"missing ({exc})"}
    found.update(torch=torch.__version__, cuda=torch.version.cuda)
    try:
        nccl = torch.cuda.nccl.version()
        found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except (AttributeError, RuntimeError) as exc:  # a CPU build has no NCCL
        found["nccl"] = f"none ({type(exc).__name__})"
    return found


def run_probe(
    refs: Sequence[Ref], hooks: Sequence[str], env: dict[str, str], cwd: Path, timeout: float
) -> dict[str, Any]:
    """`probe` in a child of this interpreter with `env` (the checks' PYTHONPATH)."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-preflight-") as tmp:
        order = Path(tmp) / "order.json"
        order.write_text(
            json.dumps({"refs": [dataclasses.asdict(r) for r in refs], "hooks": hooks})
        )
        code = (
            "import json, sys; from _gpu_check_preflight import child_main; "
            "sys.exit(child_main(sys.argv[1]))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code, str(order)],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        result = Path(tmp) / "result.json"
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(
                f"the preflight probe exited {done.returncode}:\n{done.stdout}{done.stderr}"
            )
        found: dict[str, Any] = json.loads(result.read_text())
        return found


def child_main(order_path: str) -> int:
    """The probe child's entry: read the order, write the result beside it."""
    order = json.loads(Path(order_path).read_text())
    refs = [Ref(r["module"], tuple(r["attrs"]), r["backend"]) for r in order["refs"]]
    hooks = order["hooks"]
    if hooks:
        import _gpu_checks

        _gpu_checks.load_all()
    result = probe(refs, hooks)
    (Path(order_path).parent / "result.json").write_text(json.dumps(result))
    return 0


# -- wheels ---------------------------------------------------------------------------------


def install_wheels(wheels: Path, target: Path) -> list[dict[str, str]]:
    """Install each of `wheels/*.whl` into `target`, one pip call per wheel (one that
    does not fit this interpreter fails alone); what became of each."""
    names = sorted(p.name for p in wheels.glob("*.whl")) if wheels.is_dir() else []
    report = []
    for name in names:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
        cmd += ["--no-compile", "--no-cache-dir", "--upgrade", "--target", str(target)]
        done = subprocess.run(
            [*cmd, str(wheels / name)], capture_output=True, text=True, check=False
        )
        if done.returncode == 0:
            report.append({"wheel": name, "status": "installed"})
        else:
            last = [line for line in done.stderr.splitlines() if line.strip()] or ["(no output)"]
            report.append({"wheel": name, "status": f"failed: {last[-1].strip()}"})
    return report
