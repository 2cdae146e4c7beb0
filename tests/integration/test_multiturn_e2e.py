"""Multi-turn replay on a real vLLM CPU engine: closed-loop turns whose prompts carry the conversation,
and the engine's prefix cache hitting on them.

The trace is ShareGPT-style conversations with no block ids and no two conversations alike, so every
prefix-cache hit the engine reports comes from soakd giving a later turn the earlier turn's prompt and
the engine's answer to it as its prefix, as a chat client does. Runs the CLI as a separate process;
about 1.5 minutes (engine start + 40 s replay).
"""

from __future__ import annotations

import itertools
import json
import re
from collections import defaultdict
from pathlib import Path

import pytest
from servers import finish_soakd, start_soakd

from soakd.sinks.spool import iter_samples

pytestmark = pytest.mark.integration

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# structlog's console renderer: "2026-12-01T19:55:20.924890Z [info     ] event   key=value ...".
_CONSOLE_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[(debug|info|warning|error)\s*\] ")

CONVERSATIONS = 12
TURNS = 3
USER_CHARS = 600  # 150 tokens at the estimate of 4 characters per token
REPLY_CHARS = 96  # 24 tokens


def write_conversations(path: Path) -> None:
    rows = []
    for c in range(CONVERSATIONS):
        msgs = []
        for t in range(TURNS):
            msgs.append({"from": "human", "value": f"c{c}t{t} " + "x" * (USER_CHARS - 6)})
            msgs.append({"from": "gpt", "value": "y" * REPLY_CHARS})
        rows.append({"id": f"conv{c}", "conversations": msgs})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_multi_turn_sessions_hit_the_prefix_cache(tmp_path: Path, tiny_model: Path) -> None:
    write_conversations(tmp_path / "conv.jsonl")
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f"""
[run]
name = "multiturn"
duration = "40s"
[trace]
path = "conv.jsonl"
format = "sharegpt"
[trace.arrivals]
process = "constant"
rate_rps = 0.5
think_time = "1s"
[replay]
loop = false
warmup_requests = 2
[engine]
model = "{tiny_model}"
max_model_len = 1024
enforce_eager = true  # torch.compile is not under test; it doubles a CPU engine's start
[engine.speculative]
enabled = false
[telemetry]
collectors = ["engine"]
[criteria]
ttft_p99_ms = false
tpot_p99_ms = false
min_completed_ratio = false
""",
        encoding="utf-8",
    )
    # On a terminal, as a person runs it: soakd's readable lines and nothing else (vLLM's warnings,
    # torch's FutureWarnings and the engine's shutdown go to the run's engine.log).
    code, out, err = finish_soakd(start_soakd(cfg, tmp_path, stderr_tty=True))
    assert code in (0, 1), err[-3000:]
    lines = [_ANSI.sub("", line).rstrip("\r") for line in err.splitlines() if line.strip()]
    foreign = [line for line in lines if not _CONSOLE_LINE.match(line)]
    assert lines and not foreign, foreign[:10]
    assert "Traceback" not in err and "WARNING" not in err
    summary = json.loads(out)
    run_dir = Path(summary["run_dir"])
    assert summary["replay"]["session_turns"] > 0

    requests = [s for s in iter_samples(run_dir / "spool") if s.measurement == "requests"]
    assert requests and all("error" not in s.fields for s in requests)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["trace"]["format"] == "sharegpt" and meta["trace"]["sessions"] == CONVERSATIONS

    sessions: dict[str, list[tuple[int, int, float, int, int]]] = defaultdict(list)
    for s in requests:
        f = s.fields
        sessions[str(f["session"])].append(
            (
                int(f["turn"]),
                int(f["due_ns"]),
                float(f["e2e_offered_s"]),  # due time to last token, on the replay's monotonic clock
                int(f["input_tokens"]),
                int(f["output_tokens"]),
            )
        )
    assert len(sessions) >= CONVERSATIONS - 2  # the last conversations may start too late to be seen
    reusable = 0
    for turns in sessions.values():
        turns.sort()
        assert [t[0] for t in turns] == list(range(len(turns)))
        for prev, nxt in itertools.pairwise(turns):
            # Closed loop: a turn is due only once the previous one finished (its last token, due time
            # + E2E as offered: one clock, so a step of the wall clock cannot fake or hide it) plus the
            # think time; and its prompt is longer, carrying the conversation so far.
            assert nxt[1] >= prev[1] + prev[2] * 1e9 - 1_000_000, (prev, nxt)
            assert nxt[3] > prev[3]
            # The next prompt repeats this turn's prompt and the engine's own answer to it.
            reusable += prev[3] + prev[4]
    assert summary["replay"]["session_turns"] == sum(len(t) - 1 for t in sessions.values()) > 0

    # The engine's prefix cache hit, and only later turns could have made it hit: no two conversations
    # share text, and the warm-up requests use their own salt.
    engine = [s for s in iter_samples(run_dir / "spool") if s.measurement == "engine"]
    hits = sum(int(s.fields.get("prefix_hits", 0)) for s in engine)
    assert hits > 0
    # Each later turn repeats the previous prompt and answer; rounding to whole KV blocks loses part
    # of one block per turn.
    print(f"prefix hits {hits} tokens of {reusable} repeated")
    assert hits >= 0.5 * reusable, (hits, reusable)
