"""The bad-input corpus (tests/data/bad_input): every case is refused with exit code 2, one line on
stderr naming file, line and key, no traceback, and nothing written.

Each case runs the real CLI in-process (or, marked `subprocess`, as `python -m soakd` in a child process
whose crash cannot take the test run down), in a temporary copy of the corpus (so a case that wrongly writes
a run directory or an output file writes it there, and the test sees it). The copy is shared by the
cases, to keep the test fast; a case that changes it fails and leaves the next one a fresh copy.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tomllib
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from soakd.cli import main
from soakd.errors import EXIT_INPUT

CORPUS = Path(__file__).resolve().parents[2] / "data" / "bad_input"
PREFIX = "soakd: error: "


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    argv: list[str]
    reason: str
    file: str | None = None
    line: int | None = None
    key: str | None = None
    xfail: str | None = None
    subprocess: bool = False


def _load_cases() -> list[Case]:
    with (CORPUS / "cases.toml").open("rb") as fh:
        doc: dict[str, Any] = tomllib.load(fh)
    return [Case(**entry) for entry in doc["case"]]


CASES = _load_cases()
# Address space for a `subprocess` case: ample for the CLI, and a regression that allocates without
# bound fails with MemoryError in seconds instead of pushing the machine into swap.
_CHILD_MEMORY = 2 << 30
# What refusing one case may allocate on the Python heap.
_PEAK_HEAP = 500 << 20


def _params() -> list[Any]:
    out = []
    for case in CASES:
        marks = [pytest.mark.xfail(strict=True, reason=case.xfail)] if case.xfail else []
        out.append(pytest.param(case, id=case.id, marks=marks))
    return out


def _tree(root: Path) -> dict[str, bytes]:
    """Every file and folder under root with its content: the before/after picture of a case."""
    return {
        str(p.relative_to(root)) + ("/" if p.is_dir() else ""): (b"" if p.is_dir() else p.read_bytes())
        for p in root.rglob("*")
    }


def test_manifest_is_well_formed() -> None:
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)), "case ids must be unique"
    for case in CASES:
        assert case.line is None or case.file is not None, f"{case.id}: a line needs a file"
        assert case.reason, f"{case.id}: every case names its reason"


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_CHILD_MEMORY, _CHILD_MEMORY))


def _run_child(argv: list[str], cwd: Path) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of the CLI run in a child process; a signal is a negative code."""
    env = {k: v for k, v in os.environ.items() if k not in ("SOAKD_CONFIG", "JOURNAL_STREAM")}
    done = subprocess.run(
        [sys.executable, "-m", "soakd", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_memory,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def _fresh_copy(root: Path) -> Path:
    for entry in root.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return Path(shutil.copytree(CORPUS, root / "corpus"))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding one copy of the corpus (as `corpus/`) and nothing else."""
    root = tmp_path_factory.mktemp("bad_input")
    _fresh_copy(root)
    return root


@pytest.mark.parametrize("case", _params())
def test_bad_input_is_refused_in_one_line(
    case: Case, sandbox: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = sandbox / "corpus"
    monkeypatch.chdir(work)
    # The environment must not pick a config or a log format for the case.
    monkeypatch.delenv("SOAKD_CONFIG", raising=False)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    before = _tree(sandbox)

    if case.subprocess:
        code, out, err = _run_child(case.argv, work)
    else:
        # The Python heap's peak (numpy's buffers included) while the case runs: refusing bad input
        # must not first allocate for it. benchmarks/bench_hostile_rss.py measures each case's process RSS.
        tracemalloc.start()
        try:
            code = main(case.argv)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        out, err = capsys.readouterr()
        assert peak < _PEAK_HEAP, f"{case.id}: {peak >> 20} MiB allocated to refuse it"

    assert "Traceback" not in err
    assert code == EXIT_INPUT, err
    assert err.endswith("\n") and err.count("\n") == 1, f"not exactly one line:\n{err}"
    assert err.startswith(PREFIX), err
    message = err[len(PREFIX) : -1]
    what = f"{case.key}: " if case.key else ""
    if case.file is not None:
        # Configs are named as given; traces by an absolute path (resolved from the command line,
        # joined to the config's folder from trace.path).
        at = f":{case.line}" if case.line is not None else ""
        spellings = [case.file, str(work / case.file), str((work / case.file).resolve())]
        assert any(message.startswith(f"{name}{at}: {what}") for name in spellings), (
            f"expected {case.file}{at}: {what}..., got: {message}"
        )
    elif case.key:
        # A value given on the command line: the message starts at the key and blames no file.
        assert message.startswith(what), message
    assert case.reason in message, message
    assert out == ""
    after = _tree(sandbox)
    if after != before:
        _fresh_copy(sandbox)
    assert sorted(set(after) ^ set(before)) == [], "a refused command must write nothing"
    assert after == before, "a refused command must change no file"
