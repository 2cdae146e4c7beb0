"""The package stays walkable: a module over 500 lines says why at its top, and no function runs past 80
lines (a longer one is a sequence that wants names for its steps)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "daemon" / "soakd"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_the_package_is_where_this_test_looks() -> None:
    assert (PACKAGE / "app.py").is_file() and len(_modules()) > 50


def test_a_long_module_says_why_at_its_top() -> None:
    unexplained = []
    for path in _modules():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") <= MAX_MODULE_LINES:
            continue
        doc = ast.get_docstring(ast.parse(text)) or ""
        if "Over 500 lines because" not in doc:
            unexplained.append(f"{path.relative_to(PACKAGE)} ({text.count(chr(10))} lines)")
    assert not unexplained, (
        f"modules over {MAX_MODULE_LINES} lines without a reason at the top: {unexplained}"
    )


def test_no_function_is_longer_than_the_limit() -> None:
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
