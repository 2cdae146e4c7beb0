"""Latency as the trace's users saw it, on a real vLLM CPU engine whose admission ceiling binds.

A burst of requests all due at once meets `replay.max_concurrency = 1`: every request but the first waits
in soakd, not in the server. TTFT from the send (the server's view) stays short; TTFT as offered (from the
due time) carries the wait, and the `ttft_p99_ms` criterion judges that one: a threshold between the
two FAILs the run where a send-relative figure would have passed it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from servers import run_soakd

pytestmark = pytest.mark.integration

BURST = 12
JUDGE = ("--rejudge", "--exit-code", "--json")


def _config(path: Path, model: Path, ttft_p99_ms: float | bool) -> Path:
    threshold = str(ttft_p99_ms).lower() if isinstance(ttft_p99_ms, bool) else f"{ttft_p99_ms:.1f}"
    path.write_text(
        f"""
[run]
name = "ceiling"
duration = "30s"
output_dir = "runs"
[trace]
path = "trace.jsonl"
format = "mooncake"
[replay]
loop = false
max_concurrency = 1
warmup_requests = 0
[engine]
model = "{model}"
max_model_len = 512
enforce_eager = true
[engine.speculative]
enabled = false
[telemetry]
interval = "1s"
collectors = ["host", "engine"]
[criteria]
ttft_p99_ms = {threshold}
tpot_p99_ms = false
min_completed_ratio = 0.0
""",
        encoding="utf-8",
    )
    return path


def test_a_binding_ceiling_is_in_ttft_as_offered_and_fails_what_the_send_view_passes(
    tmp_path: Path, tiny_model: Path
) -> None:
    # The burst, due at once (a trace's rush), each answer 96 tokens long: ~12 answers back to back.
    rows = [
        {"timestamp": 0, "input_length": 64, "output_length": 96, "hash_ids": [100 + i]} for i in range(BURST)
    ]
    (tmp_path / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = _config(tmp_path / "config.toml", tiny_model, False)
    code, out, err = run_soakd(cfg, tmp_path, timeout_s=400)
    assert code in (0, 1), err[-3000:]
    summary = json.loads(out)
    run_dir = Path(summary["run_dir"])
    verdict = json.loads((run_dir / "verdict.json").read_text())
    m = verdict["metrics"]
    assert m["completed"] == BURST
    sent, offered, wait = m["p99(ttft_ms)"], m["p99(ttft_offered_ms)"], m["p99(queue_ms)"]
    # All but the first waited for a free slot; the wait is inside the user's view and outside the server's.
    assert m["admission_wait_share"] == pytest.approx((BURST - 1) / BURST)
    assert offered >= wait > 0
    assert offered > 3 * sent, (offered, sent)  # a ratio measured in this run, not a fixed time
    print(
        f"\nceiling bound: TTFT p99 as offered {offered:.0f} ms, from the send {sent:.0f} ms, "
        f"wait {wait:.0f} ms"
    )
    req = verdict["requests"]
    assert req["ttft_offered"]["p99_ms"] == pytest.approx(offered)
    assert req["queue"]["p99_ms"] == pytest.approx(wait)

    # Judged again with a threshold between the two views: the user's TTFT fails it, the server's passes.
    threshold = math.sqrt(offered * sent)
    again_cfg = _config(tmp_path / "again.toml", tiny_model, threshold)
    rep = subprocess.run(
        [sys.executable, "-m", "soakd", "report", str(run_dir), "--config", str(again_cfg), *JUDGE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert rep.returncode == 1, rep.stderr
    judged = json.loads(rep.stdout)
    ttft = next(c for c in judged["criteria"] if c["name"] == "ttft_p99_ms")
    assert not ttft["passed"] and ttft["value"] == pytest.approx(offered)
    assert judged["metrics"]["p99(ttft_ms)"] < ttft["threshold"]
    assert "admission ceiling bound" in ttft["detail"] and "from the send" in ttft["detail"]

    # Where the verdict is read: the printout and the report's headline say the ceiling bound.
    printed = subprocess.run(
        [sys.executable, "-m", "soakd", "report", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "admission ceiling bound" in printed.stdout, printed.stdout
    report = json.loads((run_dir / "report.json").read_text())
    labels = {h["label"]: h for h in report["headline"]}
    assert labels["admission ceiling bound"]["warn"] and "TTFT p99 as offered" in labels
    assert "TTFT p99 as offered" in (run_dir / "report.html").read_text()
