"""Figures of the control A/B (benchmarks/h200_control/run.sh): per arm and per window of the replay
(before, under and after the load), output tokens/s, goodput under the run's SLO, TPOT, admission wait,
SM clock and the harm judge's clock loss; the control actions with their before/after objective; the
delay from the load's start to the harm event; and the run-to-run noise of the windows where the arms
ran alike (no load, no action).

    python benchmarks/h200_control/figures.py tests/data/h200/control_ab
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def parse_line(line: str) -> tuple[str, dict[str, str], dict[str, Any], int] | None:
    """One line of InfluxDB line protocol (soakd's spool writes no escaped commas in tags)."""
    line = line.rstrip("\n")
    if not line or line.startswith("#"):
        return None
    head, _, rest = line.partition(" ")
    body, _, ts = rest.rpartition(" ")
    name, *tag_parts = head.split(",")
    tags = dict(p.split("=", 1) for p in tag_parts)
    fields: dict[str, Any] = {}
    key, buf, quoted, i = "", "", False, 0
    while i < len(body):
        c = body[i]
        if c == "\\" and quoted and i + 1 < len(body):
            buf += body[i + 1]
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == "=" and not quoted and not key:
            key, buf = buf, ""
            i += 1
            continue
        elif c == "," and not quoted:
            fields[key] = _value(buf)
            key, buf = "", ""
            i += 1
            continue
        buf += c
        i += 1
    if key:
        fields[key] = _value(buf)
    return name, tags, fields, int(ts)


def _value(text: str) -> Any:
    if text.startswith('"'):
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    if text.endswith("i"):
        return int(text[:-1])
    return float(text)


def lines(path: Path) -> Iterator[tuple[str, dict[str, str], dict[str, Any], int]]:
    with gzip.open(path, "rt", errors="replace") as f:
        for raw in f:
            parsed = parse_line(raw)
            if parsed is not None:
                yield parsed


@dataclass
class Arm:
    name: str
    t0: float
    load: tuple[float, float] | None
    slo_tpot_ms: float
    slo_ttft_ms: float
    tokens: list[tuple[float, float]] = field(default_factory=list)
    requests: list[tuple[float, dict[str, Any], str]] = field(default_factory=list)
    gpu: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    harm: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    events: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    verdict: str = ""
    end: float = 0.0
    """The replay's last point (s)."""

    def window(self, lo: float, hi: float) -> dict[str, float | None]:
        span = hi - lo
        tok = sum(n for t, n in self.tokens if lo <= t < hi)
        reqs = [(f, st) for t, f, st in self.requests if lo <= t < hi]
        ok = [f for f, st in reqs if st == "ok"]
        good = sum(
            f.get("output_tokens", 0)
            for f in ok
            if f.get("tpot_s", 0.0) * 1000 <= self.slo_tpot_ms
            and (f.get("queue_s", 0.0) + f.get("ttft_s", 0.0)) * 1000 <= self.slo_ttft_ms
        )
        tpot = sorted(f["tpot_s"] * 1000 for f in ok if "tpot_s" in f)
        queue = sorted(f.get("queue_s", 0.0) for f in ok)
        clocks = [f["sm_mhz_mean"] for t, f in self.gpu if lo <= t < hi and "sm_mhz_mean" in f]
        caps = [
            f.get("reason_sw_power_cap_share", 0.0) for t, f in self.gpu if lo <= t < hi and "samples" in f
        ]
        power = [f["power_w_mean"] for t, f in self.gpu if lo <= t < hi and "power_w_mean" in f]
        loss = [f["clock_loss"] for t, f in self.harm if lo <= t < hi and "clock_loss" in f]
        return {
            "tokens_per_s": tok / span,
            "goodput_tps": good / span,
            "completed": float(len(ok)),
            "tpot_p50_ms": _q(tpot, 0.5),
            "tpot_p99_ms": _q(tpot, 0.99),
            "queue_p99_s": _q(queue, 0.99),
            "sm_mhz": statistics.fmean(clocks) if clocks else None,
            "power_w": statistics.fmean(power) if power else None,
            "power_cap_share": statistics.fmean(caps) if caps else None,
            "clock_loss_p50": _q(sorted(loss), 0.5),
            "clock_loss_max": max(loss) if loss else None,
        }


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, int(q * len(values)))]


def load_arm(folder: Path) -> Arm:
    meta_config = json.loads((folder / "meta.json").read_text())
    crit = (meta_config.get("config") or {}).get("criteria") or {}
    times = json.loads((folder / "times.json").read_text()) if (folder / "times.json").exists() else None
    spool = folder / "spool.lp.gz"
    # The replay's first point: the replay.journal that gpu_load.py watched was created at the run's
    # start in these recordings (before the engine), so its load began 38-41 s into the replay.
    replay = [ts for name, _t, _f, ts in lines(spool) if name == "replay"]
    t0 = min(replay) / 1e9
    load = (times["load_start"] - t0, times["load_end"] - t0) if times else None
    end = max(replay) / 1e9 - t0
    arm = Arm(
        folder.name, t0, load, float(crit.get("tpot_p99_ms") or 1e9), float(crit.get("ttft_p99_ms") or 1e12)
    )
    arm.end = end
    for name, tags, f, ts in lines(spool):
        t = ts / 1e9 - t0
        if name == "engine" and "generation_tokens" in f:
            arm.tokens.append((t, float(f["generation_tokens"])))
        elif name == "requests":
            arm.requests.append((t, f, tags.get("status", "")))
        elif name == "gpu":
            arm.gpu.append((t, f))
        elif name == "throttle" and tags.get("gpu") == "0":
            arm.harm.append((t, f))
        elif name == "events":
            arm.events.append((t, tags.get("kind", ""), f))
    verdict = folder / "verdict.json"
    if verdict.exists():
        arm.verdict = str(json.loads(verdict.read_text()).get("verdict"))
    return arm


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folder", type=Path, help="holds the arms' folders as run.sh or pays.sh wrote them")
    ap.add_argument("--tpot-ms", type=float, help="goodput's TPOT limit for every arm (default: each arm's)")
    args = ap.parse_args()
    # run.sh: free/, control/, dryrun/; pays.sh: dryrun1/, control/, dryrun2/ (no load-free arm).
    names = [n for n in ("free", "control", "dryrun", "dryrun1", "dryrun2") if (args.folder / n).is_dir()]
    arms = {name: load_arm(args.folder / name) for name in names}
    if args.tpot_ms is not None:
        for arm in arms.values():
            arm.slo_tpot_ms = args.tpot_ms
    ctl = arms["control"]
    dries = [arms[n] for n in ("dryrun", "dryrun1", "dryrun2") if n in arms]
    free = arms.get("free")
    assert ctl.load is not None and all(d.load is not None for d in dries)
    ttft = "off" if ctl.slo_ttft_ms >= 1e12 else f"<= {ctl.slo_ttft_ms / 1000:g} s"
    print(f"SLO for goodput: TPOT <= {ctl.slo_tpot_ms:g} ms, admission wait + TTFT {ttft}")
    keys = (
        "tokens_per_s", "goodput_tps", "completed", "tpot_p50_ms", "tpot_p99_ms", "queue_p99_s",
        "sm_mhz", "power_w", "power_cap_share", "clock_loss_p50", "clock_loss_max",
    )  # fmt: skip
    digits = {"tpot_p50_ms": 2, "tpot_p99_ms": 2, "queue_p99_s": 1, "power_cap_share": 3}
    digits |= {"clock_loss_p50": 3, "clock_loss_max": 3}
    print("| window | arm | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    windows = ("before the load", "under the load", "after the load")
    # Each arm's windows from its own load times (the loads began seconds apart in replay time).
    table: dict[tuple[str, str], dict[str, float | None]] = {}
    for arm in (ctl, *dries):
        assert arm.load is not None
        spans = dict(zip(windows, ((0.0, arm.load[0]), arm.load, (arm.load[1], arm.end)), strict=True))
        for wname, (lo, hi) in spans.items():
            w = arm.window(lo, hi)
            table[(wname, arm.name)] = w
            label = f"{wname} ({lo:.0f}-{hi:.0f} s)"
            print(f"| {label} | {arm.name} | " + " | ".join(fmt(w[k], digits.get(k, 0)) for k in keys) + " |")
    if free is not None:
        half = free.end / 2
        for lo, hi in ((0.0, half), (half, free.end)):
            w = free.window(lo, hi)
            print(
                f"| load-free ({lo:.0f}-{hi:.0f} s) | free | "
                + " | ".join(fmt(w[k], digits.get(k, 0)) for k in keys)
                + " |"
            )
    print()

    def change(a: float | None, b: float | None) -> str:
        return f"{fmt(100 * (a - b) / b if a is not None and b else None, 1)} %"

    for dry in dries:
        for k in ("tokens_per_s", "goodput_tps"):
            row = [f"{w}: {change(table[(w, ctl.name)][k], table[(w, dry.name)][k])}" for w in windows]
            print(f"control vs {dry.name}, {k}: " + "; ".join(row))
    if len(dries) == 2:
        # Run-to-run noise: the two advice-only arms ran the same replay and load.
        for k in ("tokens_per_s", "goodput_tps"):
            a, b = dries[1].name, dries[0].name
            row = [f"{w}: {change(table[(w, a)][k], table[(w, b)][k])}" for w in windows]
            print(f"{dries[1].name} vs {dries[0].name} (noise), {k}: " + "; ".join(row))
    if free is not None:
        f1, f2 = free.window(0, free.end / 2), free.window(free.end / 2, free.end)
        for k in ("tokens_per_s", "goodput_tps"):
            print(f"load-free run, {k}, second half vs first: {change(f2[k], f1[k])}")
    for name, arm in arms.items():
        print(f"\n{name}: verdict {arm.verdict}; load {arm.load and tuple(round(x, 1) for x in arm.load)}")
        harm = [t for t, k, _ in arm.events if k == "harm_enter"]
        if arm.load:
            after = [t - arm.load[0] for t in harm if t >= arm.load[0]]
            print(f"  harm_enter {fmt(after[0], 1) if after else '-'} s after the load began")
        # The judge's latency: from the first 1 s point whose median loss passed the power threshold.
        over = [t for t, f in arm.harm if f.get("clock_loss", 0.0) >= 0.10]
        if over and harm:
            print(
                f"  harm_enter {fmt(harm[0] - over[0], 1)} s after the first 1 s point "
                "with >= 10 % clock loss"
            )
        print(
            f"  replay {arm.end:.0f} s; {len(arm.harm)} throttle points, "
            f"harm in {sum(1 for _, f in arm.harm if f.get('harm'))}"
        )
        for t, kind, f in arm.events:
            if kind in (
                "harm_enter",
                "harm_leave",
                "downscale",
                "upscale",
                "revert",
                "action_result",
                "throttle_enter",
                "throttle_leave",
            ):
                print(f"  {t:7.1f} s {kind}: {str(f.get('message', ''))[:150]}")


if __name__ == "__main__":
    main()
