"""How many output tokens per second one soakd process can drive, and what each costs it.

Run by hand:  .venv/bin/python benchmarks/bench_capacity.py [--levels 2000 5000 10000] [--seconds 30]
                  [--server-procs N] [--senders N] [--readers auto] [--reps 1] [--keep DIR] [--json]

A stand-in OpenAI-compatible server (benchmarks/standin_server.py, `--server-procs` processes on one
port) streams every completion as vLLM does: deltas of 1-4 tokens, 20-100 ms apart per stream, usage in
each chunk, idle keep-alive connections closed after 5 s. For each target level (output tokens/s) a
Mooncake-format trace is written: Poisson arrivals at level / mean output length, prompts of 200-2,000
tokens, answers of 100-300 (mean 200), so 50,000 tok/s is 250 req/s and about 1,200 streams open at
once. `soakd run` replays it in attach mode (the whole daemon: pacer, sender process(es), spool,
collectors, scheduler, verdict; `engine.senders` = `--senders`). `--readers python native` runs every
level with each stream reader in turn (`engine.sender_reader`), each against a baseline of its own.

Figures per level:
- achieved: output tokens/s over the replay (soakd's own verdict, checked against the server's count);
- cost: soakd's CPU (every soakd process: the daemon and its sender children, from getrusage of the
  waited child) minus a baseline run's (the same daemon replaying 10 requests: imports, start-up and
  the stop, which no token pays for), per output token in microseconds; and by process (main vs
  sender(s), polled with psutil every 0.2 s: the split, not the total);
- lateness at the server: each POST's arrival (the stand-in stamps its first bytes) minus its trace
  time, minus the median of those (the clock offset), absolute: p50 / p99 / max ms; soakd's own
  lateness p99 / max beside it;
- peak RSS of soakd's process tree; the event loop's worst lag and late seconds (its loop watch).

The figures go to benchmarks/RESULTS.md ("Capacity: one soakd process against a stand-in server").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_arrival import find_key, run_soakd
from bench_fidelity import free_port, write_trace

Json = dict[str, Any]
HERE = Path(__file__).resolve().parent
MEAN_OUT = 200
VOCAB = 32000


class Server:
    """The stand-in, its own process group; stopped by pid (SIGTERM writes the arrival stamps)."""

    def __init__(self, procs: int, arrivals: Path) -> None:
        self.port = free_port()
        self.arrivals = arrivals
        arrivals.mkdir(parents=True, exist_ok=True)
        self.log = (arrivals / "server.log").open("wb")
        argv = [sys.executable, str(HERE / "standin_server.py"), "--port", str(self.port)]
        argv += ["--procs", str(procs), "--arrivals", str(arrivals)]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        import urllib.request

        deadline = time.monotonic() + 30
        while True:  # ready when it answers /health
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:  # noqa: S310 (http only)
                    if resp.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the stand-in server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()

    def stamps(self) -> list[Json]:
        rows: list[Json] = []
        for f in self.arrivals.glob("arrivals-*.jsonl"):
            rows += [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line]
        return rows


def role_of(cmdline: str) -> str:
    return "sender" if "soakd.engine.sender" in cmdline else "main"


def one_run(
    work: Path, server_procs: int, level: float, seconds: float, senders: int, seed: int, reader: str = "auto"
) -> Json:
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace.jsonl"
    # Unique prompts (every block synthesized: the pacer's worst case), answers of 100-300 tokens.
    rows = write_trace(
        trace, seconds, level / MEAN_OUT, seed, inputs=(200, 2000), outputs=(100, 300), shared=0
    )
    times = [float(r["timestamp"]) for r in rows]
    server = Server(server_procs, work / "server")
    try:
        extra = (f"senders = {senders}\n" if senders else "") + f'sender_reader = "{reader}"\n'
        usage = run_soakd(
            server.url,
            trace,
            work,
            seconds,
            vocab_size=VOCAB,
            engine_extra=extra,
            name="capacity",
            role_of=role_of,
        )["usage"]
    finally:
        server.stop()
    verdict = json.loads(next((work / "runs").glob("*/verdict.json")).read_text(encoding="utf-8"))
    summary_path = next((work / "runs").glob("*/summary.json"), None)
    loop: Json = {}
    sends: Json = {}
    if summary_path is not None:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        loop = find_key(summary, "loop") or {}
        sends = find_key(summary, "sends") or {}  # connections warmed and opened in the replay
        reader = str(find_key(summary, "sender_reader") or reader)
    m = verdict["metrics"]
    out: Json = {
        "level": level,
        "reader": reader,
        "requests": len(times),
        "completed": m.get("completed"),
        "errors": m.get("errors"),
        "output_tokens": m.get("output_tokens"),
        "tokens_per_s": m.get("tokens_per_s"),
        "own_late_p99_ms": m.get("p99(lateness_ms)"),
        "own_late_max_ms": m.get("max(lateness_ms)"),
        "cpu_s": round(usage["cpu_s"], 2),
        "cpu_by_role": usage["cpu_by_role"],
        "peak_rss_mb": round(usage["peak_rss_mb"], 1),
        "machine_busy_pct": round(usage["machine_busy_pct"], 1),
        "loop": loop,
        "sends": sends,
    }
    out.update(server_lateness(server.stamps(), times))
    return out


_RID = re.compile(r"-0-(\d+)$")


def server_lateness(stamps: list[Json], times: list[float]) -> Json:
    """Each trace request's arrival at the server against its trace time, the clock offset removed."""
    d = []
    for row in stamps:
        if row["method"] != "POST" or row["path"] != "/v1/completions":
            continue
        hit = _RID.search(row["rid"])
        if hit is None or int(hit.group(1)) >= len(times):
            continue
        d.append(row["t_ns"] / 1e6 - times[int(hit.group(1))])
    if not d:
        return {"server_arrivals": 0}
    a = np.abs(np.array(d) - np.median(d))
    return {
        "server_arrivals": len(d),
        "server_late_p50_ms": round(float(np.percentile(a, 50)), 3),
        "server_late_p99_ms": round(float(np.percentile(a, 99)), 3),
        "server_late_max_ms": round(float(a.max()), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--levels", type=float, nargs="+", default=[2000.0, 5000.0, 10000.0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--server-procs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    p.add_argument("--senders", type=int, default=0, help="engine.senders (0: soakd's default)")
    p.add_argument("--readers", nargs="+", default=["auto"], choices=["auto", "native", "python"])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--keep", default="")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="soakd-capacity-"))
    root.mkdir(parents=True, exist_ok=True)
    # Baseline: start-up, the stop and the collectors' idle cost, which no token pays for.
    bases = {
        reader: one_run(
            root / f"baseline-{reader}", args.server_procs, MEAN_OUT, args.seconds, args.senders, 1, reader
        )
        for reader in args.readers
    }
    rows = []
    for rep in range(args.reps):
        for level in args.levels:
            for reader in args.readers:
                base = bases[reader]
                work = root / f"l{level:g}-{reader}-r{rep}"
                row = one_run(work, args.server_procs, level, args.seconds, args.senders, 7 + rep, reader)
                marginal = row["cpu_s"] - base["cpu_s"]
                tokens = float(row["output_tokens"] or 0) - float(base["output_tokens"] or 0)
                row["cpu_us_per_token"] = round(1e6 * marginal / tokens, 2) if tokens > 0 else None
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    report = {
        "seconds": args.seconds,
        "server_procs": args.server_procs,
        "senders": args.senders,
        "cpus": os.cpu_count(),
        "baseline": bases,
        "rows": rows,
        # By the reader each run reported (what "auto" chose).
        "median_cpu_us_per_token": {
            f"{lv:g} {rd}": statistics.median(
                [
                    r["cpu_us_per_token"]
                    for r in rows
                    if (r["level"], r["reader"]) == (lv, rd) and r["cpu_us_per_token"]
                ]
                or [0]
            )
            for lv, rd in sorted({(r["level"], r["reader"]) for r in rows})
        },
    }
    print(json.dumps(report, indent=None if args.json else 2))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
