"""The names of a run folder's files, in one place: every module that writes or reads one takes its
name from here (a run folder is what a reviewer signs, so its layout is part of the interface)."""

from __future__ import annotations

META_FILE = "meta.json"
"""What ran: config, engine, host, trace hash (written at the start)."""
SUMMARY_FILE = "summary.json"
"""The run's figures, written at its end (and after each resumed process)."""
VERDICT_FILE = "verdict.json"
"""PASS/FAIL with every criterion, written at the end and by `soakd report --rejudge`."""
CHECKPOINT_FILE = "checkpoint.json"
"""Where a resumed run continues from (replay offset, controller state, interruptions)."""
JOURNAL_FILE = "replay.journal"
"""One line per request as it comes due: what a crash lost in flight."""
SNAPSHOT_FILE = "snapshot.json"
"""The live state for `soakd status`-style readers, rewritten every few seconds."""
SPOOL_DIR = "spool"
"""The line-protocol segments: every measurement, the source of truth for reports."""
CONTROL_STATE_FILE = "control-state.json"
"""The controller's state (ceiling, trials, capture sizes), for a resume and for the report."""
LIMIT_FILE = "active-seqs"
"""The live admission limit the engine's scheduler reads."""
ENGINE_LOG_FILE = "engine-server.log"
"""The output of the `vllm serve` process soakd launched (engine.kind = "vllm-server")."""
ENGINE_OUTPUT_FILE = "engine.log"
"""What the in-process engine and its child processes wrote (vLLM's log, torch's warnings, tracebacks),
kept off soakd's console (engine.kind = "vllm-local")."""
REPORT_HTML = "report.html"
"""The sign-off report."""
REPORT_JSON = "report.json"
"""The sign-off report's figures and the digest of the files it was made from."""
DIGEST_FILES = (META_FILE, VERDICT_FILE)
"""The files whose digest the report carries: what a signature vouches for."""
LOCK_FILE = ".lock"
"""The run folder's owner: an exclusive flock held by the one process that runs or resumes it, with
that process's pid inside (soakd.owner)."""
RUN_FILES = (
    META_FILE,
    SUMMARY_FILE,
    VERDICT_FILE,
    CHECKPOINT_FILE,
    JOURNAL_FILE,
    CONTROL_STATE_FILE,
)
"""The files soakd itself reads back from a run folder: each one must be a regular file, never a link."""
