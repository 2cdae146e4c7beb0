"""dashboards/soak.json against Grafana's own published schema (@grafana/schema's Dashboard type,
checked by the TypeScript compiler): every key Grafana knows has the type Grafana gives it, and every
required key is there. Enums are compared as their string values (JSON holds those), and keys Grafana's
common schema does not list (a datasource's query fields, a variable's `definition`) are allowed, as
Grafana allows them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "dashboards" / "soak.json"
TOOLS = ROOT / ".cache" / "grafana-schema"
# Pinned: the schema a change is checked against does not move under it.
PACKAGES = ("typescript@5.9.3", "@grafana/schema@13.2.3")

PRELUDE = """import type { Dashboard } from '@grafana/schema';
type Lit<T> = T extends string
  ? T | `${T}`
  : T extends number | boolean | null | undefined
    ? T
    : T extends readonly (infer U)[]
      ? Lit<U>[]
      : T extends object
        ? { [K in keyof T]: Lit<T[K]> } & { [extra: string]: unknown }
        : T;
export const dashboard = """


@pytest.fixture(scope="module")
def tsc() -> Path:
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        if os.environ.get("SOAKD_REQUIRE_SERVERS") == "1":
            pytest.fail("node and npm are needed to check the dashboard against @grafana/schema")
        pytest.skip("node/npm not installed")
    compiler = TOOLS / "node_modules" / "typescript" / "bin" / "tsc"
    if not compiler.exists() or not (TOOLS / "node_modules" / "@grafana" / "schema").is_dir():
        TOOLS.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [npm, "install", "--no-audit", "--no-fund", "--silent", "--prefix", str(TOOLS), *PACKAGES],
            check=True,
            timeout=600,
        )
    return compiler


def _check(tsc: Path, dashboard: dict[str, Any], name: str) -> subprocess.CompletedProcess[str]:
    source = TOOLS / f"{name}.ts"
    source.write_text(PRELUDE + json.dumps(dashboard, indent=1) + " satisfies Lit<Dashboard>;\n")
    argv = ["node", str(tsc), "--noEmit", "--strict", "--skipLibCheck", "--module", "commonjs"]
    argv += ["--moduleResolution", "node", "--target", "es2020", source.name]
    return subprocess.run(argv, cwd=TOOLS, capture_output=True, text=True, timeout=300, check=False)


def test_the_dashboard_is_a_grafana_dashboard(tsc: Path) -> None:
    result = _check(tsc, json.loads(DASHBOARD.read_text(encoding="utf-8")), "soak")
    assert result.returncode == 0, result.stdout[-3000:]


def test_the_check_finds_a_broken_dashboard(tsc: Path) -> None:
    broken = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    broken["panels"][1]["gridPos"]["h"] = "six"  # a string where Grafana wants a number
    del broken["panels"][2]["type"]  # a panel without its type
    broken["templating"]["list"][1]["current"] = {}  # no text and value
    result = _check(tsc, broken, "broken")
    assert result.returncode != 0
    assert result.stdout.count("error TS") >= 3, result.stdout[-3000:]
