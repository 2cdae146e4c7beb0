"""Crash-resume: the journal and checkpoint, choosing the run to resume, and a real SIGKILL of a soak
process (with the stub engine of soakd.testing) followed by a resumed start that finishes the same run."""

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

from soakd.app import Soak
from soakd.checkpoint import Checkpoint, read_checkpoint
from soakd.collectors.engine import EngineCollector
from soakd.config import Config
from soakd.metric import Sample, parse_line
from soakd.replay.pacer import Scheduled, schedule
from soakd.resume import (
    DueJournal,
    find_resumable,
    load_state,
    read_journal,
    shifted,
)
from soakd.rundir import JOURNAL_FILE
from soakd.sinks.spool import Spool, iter_samples
from soakd.sinks.writer import SampleWriter
from soakd.testing import StubEngine, stub_config
from soakd.traces.model import RequestSpec

DAEMON = Path(__file__).resolve().parents[3] / "daemon"


def _spec(index: int, arrival: float = 0.0, copy: int = 0) -> RequestSpec:
    return RequestSpec(
        index=index, arrival_s=arrival, input_tokens=8, output_tokens=4, block_size=16, copy=copy
    )


def test_journal_survives_a_torn_last_line(tmp_path: Path) -> None:
    j = DueJournal(tmp_path / JOURNAL_FILE)
    j.append((0, 1, 0), 0.5)
    j.append((1, 1, 2), 7.25)
    j.close()
    with (tmp_path / JOURNAL_FILE).open("ab") as f:
        f.write(b"1 2 0 7.")  # killed mid-line
    assert read_journal(tmp_path / JOURNAL_FILE) == {(0, 1, 0): 0.5, (1, 1, 2): 7.25}
    assert oct((tmp_path / JOURNAL_FILE).stat().st_mode & 0o777) == "0o600"


def _crashed_run(out: Path, name: str = "soak", fp: str = "fp1") -> Path:
    """A run directory as a SIGKILL leaves it: checkpoint, journal, spool, no summary."""
    run_dir = out / f"20261130T010203Z-{name}-ab12"
    run_dir.mkdir(parents=True)
    cp = Checkpoint("20261130T010203Z-" + name + "-ab12", fp, "2026-11-30T01:02:03+00:00", 60.0, 9.0)
    cp.write(run_dir)
    j = DueJournal(run_dir / JOURNAL_FILE)
    for i in range(5):
        j.append((0, i, 0), float(i * 3))
    j.close()
    with Spool(run_dir / "spool", 1 << 20, 1.0) as spool:
        spool.write(
            [
                Sample("requests", {"index": i, "loop": 0, "turn": 0}, 10 + i, {"status": "ok"})
                for i in (0, 1, 3)
            ]
            + [Sample("host", {"cpu": 1.0}, 20)]
        )
    return run_dir


def test_state_of_a_crashed_run(tmp_path: Path) -> None:
    run_dir = _crashed_run(tmp_path)
    cp = read_checkpoint(run_dir)
    assert cp is not None
    state = load_state(run_dir, cp)
    assert state.lost == [(0, 2, 0), (0, 4, 0)]  # came due, never finished
    assert state.finished == 3 and state.metrics.summary().scheduled == 3
    assert state.offset_s == 12.0  # the journal's last due time beats the 9 s checkpoint
    assert state.remaining_s == 48.0
    assert state.points == {"requests": 3, "host": 1}
    assert state.last_point_ns == 20


def test_points_after_a_resume_come_after_the_spool_even_if_the_clock_went_back(tmp_path: Path) -> None:
    with Spool(tmp_path, 1 << 20, 1.0) as spool:
        w = SampleWriter(spool, {"run_id": "r"}, after_ns=1_000)
        w([Sample("m", {"a": 1}, 500), Sample("m", {"a": 2}, 500), Sample("n", {"a": 3}, 2_000)])
    times = [(s.measurement, s.time_ns) for s in iter_samples(tmp_path)]
    assert times == [("m", 1_001), ("m", 1_002), ("n", 2_000)]
    assert w.clock_behind == 2


def test_which_run_is_resumed(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    run_dir = _crashed_run(out)
    now = time.time_ns()
    found = find_resumable(out, "soak", "fp1", 3600.0, now)
    assert found is not None and found[0] == run_dir and found[1].elapsed_s == 9.0
    assert find_resumable(out, "soak", "other-config", 3600.0, now) is None
    assert find_resumable(out, "other-name", "fp1", 3600.0, now) is None
    assert find_resumable(out, "soak", "fp1", 60.0, now + int(3600e9)) is None  # too long ago
    cp = read_checkpoint(run_dir)
    assert cp is not None
    cp.stopped_by = "SIGTERM"  # stopped on purpose, then cut short: not a crash
    cp.write(run_dir)
    assert find_resumable(out, "soak", "fp1", 3600.0, now) is None
    cp.stopped_by = ""
    cp.write(run_dir)
    assert find_resumable(out, "soak", "fp1", 3600.0, time.time_ns()) is not None
    (run_dir / "summary.json").write_text("{}")
    assert find_resumable(out, "soak", "fp1", 3600.0, now) is None  # it finished


def test_shifted_schedule_skips_what_came_due_and_starts_at_the_offset() -> None:
    items = [Scheduled(_spec(i, float(i)), loop=0, due_s=float(i)) for i in range(6)]
    items.append(Scheduled(_spec(2, 2.0, copy=1), loop=0, due_s=2.0))
    done = {(0, 0, 0): 0.0, (0, 1, 0): 1.0, (0, 2, 0): 2.0, (0, 4, 0): 4.0}
    out = list(shifted(items, done, 3.5))
    assert [(s.spec.index, s.spec.copy, s.due_s) for s in out] == [(3, 0, 0.0), (5, 0, 1.5), (2, 1, 0.0)]


# -- a real crash ---------------------------------------------------------------------------------------

_SOAK = """
import asyncio, json
from soakd.testing import StubEngine, stub_config
from soakd.app import Soak
from soakd.sinks.writer import SampleWriter
from soakd.collectors.engine import EngineCollector
from soakd.config import Config

class Slow(StubEngine):
    async def generate(self, request):
        async for n in super().generate(request):
            await asyncio.sleep(0.15)  # several requests in flight at any time
            yield n

cfg = stub_config(__import__("pathlib").Path({tmp!r}), **json.loads({over!r}))
soak = Soak(cfg, engine_factory=lambda c, m, col: Slow(col), resume={resume})
result = asyncio.run(soak.run())
print(json.dumps({{"run_id": result.run_id, "run_dir": str(result.run_dir)}}))
"""

OVERRIDES = {
    "run.duration": "8s",
    "run.checkpoint_interval": "0.5s",
    "trace.synthetic.duration": "8s",
    "trace.arrivals.rate_rps": 15.0,
    "criteria.max_interruptions": 1,
    "criteria.ttft_p99_ms": False,
    "criteria.tpot_p99_ms": False,
}


def _start(tmp: Path, resume: bool) -> subprocess.Popen[str]:
    code = _SOAK.format(tmp=str(tmp), over=json.dumps(OVERRIDES), resume=resume)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=tmp,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(DAEMON)},
    )


def _journal_lines(runs: Path) -> int:
    journals = list(runs.glob("*/" + JOURNAL_FILE))
    return len(journals[0].read_bytes().splitlines()) if journals else 0


def test_sigkill_then_resume_finishes_the_same_run_with_exact_accounting(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    first = _start(tmp_path, resume=False)
    try:
        deadline = time.monotonic() + 60
        while _journal_lines(runs) < 40:  # about 3 s into the replay
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the soak did not get going"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)
    finally:
        first.kill()
        first.communicate()
    assert first.returncode == -signal.SIGKILL
    (run_dir,) = runs.iterdir()
    due_at_kill = read_journal(run_dir / JOURNAL_FILE)
    finished_at_kill = {
        (int(s.fields["loop"]), int(s.fields["index"]), int(s.fields.get("copy", 0)))
        for s in iter_samples(run_dir / "spool", "requests")
    }
    lost = set(due_at_kill) - finished_at_kill
    assert lost, "nothing was in flight at the kill: the test proves less than it should"
    assert not (run_dir / "summary.json").exists()

    second = _start(tmp_path, resume=True)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["run_dir"] == str(run_dir)  # the same run id
    assert [p.name for p in runs.iterdir()] == [run_dir.name]

    # Every request the trace schedules is either recorded exactly once or was lost in flight.
    trace = Soak(stub_config(tmp_path, **OVERRIDES)).trace
    s = trace.summary
    planned = [
        (it.loop, it.spec.index, it.spec.copy)
        for it in schedule(trace, span_s=s.span_s, requests=s.requests, speed=1.0, duration_s=8.0, loop=True)
    ]
    records = list(iter_samples(run_dir / "spool", "requests"))
    keys = Counter(
        (int(r.fields["loop"]), int(r.fields["index"]), int(r.fields.get("copy", 0))) for r in records
    )
    assert max(keys.values()) == 1  # nothing replayed twice
    assert set(keys) == set(planned) - lost and not (set(keys) & lost)

    verdict = json.loads((run_dir / "verdict.json").read_text())
    # Lost requests were scheduled and did not complete: the whole run's accounting, in the verdict,
    # the summary and the printout alike.
    req = verdict["requests"]
    assert req["scheduled"] == len(planned) and req["completed"] + req["failed"] == len(planned)
    assert req["lost_in_flight"] == len(lost) and req["completed"] <= len(planned) - len(lost)
    assert req["completed_ratio"] < 1.0
    assert verdict["lost_in_flight"] == len(lost)
    (gap,) = verdict["interruptions"]
    assert gap["lost_in_flight"] == len(lost) and gap["down_s"] > 0 and 2.0 < gap["at_s"] < 8.0
    assert {c["name"]: c["passed"] for c in verdict["criteria"]}["interruptions"] is True  # max 1 allowed
    assert verdict["ran_s"] >= 8.0 * 0.99

    # No point twice: every series keeps strictly one point per timestamp across both processes.
    seen: Counter[tuple[str, tuple[tuple[str, str], ...], int]] = Counter()
    for seg in sorted((run_dir / "spool").glob("seg-*.lp")):
        for line in seg.read_text().splitlines():
            p = parse_line(line)
            seen[(p.measurement, tuple(sorted(p.tags.items())), p.time_ns)] += 1
    assert max(seen.values()) == 1
    events = [s.tags["kind"] for s in iter_samples(run_dir / "spool", "events")]
    assert events.count("run_start") == 1 and events.count("run_resume") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["points"]["requests"] == len(records)  # counts cover both processes
    assert summary["requests"] == req
    assert summary["resume"]["interruptions"][0]["lost_in_flight"] == len(lost)


def test_a_second_crash_does_not_count_the_first_ones_lost_again(tmp_path: Path) -> None:
    run_dir = _crashed_run(tmp_path)
    cp = read_checkpoint(run_dir)
    assert cp is not None
    first = load_state(run_dir, cp)
    cp.lost.extend(first.lost)  # what the first resume records
    cp.write(run_dir)
    again = read_checkpoint(run_dir)
    assert again is not None and again.lost == first.lost
    assert load_state(run_dir, again).lost == []  # nothing new was in flight
    assert first.done == {(0, i, 0) for i in range(5)}


def test_the_journal_heals_a_torn_tail_before_appending(tmp_path: Path) -> None:
    path = tmp_path / JOURNAL_FILE
    path.write_bytes(b"0 1 0 0.5\n0 2 0 1.")  # a power loss tore the last line
    j = DueJournal(path)
    j.append((0, 3, 0), 2.0)
    j.close()
    assert read_journal(path)[(0, 3, 0)] == 2.0


def test_only_the_newest_run_is_a_candidate(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    _crashed_run(out)
    (out / "20261130T020000Z-soak-cd34").mkdir()  # newer, died before its first checkpoint
    assert find_resumable(out, "soak", "fp1", 3600.0) is None


async def test_a_crash_after_the_replay_ended_only_finishes_the_run(tmp_path: Path) -> None:
    engines: list[StubEngine] = []

    def factory(cfg: Config, model: str, collector: EngineCollector) -> StubEngine:
        engines.append(StubEngine(collector))
        return engines[-1]

    cfg = stub_config(tmp_path, **{"run.duration": "2s"})
    done = await Soak(cfg, engine_factory=factory).run()
    # As if the daemon died while stopping the engine: everything but the summary is on disk.
    (done.run_dir / "summary.json").unlink()
    resumed = Soak(cfg, engine_factory=factory, resume=True)
    assert resumed.run_id == done.run_id
    result = await resumed.run()
    assert len(engines) == 1  # no second engine built, let alone started
    assert result.verdict.interruptions == [] and result.verdict.word == done.verdict.word
    assert result.verdict.requests.scheduled == done.verdict.requests.scheduled
    assert result.summary["ran_s"] == pytest.approx(done.summary["ran_s"])


def test_a_resumed_engine_starts_with_the_changes_already_due(tmp_path: Path) -> None:
    cfg = stub_config(
        tmp_path,
        **{"engine.changes": [{"at": "10s", "max_num_seqs": 4}, {"at": "100s", "max_num_seqs": 2}]},
    )
    soak = Soak(cfg)
    assert soak.engine_config().max_num_seqs == cfg.engine.max_num_seqs
    soak.live.offset_s = 50.0
    assert soak.engine_config().max_num_seqs == 4


def test_meta_json_never_holds_secrets_put_in_the_config() -> None:
    from soakd.redact import redacted

    doc = {
        "engine": {"server": {"env": {"HF_TOKEN": "hf_x", "CUDA_VISIBLE_DEVICES": "0"}}, "url": ""},
        "sinks": {"influx": {"url": "http://soakd:pw@db:8086/?db=s&p=pw", "token_env": "SOAKD_INFLUX_TOKEN"}},
        "trace": {"tokenizer": "models/tok"},
    }
    out = redacted(doc)
    assert "pw" not in str(out) and "hf_x" not in str(out)
    assert out["engine"]["server"]["env"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert out["sinks"]["influx"]["url"] == "http://<redacted>@db:8086/?db=s&p=<redacted>"
    assert out["sinks"]["influx"]["token_env"] == "SOAKD_INFLUX_TOKEN"
    assert out["trace"]["tokenizer"] == "models/tok"


def test_a_bad_credential_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from soakd.errors import ConfigError

    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "SOAKD_INFLUX_TOKEN").write_bytes(b"\xff\xfe not utf-8")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    cfg = stub_config(tmp_path, **{"sinks.influx.enabled": True, "sinks.influx.api": "v2"})
    with pytest.raises(ConfigError):
        Soak(cfg)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_printout_counts_the_whole_run(capsys: pytest.CaptureFixture[str]) -> None:
    from soakd.cli.run import print_summary

    summary = {
        "run_id": "r",
        "ran_s": 10.0,
        "points": {},
        "replay": {"scheduled": 53, "completed": 53, "failed": 0, "shed": 0, "output_tokens": 106},
        "requests": {
            "scheduled": 80,
            "completed": 72,
            "failed": 8,
            "shed": 0,
            "output_tokens": 160,
            "lost_in_flight": 8,
        },
    }
    print_summary(summary, Path("runs/r"))
    out = capsys.readouterr().out
    assert "80 scheduled, 72 completed, 8 failed (8 lost in flight at restarts)" in out
    assert "(16.0 tok/s)" in out
    assert "not the trace's" not in out  # nothing else was sent
    summary["outside_trace"] = {"warmup_requests": 0, "vocab_probe_requests": 12}
    print_summary(summary, Path("runs/r"))
    assert "also sent, not the trace's: 12 vocabulary probe requests" in capsys.readouterr().out
