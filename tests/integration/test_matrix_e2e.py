"""`soakd matrix` through real vLLM CPU engines, as a user runs it: one short synthetic trace against a
baseline and a variant with ngram speculation and 64-token chunked prefill (two engine starts, one per
variant: the suite's time goes to engine starts), with the CUDA-graph row not applicable on the CPU
build and not run; then `soakd compare` of the two runs. Each change is checked in what the engine
really did, not only in its config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from soakd.cli import main

pytestmark = pytest.mark.integration

CHUNK = 64
NGRAM_CHUNKED = f"+ngram+chunked-{CHUNK}"

CONFIG = """
[run]
duration = "3s"
output_dir = "runs"
[trace]
format = "synthetic"
[trace.arrivals]
rate_rps = 3.0
[trace.synthetic]
duration = "3s"
input_tokens_mean = 200
output_tokens_mean = 24
output_tokens_max = 48
session_share = 0.0
[engine]
model = "{model}"
max_model_len = 1024
max_num_seqs = 8
[replay]
warmup_requests = 1
[telemetry]
interval = "1s"
collectors = ["host", "engine"]
[criteria]
ttft_p99_ms = 60000.0
tpot_p99_ms = 5000.0
"""

MATRIX = f"""
config = "config.toml"

[base]
"engine.speculative.enabled" = false
"engine.enforce_eager" = true
"engine.extra_args.enable_chunked_prefill" = false

[[variant]]
name = "baseline"
what = "speculation off, eager, chunked prefill off"

[[variant]]
name = "+cuda-graphs"
what = "CUDA graphs (enforce_eager = false)"
set = {{ "engine.enforce_eager" = false }}
needs = "cuda"

[[variant]]
name = "{NGRAM_CHUNKED}"
what = "ngram speculation, 3 tokens; chunked prefill, {CHUNK}-token chunks"
[variant.set]
"engine.speculative.enabled" = true
"engine.speculative.method" = "ngram"
"engine.extra_args" = {{ enable_chunked_prefill = true, max_num_batched_tokens = {CHUNK} }}
"""


def _json(path: Path) -> dict[str, object]:
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def test_matrix_on_the_cpu_engine_then_compare(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.toml").write_text(CONFIG.format(model=tiny_model), encoding="utf-8")
    (tmp_path / "matrix.toml").write_text(MATRIX, encoding="utf-8")
    out_dir = tmp_path / "runs" / "matrix"
    proc = subprocess.Popen(
        [sys.executable, "-m", "soakd", "matrix", "--matrix", "matrix.toml", "--out", str(out_dir)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the matrix, and the run it started with its engine
            proc.wait()
    assert proc.returncode == 0, (out[-3000:], err[-3000:])

    doc = _json(out_dir / "matrix.json")
    rows = {r["variant"]: r for r in doc["rows"]}  # type: ignore[attr-defined]
    assert list(rows) == ["baseline", "+cuda-graphs", NGRAM_CHUNKED]
    assert doc["platform"] == "cpu" and doc["warnings"] == []
    graphs = rows["+cuda-graphs"]
    assert graphs["status"] == "not applicable" and graphs["reason"] == "not applicable (CPU: no CUDA graphs)"
    assert graphs["run_dir"] == "" and graphs["exit_code"] is None
    # Two runs, one per applicable variant, nothing else (the graph row was not faked).
    run_dirs = sorted(p for p in (tmp_path / "runs").iterdir() if p.name != "matrix")
    ran = [rows[n] for n in ("baseline", NGRAM_CHUNKED)]
    assert sorted(Path(r["run_dir"]) for r in ran) == run_dirs
    shas = set()
    for r in ran:
        assert r["status"] == "ran" and r["verdict"] == "PASS" and r["platform"] == "cpu", r
        assert (out_dir / r["link"]).resolve() == Path(r["run_dir"]).resolve()
        assert r["metrics"]["tokens_per_s"] > 0 and r["metrics"]["peak_engine_rss_bytes"] > 100 * 2**20
        assert r["metrics"]["p50(ttft_ms)"] > 0 and r["metrics"]["requests"] > 0
        shas.add(r["trace_sha256"])
    assert len(shas) == 1  # the same trace in every run
    assert set(rows[NGRAM_CHUNKED]["vs_baseline"]) >= {"tokens_per_s", "p99(ttft_ms)", "p50(tpot_ms)"}

    # The variant changed what the engine did: drafts only with speculation; no step over the chunk
    # with chunked prefill, while the baseline prefills a ~200-token prompt in one step.
    summaries = {r["variant"]: _json(Path(r["run_dir"]) / "summary.json") for r in ran}
    spec = {n: s["spec_decode"]["drafts"] for n, s in summaries.items()}  # type: ignore[index]
    assert spec["baseline"] == 0 and spec[NGRAM_CHUNKED] > 0
    steps = {n: s["engine_telemetry"]["tokens_per_step"]["max"] for n, s in summaries.items()}  # type: ignore[index]
    assert steps[NGRAM_CHUNKED] <= CHUNK < steps["baseline"]

    # The table: printed and written, with the runs linked relatively.
    md = (out_dir / "matrix.md").read_text(encoding="utf-8")
    assert md.strip() in out
    for r in ran:
        assert f"[{r['run_id']}]({r['link']})" in md
    assert "| not applicable (CPU: no CUDA graphs) |" in md.replace("  ", "")
    assert "RSS" in md

    # compare: the matrix's two runs, the config changes between them named.
    monkeypatch.chdir(tmp_path)
    assert main(["compare", rows["baseline"]["run_dir"], rows[NGRAM_CHUNKED]["run_dir"], "--json"]) == 0
    comp = json.loads(capsys.readouterr().out)
    # The same trace and length; the engine change, the point of the comparison, is said first.
    assert comp["comparable"] is True
    assert [w.split(":")[0] for w in comp["warnings"]] == ["DIFFERENT ENGINE CONFIG"]
    assert "engine.speculative.enabled" in comp["warnings"][0]
    changes = {c["key"]: (c["a"], c["b"]) for c in comp["config_changes"]}
    assert changes["engine.speculative.enabled"] == (False, True)
    assert changes["engine.extra_args.max_num_batched_tokens"] == (None, CHUNK)
    assert set(changes) <= {
        "engine.speculative.enabled",
        "engine.speculative.method",
        "engine.extra_args.enable_chunked_prefill",
        "engine.extra_args.max_num_batched_tokens",
    }
