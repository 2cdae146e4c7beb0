"""A run folder has one owner: two real `soakd run --resume` of one crashed run at once, exactly one takes
it up; a run folder's files that are links (or not regular files) are refused by resume and report, their
targets never read or appended to."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from soakd.checkpoint import Checkpoint
from soakd.cli import main
from soakd.errors import InputError
from soakd.metric import Sample
from soakd.owner import RunOwned, check_run_files, release, take
from soakd.resume import DueJournal, read_journal
from soakd.rundir import JOURNAL_FILE, LOCK_FILE, META_FILE
from soakd.sinks.spool import Spool, iter_samples
from soakd.testing import PEAK_RSS_LIMIT_MB, PeakRss, measured

DAEMON = Path(__file__).resolve().parents[3] / "daemon"

# `soakd run` itself (soakd.cli.main: its argument parsing, error printing and exit codes), with the
# stub engine of soakd.testing and the config of stub_config (no engine.kind runs without a model).
_CLI = """
import asyncio, json, pathlib, sys
import soakd.app, soakd.cli, soakd.cli.run
from soakd.testing import StubEngine, stub_config

class Slow(StubEngine):
    async def generate(self, request):
        async for n in super().generate(request):
            await asyncio.sleep(0.15)  # several requests in flight at any time
            yield n

soakd.app.make_engine = lambda c, m, col, log_dir=None: Slow(col)
soakd.cli.run.load_config = lambda path, over: stub_config(pathlib.Path({tmp!r}), **json.loads({over!r}))
sys.exit(soakd.cli.main(sys.argv[1:]))
"""

OVERRIDES = {
    "run.duration": "8s",
    "run.checkpoint_interval": "0.5s",
    "run.report": False,
    "trace.synthetic.duration": "8s",
    "trace.arrivals.rate_rps": 15.0,
    "criteria.max_interruptions": 1,
    "criteria.ttft_p99_ms": False,
    "criteria.tpot_p99_ms": False,
}


def _soakd(tmp: Path, *args: str, rss: Path | None = None) -> subprocess.Popen[str]:
    """`soakd run ARGS`; with `rss`, under the parent that measures its peak RSS (its pid is then the
    parent's: soakd's own is in what `PeakRss.read(rss)` reads at the end)."""
    code = _CLI.format(tmp=str(tmp), over=json.dumps(OVERRIDES))
    argv = [sys.executable, "-c", code, "run", "--no-progress", *args]
    return subprocess.Popen(
        measured(argv, rss) if rss is not None else argv,
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(DAEMON)},
    )


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop a process this test started, by its pid, and reap it."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()


def _journal_lines(runs: Path) -> int:
    journals = list(runs.glob("*/" + JOURNAL_FILE))
    return len(journals[0].read_bytes().splitlines()) if journals else 0


def _crash_a_run(tmp: Path) -> Path:
    """A run folder left by a real SIGKILL of `soakd run` mid-replay."""
    runs = tmp / "runs"
    first = _soakd(tmp)
    try:
        deadline = time.monotonic() + 60
        while _journal_lines(runs) < 30:
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the soak did not get going"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
    finally:
        _stop(first)
    (run_dir,) = runs.iterdir()
    return run_dir


def test_two_resumes_of_one_crashed_run_at_once_only_one_takes_it_up(tmp_path: Path) -> None:
    run_dir = _crash_a_run(tmp_path)
    journal_at_crash = read_journal(run_dir / JOURNAL_FILE)
    a = _soakd(tmp_path, "--resume", rss=tmp_path / "a.maxrss")
    b = _soakd(tmp_path, "--resume", rss=tmp_path / "b.maxrss")
    try:
        _, err_a = a.communicate(timeout=120)
        _, err_b = b.communicate(timeout=120)
    finally:
        _stop(a)
        _stop(b)
    peak_a, peak_b = PeakRss.read(tmp_path / "a.maxrss"), PeakRss.read(tmp_path / "b.maxrss")
    for peak in (peak_a, peak_b):
        peak.note("owner/two-resumes-at-once")
        assert peak.mb < PEAK_RSS_LIMIT_MB
    codes = sorted(
        [(a.returncode, peak_a.pid, err_a), (b.returncode, peak_b.pid, err_b)], key=lambda t: t[0] != 2
    )
    (refused_code, _, refused_err), (owner_code, owner_pid, owner_err) = codes
    assert refused_code == 2, (a.returncode, err_a[-2000:], b.returncode, err_b[-2000:])
    # PASS or FAIL (the lost requests may fail a criterion): the run's own verdict, not an error.
    assert owner_code in (0, 1), owner_err[-3000:]
    # One line, naming the folder and the owner's pid; no traceback.
    (line,) = refused_err.strip().splitlines()
    assert line.startswith(f"soakd: error: {run_dir}: ") and f"(pid {owner_pid})" in line
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]  # no new run either

    # Every request journaled once and recorded once, across the crashed process and the one resume.
    lines = (run_dir / JOURNAL_FILE).read_bytes().splitlines()
    keys = Counter(tuple(raw.split()[:3]) for raw in lines if raw.strip())
    assert max(keys.values()) == 1
    assert len(keys) > len(journal_at_crash)
    records = Counter(
        (int(r.fields["loop"]), int(r.fields["index"]), int(r.fields.get("copy", 0)))
        for r in iter_samples(run_dir / "spool", "requests")
    )
    assert max(records.values()) == 1
    events = [s.tags["kind"] for s in iter_samples(run_dir / "spool", "events")]
    assert events.count("run_resume") == 1 and events.count("run_end") <= 1
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert len(verdict["interruptions"]) == 1 and verdict["exit_code"] == owner_code


def _crashed_run(out: Path) -> Path:
    """A run folder as a SIGKILL leaves it (checkpoint, journal, spool, meta; no summary)."""
    run_dir = out / "20261130T010203Z-soak-ab12"
    run_dir.mkdir(parents=True)
    Checkpoint("20261130T010203Z-soak-ab12", "fp", "2026-11-30T01:02:03+00:00", 60.0, 9.0).write(run_dir)
    j = DueJournal(run_dir / JOURNAL_FILE)
    for i in range(3):
        j.append((0, i, 0), float(i))
    j.close()
    with Spool(run_dir / "spool", 1 << 20, 1.0) as spool:
        spool.write([Sample("requests", {"index": 0, "loop": 0, "turn": 0}, 10, {"status": "ok"})])
    (run_dir / META_FILE).write_text(json.dumps({"run_id": run_dir.name, "config": {}}))
    return run_dir


def _link_to_a_target(run_dir: Path, name: str, tmp: Path) -> tuple[Path, bytes, int]:
    target = tmp / f"target-{name}"
    target.write_bytes(b"not soakd's: 0 0 0 0.0\n")
    os.utime(target, ns=(1_000_000_000, 1_000_000_000))
    (run_dir / name).unlink()
    (run_dir / name).symlink_to(target)
    return target, target.read_bytes(), target.stat().st_mtime_ns


@pytest.mark.parametrize("name", [JOURNAL_FILE, META_FILE])
def test_resume_refuses_a_run_file_that_is_a_symlink(tmp_path: Path, name: str) -> None:
    run_dir = _crashed_run(tmp_path / "runs")
    target, before, mtime = _link_to_a_target(run_dir, name, tmp_path)
    proc = _soakd(tmp_path, "--resume")
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        _stop(proc)
    assert proc.returncode == 2, err[-2000:]
    (line,) = err.strip().splitlines()
    assert (
        line == f"soakd: error: {run_dir / name}: refused: a symlink; a run folder's files are never followed"
    )
    assert target.read_bytes() == before and target.stat().st_mtime_ns == mtime
    assert (run_dir / name).is_symlink()
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]  # nothing new started


def test_report_refuses_a_symlinked_meta_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _crashed_run(tmp_path / "runs")
    target, before, mtime = _link_to_a_target(run_dir, META_FILE, tmp_path)
    assert main(["report", str(run_dir)]) == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("soakd: error:")]
    assert line.endswith(
        f"{run_dir / META_FILE}: refused: a symlink; a run folder's files are never followed"
    )
    assert target.read_bytes() == before and target.stat().st_mtime_ns == mtime
    assert not (run_dir / "report.html").exists() and not (run_dir / "report.json").exists()


def test_a_fifo_or_a_folder_in_place_of_a_run_file_is_refused(tmp_path: Path) -> None:
    run_dir = _crashed_run(tmp_path / "runs")
    (run_dir / "control-state.json").mkdir()
    with pytest.raises(InputError, match=r"control-state\.json: refused: a directory, not a regular file"):
        check_run_files(run_dir)
    (run_dir / "control-state.json").rmdir()
    os.mkfifo(run_dir / "verdict.json")
    with pytest.raises(InputError, match=r"verdict\.json: refused: a FIFO"):
        check_run_files(run_dir)
    (run_dir / "verdict.json").unlink()
    seg = run_dir / "spool" / "seg-00000099.lp"
    seg.symlink_to(tmp_path / "elsewhere.lp")
    with pytest.raises(InputError, match=r"seg-00000099\.lp: refused: a symlink"):
        check_run_files(run_dir)
    check_run_files(run_dir, segments=False)  # a report skips such a segment, as every spool reader does


def test_the_journal_is_never_appended_through_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x")
    (tmp_path / JOURNAL_FILE).symlink_to(target)
    with pytest.raises(InputError, match="refused: a symlink"):
        DueJournal(tmp_path / JOURNAL_FILE)
    with pytest.raises(InputError, match="refused: a symlink"):
        read_journal(tmp_path / JOURNAL_FILE)
    assert target.read_bytes() == b"x"


_HOLD = """
import sys, time, pathlib
from soakd.owner import take
take(pathlib.Path(sys.argv[1]))
print("owned", flush=True)
time.sleep(60)
"""


def test_the_owner_is_named_and_its_death_frees_the_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(DAEMON)},
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "owned"
        with pytest.raises(RunOwned, match=rf"owned by another soakd process \(pid {holder.pid}\)"):
            take(run_dir)
        os.kill(holder.pid, signal.SIGKILL)  # a crash: the kernel drops the lock
        holder.wait(timeout=10)
        take(run_dir)
        assert (run_dir / LOCK_FILE).read_text().strip() == str(os.getpid())
        assert oct((run_dir / LOCK_FILE).stat().st_mode & 0o777) == "0o600"
    finally:
        _stop(holder)
        release(run_dir)


def test_a_lock_file_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).symlink_to(target)
    with pytest.raises(InputError, match="cannot own the run folder: a symlink"):
        take(run_dir)
    assert target.read_bytes() == b"keep"
