"""The documentation builds strictly and stays true to the code.

`mkdocs build --strict` fails on a broken link, a missing page, a `::: asyncwt.X`
that does not resolve, or a cross-reference to an object that does not exist, so a
renamed or removed public name breaks this test. The other tests keep the prose
honest where the build cannot: every public name has a reference entry, the
backends table matches the registry, module paths and CLI options exist, and the
Python snippets compile and import only real names.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import asyncwt

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
README = ROOT / "README.md"


def _text() -> str:
    return "\n".join(page.read_text() for page in PAGES)


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


@pytest.mark.slow
def test_docs_build_in_strict_mode(tmp_path: Path) -> None:
    toolchain = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "pymdownx")
    missing = [name for name in toolchain if not _importable(name)]
    if missing:
        pytest.fail(
            f"the docs toolchain is not installed ({', '.join(missing)} missing): "
            f"pip install -e '.[docs]'"
        )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 0, (
        f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    )
    assert (tmp_path / "site" / "reference" / "index.html").is_file()


def test_every_public_name_has_a_reference_entry_and_no_other() -> None:
    documented = re.findall(r"^::: asyncwt\.(\w+)\s*$", _text(), re.MULTILINE)
    assert len(documented) == len(set(documented)), "a name is documented twice"
    assert sorted(documented) == sorted(asyncwt.__all__)


@pytest.mark.slow
def test_backends_table_lists_exactly_the_registered_backends() -> None:
    text = (DOCS / "concepts.md").read_text()
    table = text.split("<!-- backends:", 1)[1].split("<!-- /backends -->", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", table, re.MULTILINE)
    # In a fresh interpreter: other tests register fake backends in this one.
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import asyncwt, json; print(json.dumps(asyncwt.registered_backends()))",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    registered = json.loads(result.stdout)
    assert registered["trainer"] == registered["worker"]
    assert sorted(rows) == registered["trainer"], (
        "docs/concepts.md's backends table should list exactly the registered backends: "
        "add a row for a new backend (and update the paragraph after the table)"
    )


def test_paths_named_in_the_docs_exist() -> None:
    paths = set(re.findall(r"\b((?:asyncwt|examples|tests)/[\w/]+\.py)\b", _text()))
    assert paths, "the docs should point at the code"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"the docs name files that do not exist: {missing}"


def _code_map() -> dict[str, str]:
    """The tree in architecture.md's "Where the code lives": path -> what it holds.

    Rooms (packages) end in `/`; two spaces of indent per level.
    """
    page = (DOCS / "architecture.md").read_text()
    section = page.split("## Where the code lives", 1)[1]
    tree = re.search(r"^```text\n(.*?)^```", section, re.MULTILINE | re.DOTALL)
    assert tree, "architecture.md's 'Where the code lives' should hold the tree in a text block"
    entries: dict[str, str] = {}
    parents: list[str] = []
    for line in tree.group(1).splitlines():
        match = re.fullmatch(r"( *)(\S+/|\S+\.py) {2,}(\S.*)", line)
        assert match, f"a map line should be NAME then what it holds: {line!r}"
        indent, name, what = match.groups()
        depth = len(indent) // 2
        del parents[depth:]
        assert len(parents) == depth, f"a map line is indented past its room: {line!r}"
        path = "".join(parents) + name
        entries[path] = what
        if name.endswith("/"):
            parents.append(name)
    return entries


def test_architecture_maps_every_module() -> None:
    entries = _code_map()
    package = ROOT / "asyncwt"
    wanted = set()
    for path in package.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if path.name == "__init__.py":
            wanted.add(f"{rel.parent.as_posix()}/")  # a package is a room line
        else:
            wanted.add(rel.as_posix())  # every other module, __main__.py included
    missing = sorted(wanted - set(entries))
    assert not missing, (
        f"docs/architecture.md's 'Where the code lives' should map every module; "
        f"add a line for each of {missing}"
    )


def _python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in [*PAGES, README]:
        for code in re.findall(
            r"^```python\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL
        ):
            if not code.lstrip().startswith("--8<--"):  # included files are tested as examples
                blocks.append((str(page.relative_to(ROOT)), code))
    return blocks


@pytest.mark.parametrize(("page", "code"), _python_blocks())
def test_python_snippets_compile_and_use_real_names(page: str, code: str) -> None:
    tree = ast.parse(code, filename=page)  # a SyntaxError fails the test
    if any(isinstance(node, (ast.Import, ast.ImportFrom)) for node in tree.body):
        # A snippet with its imports reads as a program: it must run as one (no
        # top-level await); a fragment without imports is a function's body.
        compile(code, page, "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "asyncwt":
            for alias in node.names:
                assert alias.name in asyncwt.__all__, f"{page}: asyncwt has no public {alias.name}"


def _help_options(command: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-m", "asyncwt", *command.split(), "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return set(re.findall(r"--[a-z][a-z-]+", result.stdout)) - {"--help"}


def test_readme_starts_with_setup_demo_and_the_test_command() -> None:
    """CI (.ci/run) and the project guide run these three commands verbatim."""
    commands = re.findall(r"^    (\S.*)$", README.read_text(), re.MULTILINE)[:3]
    assert commands == [
        (
            "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
            "pip install -e '.[test,docs]'"
        ),
        ". .venv/bin/activate && asyncwt demo",
        "python -m pytest -q",
    ]


@pytest.mark.parametrize("command", ["worker", "demo", "bench", "bench --cluster"])
@pytest.mark.slow
def test_commands_in_the_readme_and_docs_use_real_options(command: str) -> None:
    options = _help_options(command)
    lines = re.findall(rf"asyncwt {command}\b[^\n`]*", _text() + README.read_text())
    if command == "bench":  # `asyncwt bench --cluster` has options of its own
        lines = [line for line in lines if not line.startswith("asyncwt bench --cluster")]
    used = {option for line in lines for option in re.findall(r"--[a-z][a-z-]+", line)}
    assert used <= options, f"asyncwt {command} has no {sorted(used - options)}"


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path: Path) -> None:
    """The README's worker command (on a free port) and its trainer, from examples/."""
    from asyncwt._worker.launch import start_worker, stop_worker

    text = README.read_text()
    worker = re.search(r"^    cd examples && (asyncwt worker .*) --port 8100$", text, re.MULTILINE)
    assert worker, "the README should start its worker from examples/ on port 8100"
    args = worker.group(1).split()[2:]
    (code,) = re.findall(r"^```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    # examples/ on the path: the worker's own `cd examples` is tested in test_cli.py.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "examples")])}
    proc, url = start_worker(args[1], *args[2:], env=env)
    try:
        script = tmp_path / "readme_example.py"
        script.write_text(code.replace("http://127.0.0.1:8100", url))
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=ROOT / "examples",
            env=env,
            check=False,
            capture_output=True,
            text=True,
            timeout=100,
        )
    finally:
        stop_worker(proc)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        f"round {step} (version step-{step})" for step in (1, 2, 3)
    ], done.stdout


@pytest.mark.slow
def test_worker_options_in_the_docs_exist() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "asyncwt", "worker", "--help"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    options = set(re.findall(r"--[a-z][a-z-]+", result.stdout)) - {"--help"}
    table = re.findall(
        r"^\| `(--[a-z][a-z-]+)", (DOCS / "how-to" / "worker-server.md").read_text(), re.MULTILINE
    )
    assert sorted(table) == sorted(options), "the worker page's options table should match --help"
    used = {
        option
        for command in re.findall(r"asyncwt worker [^\n`]*", _text())
        for option in re.findall(r"--[a-z][a-z-]+", command)
    }
    assert used <= options, f"the docs use worker options that do not exist: {used - options}"
