"""Figures of the control matrix (benchmarks/h200_matrix/run.sh): per arm and window of the replay
(before, under and after the outside load; a load-free arm takes the same spans), output tokens/s,
goodput under the arm's SLO, TPOT, admission wait, clock and power; control against advice-only per window
beside the run-to-run noise of two identical arms; the scheduler class's own cost (an A/A: load-free, no
action, with and without the class); when harm (clock and throughput) began and ended against the load;
and every action.

    python benchmarks/h200_matrix/figures.py tests/data/h200/matrix
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

WINDOWS = ("before", "under", "after")
KEYS = ("tokens_per_s", "goodput_tps", "tpot_p50_ms", "tpot_p99_ms", "queue_p99_s", "sm_mhz", "power_w")
ACTIONS = ("downscale", "upscale", "revert")


def _ab_figures() -> ModuleType:
    """The spool reader and per-window figures of the control A/B (one parser for both scripts)."""
    path = Path(__file__).parents[1] / "h200_control" / "figures.py"
    spec = importlib.util.spec_from_file_location("h200_control_figures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


FIG = _ab_figures()


def load(folder: Path) -> dict[str, Any]:
    """Every arm of a matrix folder: name -> {arm, scenario, policy, load, spans}."""
    arms: dict[str, Any] = {}
    for sub in sorted(
        p for p in folder.iterdir() if (p / "arm.json").is_file() and (p / "spool.lp.gz").is_file()
    ):
        info = json.loads((sub / "arm.json").read_text())
        arm = FIG.load_arm(sub)
        # A load-free arm is cut at the loaded arms' planned spans (20-65 s): windows compare like for like.
        lo, hi = arm.load if arm.load else (20.0, 65.0)
        arms[sub.name] = {**info, "arm": arm, "spans": ((0.0, lo), (lo, hi), (hi, arm.end))}
    return arms


def events(arm: Any, kinds: tuple[str, ...]) -> list[tuple[float, str, dict[str, Any]]]:
    return [(t, k, f) for t, k, f in arm.events if k in kinds]


def harm_timing(a: dict[str, Any]) -> dict[str, Any]:
    """Clock and throughput harm against the load: first enter after its start, last leave after its end,
    and whether an episode was still open at the replay's end."""
    arm = a["arm"]
    (_, lo), (_, hi), _ = a["spans"]
    out: dict[str, Any] = {}
    for label, kind in (("clock", ("power", "thermal")), ("throughput", ("throughput",))):
        seq = [
            (t, k, f)
            for t, k, f in arm.events
            if k in ("harm_enter", "harm_leave") and str(f.get("harm_kind", "power")) in kind
        ]
        enters = [t for t, k, _ in seq if k == "harm_enter"]
        leaves = [(t, f) for t, k, f in seq if k == "harm_leave"]
        out[f"{label}_episodes"] = len(enters)
        first = [t - lo for t in enters if t >= lo - 1]
        out[f"{label}_enter_after_load_s"] = round(first[0], 1) if first and a["load"] else None
        out[f"{label}_open_at_end"] = bool(seq) and seq[-1][1] == "harm_enter"
        after = [(t - hi, f) for t, f in leaves if t >= hi]
        out[f"{label}_leave_after_load_s"] = round(after[0][0], 1) if after and a["load"] else None
        out[f"{label}_ended_by"] = str(after[0][1].get("ended_by", "")) if after else ""
    return out


def fmt(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def change(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{100 * (a - b) / b:+.1f} %"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folder", type=Path, help="the matrix folder run.sh wrote (one sub-folder per arm)")
    args = ap.parse_args()
    arms = load(args.folder)
    digits = {"tpot_p50_ms": 2, "tpot_p99_ms": 2, "queue_p99_s": 1}
    print("| arm | window | " + " | ".join(KEYS) + " | verdict |")
    print("|---" * (len(KEYS) + 3) + "|")
    table: dict[tuple[str, str], dict[str, float | None]] = {}
    for name, a in arms.items():
        for wname, (lo, hi) in zip(WINDOWS, a["spans"], strict=True):
            w = a["arm"].window(lo, hi)
            table[(name, wname)] = w
            cells = " | ".join(fmt(w[k], digits.get(k, 0)) for k in KEYS)
            print(f"| {name} | {wname} ({lo:.0f}-{hi:.0f} s) | {cells} | {a['arm'].verdict} |")
    print()
    print("| comparison | metric | " + " | ".join(WINDOWS) + " |")
    print("|---|---|---|---|---|")
    pairs: list[tuple[str, str, str]] = []
    for s in ("shared", "pays", "owncap", "payslong", "longctx"):
        pairs += [
            (f"{s}-control vs {s}-advice", f"{s}-control", f"{s}-advice"),
            (f"{s}-control2 vs {s}-advice2", f"{s}-control2", f"{s}-advice2"),
            (f"noise: {s}-advice2 vs {s}-advice", f"{s}-advice2", f"{s}-advice"),
            (f"noise: {s}-control2 vs {s}-control", f"{s}-control2", f"{s}-control"),
        ]
    # The long-context calibration: a ceiling of 48 held against 64, both under the load all along.
    pairs.append(("fixed 48 (longctx-cal48) vs fixed 64 (longctx-cal64)", "longctx-cal48", "longctx-cal64"))
    pairs += [
        ("A/A: class (shared-free) vs no class (shared-noclass)", "shared-free", "shared-noclass"),
        ("noise: shared-noclass2 vs shared-noclass", "shared-noclass2", "shared-noclass"),
        ("A/A: class (shared-free2) vs no class (shared-noclass2)", "shared-free2", "shared-noclass2"),
    ]
    for label, x, y in pairs:
        if x not in arms or y not in arms:
            continue
        for k in ("tokens_per_s", "goodput_tps", "tpot_p50_ms"):
            row = " | ".join(change(table[(x, w)][k], table[(y, w)][k]) for w in WINDOWS)
            print(f"| {label} | {k} | {row} |")
    print()
    print(
        "| arm | actions (down/up/revert) | advice | clock harm: episodes, enter after load s, "
        "leave after load end s (by), open at end | throughput harm: episodes, enter after load s, "
        "leave after load end s, open at end |"
    )
    print("|---|---|---|---|---|")
    for name, a in arms.items():
        arm = a["arm"]
        acts = [k for _, k, f in arm.events if k in ACTIONS and not f.get("dry_run")]
        advice = sum(1 for _, k, f in arm.events if k in ACTIONS and f.get("dry_run"))
        h = harm_timing(a)
        counts = "/".join(str(acts.count(k)) for k in ACTIONS)
        clock = (
            f"{h['clock_episodes']}, {fmt(h['clock_enter_after_load_s'], 1)}, "
            f"{fmt(h['clock_leave_after_load_s'], 1)} ({h['clock_ended_by'] or '-'}), "
            f"{h['clock_open_at_end']}"
        )
        tput = (
            f"{h['throughput_episodes']}, {fmt(h['throughput_enter_after_load_s'], 1)}, "
            f"{fmt(h['throughput_leave_after_load_s'], 1)}, {h['throughput_open_at_end']}"
        )
        print(f"| {name} | {counts} | {advice} | {clock} | {tput} |")
    for name, a in arms.items():
        arm = a["arm"]
        print(
            f"\n{name} ({a['scenario']}, {a['policy']}): load "
            + ("none" if not arm.load else f"{arm.load[0]:.1f}-{arm.load[1]:.1f} s")
        )
        for t, kind, f in events(arm, ("harm_enter", "harm_leave", *ACTIONS, "action_result")):
            print(f"  {t:7.1f} s {kind}: {str(f.get('message', ''))[:170]}")


if __name__ == "__main__":
    main()
