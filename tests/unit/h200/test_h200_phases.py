"""GPU telemetry recorded on an H200 with `soakd telemetry record` through a phased bf16 matmul load
(idle 10 s, load 20 s, idle 15 s, load 20 s, idle 15 s): the throttle detector against the phases, and
the NVML power-capping counter against nvidia-smi's own "Clocks Event Reasons Counters"."""

from __future__ import annotations

import json
import re
from pathlib import Path

from soakd.collectors.nvml import NvmlCollector, RecordedNvml
from soakd.policies.throttle import ThrottleDetector, ThrottleInput, ThrottleState, counters_from_fields

DATA = Path(__file__).parents[2] / "data" / "h200" / "phases"


def smi_power_capping_us(name: str) -> int:
    text = (DATA / name).read_text()
    match = re.search(r"SW Power Capping\s*:\s*(\d+) us", text)
    assert match, name
    return int(match.group(1))


def loads() -> list[tuple[float, float]]:
    """(start, end) of each load phase, in seconds from the recording's first sample."""
    import gzip

    with gzip.open(DATA / "nvml_phases.jsonl.gz", "rt") as fh:
        fh.readline()
        wall0 = json.loads(fh.readline())["wall_ns"] / 1e9
    marks = [json.loads(ln) for ln in (DATA / "phases.jsonl").read_text().splitlines()]
    starts = [m["start_wall"] - wall0 for m in marks if m["phase"] == "load" and "start_wall" in m]
    ends = [m["end_wall"] - wall0 for m in marks if m["phase"] == "load" and "end_wall" in m]
    return list(zip(starts, ends, strict=True))


def test_power_cap_time_matches_nvidia_smi_to_the_microsecond() -> None:
    t = [0.0]
    source = RecordedNvml(DATA / "nvml_phases.jsonl.gz", lambda: t[0])
    collector = NvmlCollector(source)
    total = 0.0
    while not source.finished:
        collector.sample_fast(t[0])
        if round(t[0] * 10) % 10 == 0:
            collector.sample_slow()
        if round(t[0] * 10) % 50 == 0:
            total += sum(
                float(s.fields.get("throttle_power_s", 0)) for s in collector.collect(int(t[0] * 1e9))
            )
        t[0] += 0.1
    total += sum(float(s.fields.get("throttle_power_s", 0)) for s in collector.collect(int(t[0] * 1e9)))
    smi = (smi_power_capping_us("smi_after.txt") - smi_power_capping_us("smi_before.txt")) / 1e6
    # nvidia-smi read before the recorder started and after it ended; nothing was capped outside it.
    assert abs(total - smi) <= 0.01 * smi
    assert abs(total - smi) < 1e-3


def test_the_detector_follows_the_load_phases() -> None:
    import gzip

    with gzip.open(DATA / "nvml_phases.jsonl.gz", "rt") as fh:
        header = json.loads(fh.readline())["header"]
        rows = [json.loads(ln) for ln in fh]
    det = ThrottleDetector(max_mhz=header["gpus"][0]["max_sm_mhz"])
    slow: dict[str, object] = {}
    transitions = []
    for row in rows:
        g = row["gpus"][0]
        if "fields" in g:
            slow = g
        fields = slow.get("fields") or {}
        assert isinstance(fields, dict)
        inp = ThrottleInput(
            row["t"],
            g["sm_mhz"],
            g["reasons"],
            counters_from_fields({k: v for k, v in fields.items() if v is not None}),
            slow.get("margin_c"),  # type: ignore[arg-type]
            active=not (g["reasons"] or 0) & 1,
        )
        transitions += det.update(inp)
    (load1, load2) = loads()
    kinds = [(tr.to_state, tr.t_s) for tr in transitions]
    states = [k for k, _ in kinds]
    assert states == [
        ThrottleState.THROTTLED,
        ThrottleState.RECOVERING,
        ThrottleState.THROTTLED,
        ThrottleState.RECOVERING,
    ]
    # Enters within 2 s of a load starting; recovers within the window (5 s) + a slow read after it ends.
    assert 0 <= kinds[0][1] - load1[0] < 2 and 0 <= kinds[2][1] - load2[0] < 2
    assert 0 < kinds[1][1] - load1[1] < 8 and 0 < kinds[3][1] - load2[1] < 8
    assert "sw_power_cap" in transitions[0].reasons
    smi = (smi_power_capping_us("smi_after.txt") - smi_power_capping_us("smi_before.txt")) / 1e6
    assert abs(det.per_reason_s["power"] - smi) <= 0.01 * smi
