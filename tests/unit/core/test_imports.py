"""The package's import graph: no cycle, and no import from a lower layer to a higher one, counting every
import: those inside functions (a lazy import is still a dependency) and those under `if TYPE_CHECKING:`
(a type a module names is a dependency of its design, though the import never runs). A new module must
be placed in a layer here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[3] / "daemon" / "soakd"

# Lowest first. A module may import its own layer and those below. Prefixes match subpackages.
LAYERS: list[tuple[str, ...]] = [
    # core: no soakd imports beyond this layer
    (
        "soakd", "soakd.errors", "soakd.units", "soakd.rundir", "soakd.nvml_fields", "soakd.redact",
        "soakd.files", "soakd.logs", "soakd.metric", "soakd.ticker", "soakd.sse", "soakd.notify",
        "soakd.loopwatch", "soakd.lifecycle", "soakd.checkpoint", "soakd.console", "soakd.clock",
        "soakd.stopsignals", "soakd.loopblame",
    ),
    ("soakd.lang",),  # the criteria language: the config validates expressions with it
    ("soakd.config",),
    ("soakd.shapes", "soakd.tinymodel", "soakd.probe"),
    ("soakd.engine",),
    ("soakd.collectors.base",),  # the collector protocol: the sinks' health collectors implement it
    ("soakd.traces",),
    ("soakd.judge",),  # the live judge: metrics fold, criteria, verdict
    ("soakd.sinks", "soakd.owner"),  # the run folder's one owner and its own files (the spool's segments)
    ("soakd.report",),  # a finished run read back: re-judging, the sign-off report, comparisons
    ("soakd.replay",),
    ("soakd.live",),  # the run's live state, read by the collectors' factories, the jobs, the parts
    ("soakd.policies",),
    ("soakd.collectors",),
    ("soakd.control",),
    ("soakd.resume",),
    ("soakd.jobs", "soakd.parts", "soakd.replay_part"),
    ("soakd.wiring",),  # builds the run's parts from the config
    ("soakd.app", "soakd.rundocs", "soakd.stopping", "soakd.progress", "soakd.matrix", "soakd.checks"),
    ("soakd.cli", "soakd.__main__"),
    ("soakd.testing",),  # fakes for tests (a stub engine, a fake pynvml): may import any module
]  # fmt: skip


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[tuple[str, int]]:
    """(imported soakd module, line) of every import in the file, type-only ones included; `from soakd.x
    import y` is soakd.x.y when that is a module, else soakd.x."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "soakd"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "soakd":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add((sub if sub in modules else node.module, node.lineno))
    return {(m, line) for m, line in found if m in modules}


def _layer(module: str) -> int:
    best: tuple[int, int] | None = None  # (prefix length, layer): the longest matching entry wins
    for layer, names in enumerate(LAYERS):
        for name in names:
            matches = module == name or (name != "soakd" and module.startswith(name + "."))
            if matches and (best is None or len(name) > best[0]):
                best = (len(name), layer)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/unit/core/test_imports.py: place it")
    return best[1]


GRAPH = {m: _imports(p, set(_modules())) for m, p in _modules().items()}


def test_every_module_has_a_layer() -> None:
    for module in GRAPH:
        _layer(module)
    assert len(GRAPH) > 80 and sum(map(len, GRAPH.values())) > 300  # the whole package was read


def test_no_import_goes_up_a_layer() -> None:
    upward = [
        f"{_modules()[src].relative_to(PACKAGE.parent)}:{line}: {src} (layer {_layer(src)}) imports "
        f"{dst} (layer {_layer(dst)})"
        for src, deps in GRAPH.items()
        for dst, line in sorted(deps)
        if _layer(dst) > _layer(src)
    ]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle() -> None:
    edges = {src: {dst for dst, _ in deps if dst != src} for src, deps in GRAPH.items()}
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = [*path[path.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)


def test_the_checker_sees_a_cycle_and_an_upward_import(tmp_path: Path) -> None:
    """The two checks can fail: a cycle and upward imports (lazy, type-only) made in a scratch package are
    found."""
    pkg = tmp_path / "soakd"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("def f():\n    from soakd.config import x\n")
    (pkg / "config.py").write_text("from soakd.errors import f\nx = 1\n")
    (pkg / "units.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from soakd.config import x\n"
    )
    modules = {"soakd", "soakd.errors", "soakd.config", "soakd.units"}
    names = ("soakd.errors", "soakd.config", "soakd.units")
    deps = {m: _imports(pkg / (m.split(".")[-1] + ".py"), modules) for m in names}
    assert deps["soakd.errors"] == {("soakd.config", 2)}  # lazy, and upward: errors is core
    assert deps["soakd.config"] == {("soakd.errors", 1)}  # the other half of the cycle
    assert deps["soakd.units"] == {("soakd.config", 3)}  # type-only, and upward all the same
    assert _layer("soakd.config") > _layer("soakd.errors") == _layer("soakd.units")
