"""The sign-off report opened in a real browser (Debian's headless Chromium): it paints its plots, logs
nothing to the console and fetches nothing. A control page with a script error and a remote image shows
that the same harness sees both.

A missing chromium skips, unless SOAKD_REQUIRE_SERVERS=1 (CI), which fails instead.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image

from soakd.cli import main

H200 = Path(__file__).parents[1] / "data" / "h200"
CHROMIUM = os.environ.get("SOAKD_CHROMIUM", "/usr/lib/chromium/chromium")
WIDTH, HEIGHT = 1200, 6000


def _chromium() -> str:
    # The Debian binary itself, not the /usr/bin/chromium shell wrapper: its pid is the browser's.
    path = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    if path:
        return path
    reason = "chromium not found (apt-get install chromium)"
    if os.environ.get("SOAKD_REQUIRE_SERVERS") == "1":
        pytest.fail(f"SOAKD_REQUIRE_SERVERS=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@dataclass
class Shot:
    image: Image.Image
    console: list[str]
    fetched: list[str]


def _open(page: Path, work: Path, width: int = WIDTH, height: int = HEIGHT) -> Shot:
    """Load `page` headless; its screenshot, console messages and the network requests it made."""
    work.mkdir(parents=True, exist_ok=True)
    png, netlog = work / "shot.png", work / "net.json"
    argv = [
        _chromium(),
        "--headless",
        "--no-sandbox",  # as root (CI containers) Chromium refuses to start with its sandbox
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={work / 'profile'}",
        # Console messages go to stderr as INFO:CONSOLE lines, whatever their level.
        "--enable-logging=stderr",
        "--v=0",
        # No name resolves: a remote fetch fails fast instead of waiting on the network; the net log
        # still records that the page tried.
        "--host-resolver-rules=MAP * ~NOTFOUND",
        f"--log-net-log={netlog}",
        f"--window-size={width},{height}",
        f"--screenshot={png}",
        page.resolve().as_uri(),
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        # Its renderer, GPU and crash-handler processes are in the session it leads: whatever of it is
        # still there is stopped by its pid's group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, err[-2000:]
    log = json.loads(netlog.read_text())
    start_job = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    fetched = [
        e["params"]["url"]
        for e in log["events"]
        if e["type"] == start_job
        # The page's own requests (Chromium's background ones have no file:// isolation key).
        and "file://" in str(e["params"].get("network_isolation_key", ""))
        and not e["params"]["url"].startswith("file:")
    ]
    return Shot(Image.open(png).convert("RGB"), [ln for ln in err.splitlines() if ":CONSOLE" in ln], fetched)


@pytest.fixture(scope="module")
def control_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`soakd report` of the recorded H200 control run (a power-cap episode, a downscale, a re-capture
    with an engine rebuild, an upscale); its run directory."""
    spool = gzip.decompress((H200 / "control" / "spool.lp.gz").read_bytes())
    run = tmp_path_factory.mktemp("report") / "run"
    (run / "spool").mkdir(parents=True)
    (run / "spool" / "seg-00000001.lp").write_bytes(spool)
    meta = json.loads((H200 / "rebuild" / "meta.json").read_text())
    meta["run_id"] = spool.split(b"run_id=", 1)[1].split(b" ", 1)[0].decode()
    meta["config"]["run"]["duration"] = 100.0
    meta["config"]["telemetry"]["collectors"] = ["host", "engine", "allocator", "gpu"]
    meta["config"]["engine"]["speculative"]["enabled"] = False
    (run / "meta.json").write_text(json.dumps(meta))
    shutil.copy(H200 / "control" / "summary.json", run / "summary.json")
    assert (
        main(["report", str(run), "--exit-code"]) == 1
    )  # FAIL: ttft_p99_ms, requests waited through the rebuild
    return run


def test_the_page_has_every_section_and_says_why_a_plot_has_no_data(control_report: Path) -> None:
    run = control_report
    page = (run / "report.html").read_text()
    assert (run / "report.html").stat().st_mode & 0o777 == 0o600
    for section in ("summary", "criteria", "environment", "plots", "actions", "signoff"):
        assert f'id="{section}"' in page
    assert re.search(r'class="banner FAIL">\s*<div class="word">FAIL</div>', page)
    # The criteria table is verdict.json's: one row per criterion, the failed one marked.
    verdict = json.loads((run / "verdict.json").read_text())
    assert page.count('<tr class="failed">') == sum(not c["passed"] for c in verdict["criteria"]) == 1
    # The time plots with data and the actions timeline as inline SVG; those without, one line saying
    # why, each panel named there; none missing.
    figures = re.findall(r'<figure id="plot-(\w+)" class="plot">(.*?)</figure>', page, re.S)
    assert all("<svg" in body for _, body in figures)
    drawn = {name for name, _ in figures}
    assert drawn == {
        "sm_clock",
        "power",
        "temperature",
        "throughput",
        "ttft",
        "tpot",
        "fragmentation",
        "actions",
    }
    line = page.split('id="not-recorded"', 1)[1].split("</p>", 1)[0]
    assert set(re.findall(r'<span id="plot-(\w+)">', line)) == {
        "spec_acceptance",
        "spec_drift",
        "cudagraph",
        "bandwidth",
    }
    assert "speculative decoding was off (engine.speculative.enabled = false)" in line
    assert "the engine reported no CUDA-graph steps" in line
    for kind in ("downscale", "recapture", "engine_rebuild", "upscale", "throttle_enter"):
        assert f'<td class="mono">{kind}</td>' in page
    # Self-contained: no script, nothing to fetch.
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page)
    assert "<script" not in page and "@import" not in page
    digest = json.loads((run / "report.json").read_text())["digest"]["sha256"]
    assert f'<p class="mono" id="digest">{digest}</p>' in page


def _count(image: Image.Image, rgb: tuple[int, int, int], tolerance: int = 12) -> int:
    r0, g0, b0 = rgb
    colors = image.getcolors(maxcolors=1 << 20) or []
    return sum(
        n
        for n, (r, g, b) in colors
        if abs(r - r0) <= tolerance and abs(g - g0) <= tolerance and abs(b - b0) <= tolerance
    )


def test_the_report_paints_its_plots_in_chromium_with_no_console_message_and_no_fetch(
    control_report: Path, tmp_path: Path
) -> None:
    _chromium()
    shot = _open(control_report / "report.html", tmp_path / "browser")

    assert shot.console == [] and shot.fetched == []
    assert shot.image.size == (WIDTH, HEIGHT)
    colors = shot.image.getcolors(maxcolors=1 << 20) or []
    assert len(colors) > 200  # text, lines, bands and shading: far from a blank or single-colour page
    white = max(colors)[0]
    assert white < 0.95 * WIDTH * HEIGHT
    # Painted: the FAIL banner, matplotlib's first line colour (C0) in the plots, the throttle shading
    # (red at 15 % over white), the orange of the second series.
    assert _count(shot.image, (0xCF, 0x22, 0x2E)) > 20_000
    assert _count(shot.image, (0x1F, 0x77, 0xB4), 30) > 2_000
    assert _count(shot.image, (0xF9, 0xDF, 0xDF), 8) > 20_000
    assert _count(shot.image, (0xFF, 0x7F, 0x0E), 30) > 500


def test_the_harness_sees_a_console_error_and_a_remote_fetch(tmp_path: Path) -> None:
    _chromium()
    page = tmp_path / "control.html"
    page.write_text(
        '<html><body><img src="https://example.invalid/logo.png">'
        '<script>console.error("control error");</script></body></html>'
    )
    shot = _open(page, tmp_path / "browser", 320, 240)
    assert any('"control error"' in line for line in shot.console)
    assert shot.fetched == ["https://example.invalid/logo.png"]
