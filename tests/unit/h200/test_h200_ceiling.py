"""A Ctrl-C and a binding admission ceiling on an H200 (tests/data/h200/ceiling_sigint): `config.gpu.toml`
with a Qwen3-8B shape, `replay.rate_scale = 1.5` and `replay.max_concurrency = 32`, stopped by SIGINT to
soakd's whole process group 71 s into the replay (benchmarks/h200_ceiling/run.sh). The engine lived
through it (no request failed); soakd exited 4; TTFT as offered failed where the send's view passed."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from soakd.cli import main
from soakd.metric import parse_line
from soakd.testing import recorded_run_dir

DATA = Path(__file__).resolve().parents[2] / "data" / "h200" / "ceiling_sigint"


def _run(root: Path) -> Path:
    run = recorded_run_dir(root, DATA.name, data=DATA.parent)
    (run / "verdict.json").unlink()  # judged here again
    return run


def test_a_stop_by_ctrl_c_is_judged_again_as_the_gpu_machine_judged_it(tmp_path: Path) -> None:
    run = _run(tmp_path)
    there = json.loads((DATA / "verdict.json").read_text())
    assert (there["exit_code"], there["stopped_by"], there["replay_began"]) == (4, "SIGINT", True)
    assert there["requests"]["failed"] == 0 and there["requests"]["completed"] == 835
    assert main(["report", str(run), "--rejudge", "--no-report"]) == 0
    here = json.loads((run / "verdict.json").read_text())
    assert here["exit_code"] == 4 and here["stopped_by"] == "SIGINT" and here["verdict"] == there["verdict"]
    assert [(c["name"], c["passed"]) for c in here["criteria"]] == [
        (c["name"], c["passed"]) for c in there["criteria"]
    ]
    for a, b in zip(here["criteria"], there["criteria"], strict=True):
        if b["value"] is not None:
            assert a["value"] == pytest.approx(b["value"], rel=1e-9), a["name"]
    duration = here["criteria"][0]
    assert duration["informational"] and "by SIGINT" in duration["detail"]
    # What failed is TTFT as offered: 17 s from the due time, 0.44 s from the send.
    failed = {c["name"] for c in here["criteria"] if not c["passed"]}
    assert "ttft_p99_ms" in failed and "error_rate" not in failed and "completed_ratio" not in failed
    m = here["metrics"]
    assert m["p99(ttft_offered_ms)"] > 10_000 > 1_000 > m["p99(ttft_ms)"]
    assert m["admission_wait_share"] > 0.8


def test_each_request_of_the_gpu_run_is_late_by_its_admission_wait_and_lateness_no_more() -> None:
    # On the GPU machine's clock, per request: TTFT as offered = admission wait + lateness + TTFT from the
    # send, to the stamps' microseconds; never less than the send's view.
    seen = 0
    with gzip.open(DATA / "spool.lp.gz", "rt") as f:
        for line in f:
            if not line.startswith("requests,"):
                continue
            p = parse_line(line.rstrip("\n"))
            if p.tags.get("status") != "ok":
                continue
            fl = {k: float(v) for k, v in p.fields.items() if isinstance(v, int | float)}
            parts = fl["queue_s"] + fl["lateness_s"] + fl["ttft_s"]
            assert fl["ttft_offered_s"] == pytest.approx(parts, abs=1e-3)
            assert fl["ttft_offered_s"] >= fl["ttft_s"] and fl["e2e_offered_s"] >= fl["e2e_s"]
            seen += 1
    assert seen == 835
