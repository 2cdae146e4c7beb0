"""config.gpu.toml is an overnight preset for one GPU; the README and docs/ link only to files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from soakd import config

ROOT = Path(__file__).resolve().parents[3]
GPU_CONFIG = ROOT / "config.gpu.toml"

# [text](target) and [text](target "title"); images too. The target ends at whitespace or ")".
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


@pytest.fixture(scope="module")
def gpu() -> config.Config:
    return config.load(GPU_CONFIG)


def test_the_gpu_preset_loads_and_runs_a_whole_night(gpu: config.Config) -> None:
    assert gpu.base_dir == ROOT
    assert gpu.run.duration >= 8 * 3600
    assert gpu.run.report
    assert gpu.trace.path == "bundled:multiturn"
    assert gpu.replay.loop  # the 9-minute trace is repeated until the night ends


def test_the_gpu_preset_soaks_a_gpu_engine(gpu: config.Config) -> None:
    eng = gpu.engine
    assert eng.kind == "vllm-local"
    assert eng.model == "Qwen/Qwen3-8B"
    assert 0.85 <= eng.gpu_memory_utilization <= 0.95
    assert not eng.enforce_eager  # CUDA graphs, as deployed
    assert eng.max_model_len >= 2048 + 1536  # the bundled trace's longest prompt and answer
    # The admission ceiling the control loop moves never asks the engine for more than it was built for.
    assert 16 <= gpu.replay.max_concurrency <= eng.max_num_seqs <= 256
    assert eng.restart.enabled and eng.restart.max_restarts >= 1


def test_the_gpu_preset_watches_the_gpu_and_controls_the_batch(gpu: config.Config) -> None:
    assert "gpu" in gpu.telemetry.collectors
    assert {"host", "engine", "allocator"} <= set(gpu.telemetry.collectors)
    assert gpu.telemetry.gpu_fast_interval <= 0.1
    assert gpu.control.enabled and not gpu.control.dry_run
    assert gpu.control.batch.enabled
    assert gpu.control.batch.floor <= gpu.replay.max_concurrency


def test_the_gpu_preset_needs_no_database_or_receiver(gpu: config.Config) -> None:
    assert not gpu.sinks.influx.enabled  # shown in the file, off by default
    assert gpu.sinks.influx.url.startswith("http")
    assert not gpu.sinks.webhook.enabled


def test_the_gpu_preset_judges_an_overnight_run(gpu: config.Config) -> None:
    crit = gpu.criteria
    assert crit.max_error_rate is not False and crit.max_error_rate <= 0.01
    assert crit.ttft_p99_ms is not False and crit.tpot_p99_ms is not False
    assert crit.min_completed_ratio is not False and crit.min_completed_ratio >= 0.95
    assert crit.max_interruptions == 0
    assert "engine_restarts == 0" in crit.checks
    assert any(c.startswith("sustained_ratio(tokens_per_s") for c in crit.checks)
    # Harm (clock lost), not the power-cap share: an H200 at its limit by design must not fail the night.
    assert any(c.startswith("min(sm_clock_ratio") for c in crit.checks)
    assert not any(c.startswith("throttle_time_pct") for c in crit.checks)
    assert crit.abort_on  # a night that cannot pass ends early
    assert crit.abort_grace >= 120


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))  # code blocks hold no links
    return [m.group(1) for m in LINK.finditer(text)]


def _missing_targets(path: Path) -> list[str]:
    missing = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http(s):, mailto: ...
            continue
        file_part = target.split("#", 1)[0]
        if not file_part:  # an anchor in the same page
            continue
        if not (path.parent / file_part).exists():
            missing.append(target)
    return missing


DOCS = sorted((ROOT / "docs").glob("*.md"))


def test_the_docs_pages_exist() -> None:
    names = {p.name for p in DOCS}
    assert {
        "commands.md",
        "config.md",
        "criteria.md",
        "measurements.md",
        "traces.md",
        "control.md",
        "alerts.md",
        "operations.md",
        "report.md",
        "development.md",
    } <= names


@pytest.mark.parametrize("page", [ROOT / "README.md", *DOCS], ids=lambda p: p.name)
def test_every_relative_link_points_at_a_file(page: Path) -> None:
    if page.name == "README.md":
        assert len(_links(page)) >= 10  # the README links its docs pages
    assert not _missing_targets(page)


def test_the_readme_links_every_docs_page() -> None:
    linked = {t.split("#", 1)[0] for t in _links(ROOT / "README.md")}
    assert {f"docs/{p.name}" for p in DOCS} <= linked


def test_the_link_check_sees_a_broken_link(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](page.md) [anchor](#x) [web](https://example.com/a.md) [gone](missing.md#part)\n"
        "![img](missing.png)\n```\n[not a link](in/a/code/block.md)\n```\n",
        encoding="utf-8",
    )
    assert _links(page) == ["page.md", "#x", "https://example.com/a.md", "missing.md#part", "missing.png"]
    assert _missing_targets(page) == ["missing.md#part", "missing.png"]
