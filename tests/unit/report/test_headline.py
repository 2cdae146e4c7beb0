"""The report's first answers and its numbers: a headline block over the recorded H200 runs, numbers
written for people, wall-clock axes, engine downtime marked, shares drawn from zero."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_report_html import control_run

from soakd.cli import main
from soakd.report.headline import headline, human

H200 = Path(__file__).resolve().parents[2] / "data" / "h200"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (4216881, "4,216,881"),
        (-9.499e-05, "-0.000095"),
        (0.34677, "0.347"),
        (12.79, "12.8"),
        (123.456, "123"),
        (1500.0, "1,500"),
        (3.2e7, "32 M"),
        (1e-9, "≈0"),
        (0.0, "0"),
        (None, "no data"),
        (float("nan"), "no data"),
        (True, "yes"),
    ],
)
def test_numbers_are_written_for_people(value: object, text: str) -> None:
    assert human(value) == text


def test_the_headline_of_the_ten_minute_h200_soak() -> None:
    verdict = json.loads((H200 / "soak10m" / "verdict.json").read_text())
    summary = json.loads((H200 / "soak10m" / "summary.json").read_text())
    rows = {h["label"]: h for h in headline(verdict, summary)}
    assert rows["output tokens/s"]["value"] == human(verdict["metrics"]["tokens_per_s"])
    limit = rows["GPU at a clock limit"]
    assert limit["value"].endswith("% of the time") and "SM clock never below" in limit["note"]
    share = summary["decode_ceiling"]["pct_of_ceiling"]
    assert rows["decode ceiling share"]["value"] == human(share) + " %"
    assert "sustained operating point" in rows
    # That run's GPU was offered more than it served: requests went out up to 1.7 s late (p99).
    late = rows["replay lateness"]
    assert late["value"] == "p99 1,709 ms" and "max_pending" in late["note"]
    # Framed by the judgement: no criterion of that run judges lateness (it failed on its graph hit
    # rate), so the card is a note, not red.
    assert not late["warn"] and late["note"].endswith("; no criterion of this run judges it")

    def judged(passed: bool) -> dict[str, str]:
        crit = {"name": "on_time", "expr": "p99(lateness_ms) <= 500", "passed": passed, "value": 1709.4}
        rows = {h["label"]: h for h in headline({**verdict, "criteria": [crit]}, summary)}
        return rows["replay lateness"]

    assert judged(False)["warn"] and judged(False)["note"].endswith("; failed on_time")
    assert not judged(True)["warn"] and judged(True)["note"].endswith("; within on_time")
    on_time = {**verdict, "metrics": {**verdict["metrics"], "p99(lateness_ms)": 4.0}}
    assert "replay lateness" not in {h["label"] for h in headline(on_time, summary)}


def test_the_page_answers_first_with_wall_clock_axes_and_honest_ranges(tmp_path: Path) -> None:
    run = control_run(tmp_path)
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    doc = json.loads((run / "report.json").read_text())
    labels = [h["label"] for h in doc["headline"]]
    assert labels[:2] == ["output tokens/s", "goodput"] and "sustained operating point" in labels
    assert page.index('class="headline"') < page.index('id="criteria"')
    # Wall-clock ticks (UTC) with the run's own time under each, on every time axis.
    assert "UTC (run time below" in page
    assert re.search(r">\d\d:\d\d(:\d\d)?</", page) or re.search(r"\d\d:\d\d(:\d\d)?\s*\+\d", page)
    # The rebuild's downtime is drawn on the plots (a hatched band), not only on the timeline.
    assert page.count("hatch") == 0 or "engine_rebuild" in json.dumps(doc["data"]["events"])
    assert not re.search(r"\d\.\d{3}e[-+]\d\d", page.split("<svg", 1)[0])  # no raw exponents in the text
