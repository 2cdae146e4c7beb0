"""The report's first answers, above the criteria: what the run delivered and whether to trust it; and
numbers written for people (4,216,881 tok; 0.000095; 3.55 M), the same in every table and plot."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def human(value: Any, unit: str = "") -> str:
    """A number as a person reads it: thousands separated, about three significant digits, no exponent
    down to a millionth, M and G for the very large; None is "no data"."""
    if value is None:
        return "no data"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if not isinstance(value, int | float):
        return str(value)
    x = float(value)
    if math.isnan(x):
        return "no data"
    if math.isinf(x):
        return "∞" if x > 0 else "-∞"
    suffix = f" {unit}" if unit else ""
    a = abs(x)
    if a >= 1e9:
        return f"{x / 1e9:.3g} G{unit}" if unit else f"{x / 1e9:.3g} G"
    if a >= 1e7:
        return f"{x / 1e6:.3g} M{unit}" if unit else f"{x / 1e6:.3g} M"
    if a >= 1000 or (isinstance(value, int) and not isinstance(value, bool)):
        return f"{x:,.0f}{suffix}"
    if a == 0:
        return f"0{suffix}"
    if a < 1e-6:
        return f"≈0{suffix}"
    digits = max(0, 2 - math.floor(math.log10(a)))
    text = f"{x:.{digits}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text}{suffix}"


def pct(share: Any) -> str:
    """A share (0..1) as a percentage."""
    if not isinstance(share, int | float) or isinstance(share, bool) or math.isnan(float(share)):
        return "no data"
    return human(100.0 * float(share)) + " %"


# A replay that sent its requests this late (p99) against the trace did not offer the trace's load.
LATE_P99_MS = 100.0


def headline(verdict: Mapping[str, Any], summary: Mapping[str, Any]) -> list[dict[str, str]]:
    """The figures a reader needs first: label, value, and what it means (or a warning), in order."""
    m = verdict.get("metrics") or {}
    out: list[dict[str, str]] = []

    def add(label: str, value: str, note: str = "", warn: bool = False) -> None:
        out.append({"label": label, "value": value, "note": note, "warn": "1" if warn else ""})

    add("output tokens/s", human(m.get("tokens_per_s")), f"{human(m.get('output_tokens'))} tokens in all")
    control = summary.get("control") if isinstance(summary.get("control"), Mapping) else None
    good = _goodput(control)
    if good is not None:
        add("goodput", human(good), "tokens/s of requests within the TTFT and TPOT limits")
    else:
        add("goodput", "not measured", "measured by the control loop ([control] enabled)")
    _latency(verdict, m, add)
    if control is not None:
        sustained = control.get("sustained")
        start = control.get("start")
        if isinstance(sustained, int | float):
            add("sustained operating point", f"concurrency {sustained:g}", f"of {start} configured")
        else:
            last = control.get("ceiling")
            add(
                "sustained operating point",
                "not reached",
                f"no ceiling held without harm for [control.batch] sustain; ended at {last} of {start}",
            )
    _hardware(m, summary, add)
    late = m.get("p99(lateness_ms)")
    saturated = m.get("harness_saturated_s")
    behind = isinstance(late, int | float) and late > LATE_P99_MS
    if behind or (isinstance(saturated, int | float) and saturated > 0):
        # Framed red only when a criterion on it failed: a note on a PASS must not look like the FAIL.
        judged = _judged_by(verdict, ("lateness", "harness_saturated"))
        failed = [c for c in judged if not c.get("passed")]
        judgement = (
            f"; failed {', '.join(str(c.get('name')) for c in failed)}"
            if failed
            else f"; within {', '.join(str(c.get('name')) for c in judged)}"
            if judged
            else "; no criterion of this run judges it"
        )
        add(
            "replay lateness",
            f"p99 {human(late)} ms",
            "requests went out this late against the trace's schedule (held back by replay.max_pending, "
            f"or soakd's loop busy {human(saturated or 0.0)} s): the load was lighter than the trace's"
            + judgement,
            warn=bool(failed),
        )
    return out


def _hardware(m: Mapping[str, Any], summary: Mapping[str, Any], add: Any) -> None:
    """Time at a GPU clock limit (and what it cost the clock), or the host's throttling; the decode
    ceiling share."""
    throttle = m.get("throttle_time_pct")
    host = m.get("host_throttle_time_pct")
    if isinstance(throttle, int | float):
        # At a limit is not harm: what the clock lost says whether it cost anything (an H200 sits at its
        # power limit by design, its clock at its max).
        clock = m.get("min(sm_clock_ratio)")
        cost = (
            f"the SM clock never below {pct(clock)} of its max (1-minute means)"
            if isinstance(clock, int | float)
            else "no SM-clock series"
        )
        add(
            "GPU at a clock limit",
            f"{human(throttle)} % of the time",
            f"{cost}; {human(m.get('throttle_episodes'))} episodes",
        )
    elif isinstance(host, int | float):
        add("host CPUs throttled", f"{human(host)} % of the time", "no GPU series in this run")
    found = summary.get("decode_ceiling")
    ceiling: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
    # bw_pct: the decode steps' reads over what the bandwidth allowed while busy (pct_of_ceiling in runs
    # written before it).
    share = ceiling.get("bw_pct", ceiling.get("pct_of_ceiling"))
    if ceiling.get("available") and isinstance(share, int | float):
        add(
            "decode ceiling share",
            f"{human(share)} %",
            f"of the {human(ceiling.get('bandwidth_gbs'))} GB/s the decode steps could have read while busy "
            f"({human(ceiling.get('ceiling_tps'))} tok/s at that limit)",
        )


def _latency(verdict: Mapping[str, Any], m: Mapping[str, Any], add: Any) -> None:
    """TTFT as the trace's users saw it, the server's view beside it, and whether soakd's own admission
    ceiling put a wait between them."""
    offered, sent = m.get("p99(ttft_offered_ms)"), m.get("p99(ttft_ms)")
    if "p99(ttft_offered_ms)" not in m:
        if sent is not None:
            # A verdict judged before soakd measured from the due time: say what this figure is.
            add(
                "TTFT p99 from the send",
                _ms(sent),
                "the server's view: this verdict was judged before soakd measured TTFT as offered (from "
                "the due time); `soakd report --rejudge` judges it so",
                warn=True,
            )
        return
    add(
        "TTFT p99 as offered",
        _ms(offered),
        f"from each request's due time in the trace; from the send (the server's view) {_ms(sent)}",
    )
    share, wait = m.get("admission_wait_share"), m.get("p99(queue_ms)")
    if isinstance(share, int | float) and share > 0:
        add(
            "admission ceiling bound",
            f"{_share(share)} of requests waited",
            f"p99 wait {_ms(wait)} at soakd's replay.max_concurrency before the send: inside TTFT as "
            "offered, outside the server's view",
            # A warning when it cost the TTFT criterion; otherwise a fact beside a PASS.
            warn=_failed(verdict, "ttft_p99_ms"),
        )


def _ms(value: Any) -> str:
    return "no data" if not isinstance(value, int | float) else f"{human(value)} ms"


def _share(share: float) -> str:
    """A share as a percentage that does not round a few requests away to 0 %."""
    return pct(share) if share >= 0.01 else "under 1 %"


def _failed(verdict: Mapping[str, Any], name: str) -> bool:
    found = verdict.get("criteria")
    criteria = found if isinstance(found, list) else []
    return any(isinstance(c, Mapping) and c.get("name") == name and not c.get("passed") for c in criteria)


def _judged_by(verdict: Mapping[str, Any], words: tuple[str, ...]) -> list[Mapping[str, Any]]:
    """The verdict's criteria whose name or expression mentions any of `words`."""
    found = verdict.get("criteria")
    return [
        c
        for c in (found if isinstance(found, list) else [])
        if isinstance(c, Mapping) and any(w in f"{c.get('name')} {c.get('expr') or ''}" for w in words)
    ]


def _goodput(control: Mapping[str, Any] | None) -> float | None:
    """The run's goodput: each level's, weighted by the time the ceiling held it."""
    levels = control.get("levels") if control is not None else None
    if not isinstance(levels, Mapping):
        return None
    total = weighted = 0.0
    for level in levels.values():
        if isinstance(level, Mapping) and isinstance(level.get("goodput_tps"), int | float):
            seconds = float(level.get("seconds") or 0.0)
            total += seconds
            weighted += seconds * float(level["goodput_tps"])
    return weighted / total if total > 0 else None
