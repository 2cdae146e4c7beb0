"""A real-size shape without its weights, through soakd as a user runs it: `soakd model shape qwen3-0.6b`,
then `soakd run` on vLLM's CPU build with dummy weights (eager, speculation off: ngram on random weights
says nothing). About 45 s on two cores, most of it the engine's start. Checked in what the engine did:
it loaded dummy weights, drew prompt ids from the config's whole vocabulary, and the decode ceiling
counted the config's weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from servers import run_soakd

from soakd.shapes import SHAPES, param_count

pytestmark = pytest.mark.integration


def test_a_shape_folder_soaks_with_dummy_weights(tmp_path: Path) -> None:
    model = tmp_path / "qwen3-0.6b"
    proc = subprocess.run(
        [sys.executable, "-m", "soakd", "model", "shape", "qwen3-0.6b", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not list(model.glob("*.safetensors"))
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f"""
[run]
duration = "3s"
output_dir = "runs"
[trace]
format = "synthetic"
[trace.arrivals]
rate_rps = 2.0
[trace.synthetic]
duration = "3s"
input_tokens_mean = 64
output_tokens_mean = 8
output_tokens_max = 16
session_share = 0.0
[engine]
model = "{model}"
max_model_len = 512
max_num_seqs = 4
enforce_eager = true  # torch.compile is not under test; it doubles a CPU engine's start
[engine.speculative]
enabled = false
[replay]
warmup_requests = 1
[telemetry]
collectors = ["host", "engine"]
ceiling_bandwidth_gbs = 100.0
[criteria]
ttft_p99_ms = false
tpot_p99_ms = false
""",
        encoding="utf-8",
    )
    code, out, err = run_soakd(cfg, tmp_path, timeout_s=300)
    assert code in (0, 1), err[-3000:]
    summary = json.loads(out)
    run_dir = Path(summary["run_dir"])
    assert summary["replay"]["completed"] > 0
    meta = json.loads((run_dir / "meta.json").read_text())
    engine = meta["engine"]
    assert engine["details"]["load_format"] == "dummy"
    assert engine["vocab_size"] == SHAPES["qwen3-0.6b"].config["vocab_size"]
    ceiling = summary["decode_ceiling"]
    assert ceiling["available"], ceiling
    assert ceiling["weight_bytes"] == param_count(SHAPES["qwen3-0.6b"].config) * 2
