"""soakd.engine.compat against a stand-in vLLM source tree that has every internal soakd uses, then
misses each one in turn: that feature is degraded or off and names why, the others stay live, and a
lever the engine did not confirm is never reported live (table, meta.json field, event)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from soakd.config import load
from soakd.engine import compat
from soakd.engine.base import EngineInfo
from soakd.engine.compat import DEGRADED, FEATURES, LIVE, OFF
from soakd.errors import ConfigError

# A stand-in vLLM: the shapes soakd reads, in the files where vLLM 0.26-0.34 keep them.
STAND_IN: dict[str, str] = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.32.0'\n",
    "vllm/plugins/__init__.py": 'STAT_LOGGER_PLUGINS_GROUP = "vllm.stat_logger_plugins"\n',
    "vllm/engine/arg_utils.py": """
from dataclasses import dataclass

@dataclass
class EngineArgs:
    scheduler_cls: str | None = None
    worker_extension_cls: str = ""
    cudagraph_metrics: bool = False
    per_request_spec_decode_metrics: str = "none"

class AsyncEngineArgs(EngineArgs):
    pass
""",
    "vllm/v1/core/sched/scheduler.py": """
class Scheduler:
    def __init__(self, n):
        self.running = []
        self.max_num_running_reqs = n
        self.max_num_active_reqs = n

    def schedule(self, throttle_prefills=False):
        if len(self.running) >= self.max_num_active_reqs:
            return None
        assert len(self.running) <= self.max_num_running_reqs
""",
    "vllm/v1/core/sched/async_scheduler.py": "class AsyncScheduler(Scheduler):\n    pass\n",
    "vllm/v1/metrics/loggers.py": """
from vllm.plugins import STAT_LOGGER_PLUGINS_GROUP

class StatLoggerBase:
    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0): ...
""",
    "vllm/v1/engine/async_llm.py": """
class AsyncLLM:
    @classmethod
    def from_engine_args(cls, engine_args, start_engine_loop=True, stat_loggers=None): ...

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None): ...
""",
    "vllm/entrypoints/serve/dev/rpc/api_router.py": '@router.post("/collective_rpc")\nasync def rpc(): ...\n',
    "vllm/v1/metrics/stats.py": """
from dataclasses import dataclass

@dataclass
class BaseCacheStats:
    queries: int = 0
    hits: int = 0

class PrefixCacheStats(BaseCacheStats):
    preempted_requests: int = 0

@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    prefix_cache_stats: PrefixCacheStats = None
    spec_decoding_stats: object = None
    cudagraph_stats: object = None

@dataclass
class PromptTokenStats:
    total: int = 0
    local_cache_hit: int = 0

class IterationStats:
    def __init__(self):
        self.num_generation_tokens = 0
        self.prompt_token_stats = PromptTokenStats()
""",
    "vllm/v1/spec_decode/metrics.py": """
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list = None
    num_draft_tokens_per_pos: list = None
""",
    "vllm/compilation/cuda_graph.py": """
class CUDAGraphStat:
    num_unpadded_tokens: int
    num_padded_tokens: int
    num_paddings: int
    runtime_mode: str
""",
}


def write_tree(root: Path, edits: dict[str, tuple[str, str]] | None = None) -> Path:
    for rel, source in STAND_IN.items():
        text = source
        if edits and rel in edits:
            old, new = edits[rel]
            assert old in text, (rel, old)  # the edit must really remove something
            text = text.replace(old, new)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_whole_stand_in_is_live(tmp_path: Path) -> None:
    c = compat.detect(write_tree(tmp_path), plugin_installed=True)
    assert c.found and c.version == "0.32.0" and c.known
    assert {f.name: f.state for f in c.features} == dict.fromkeys(FEATURES, LIVE)
    assert c.lever_attr == "max_num_active_reqs"


def test_the_older_admission_attribute_is_found_where_it_gates_admission(tmp_path: Path) -> None:
    """0.26's shape: one attribute, max_num_running_reqs, which admission compares."""
    sched = "vllm/v1/core/sched/scheduler.py"
    edits = {
        sched: (
            "        self.max_num_active_reqs = n\n\n    def schedule(self, throttle_prefills=False):\n"
            "        if len(self.running) >= self.max_num_active_reqs:",
            "\n    def schedule(self, throttle_prefills=False):\n"
            "        if len(self.running) >= self.max_num_running_reqs:",
        )
    }
    c = compat.detect(write_tree(tmp_path, edits), plugin_installed=True)
    assert c.lever_attr == "max_num_running_reqs"


_SCHED = "vllm/v1/core/sched/scheduler.py"
_ARGS = "vllm/engine/arg_utils.py"
_STATS = "vllm/v1/metrics/stats.py"
_LLM = "vllm/v1/engine/async_llm.py"

# (what goes missing, file, text removed, replacement, feature, its state then, a word its detail names)
MISSING: list[tuple[str, str, str, str, str, str, str]] = [
    (
        "admission compares the attribute only in an assert",
        _SCHED,
        ">= self.max_num_active_reqs",
        ">= 1",
        "scheduler_lever",
        DEGRADED,
        "admission",
    ),
    (
        "the attribute renamed",
        _SCHED,
        "self.max_num_active_reqs = n",
        "self.max_admitted = n",
        "scheduler_lever",
        DEGRADED,
        "admission",
    ),
    ("no schedule()", _SCHED, "def schedule(", "def step(", "scheduler_lever", DEGRADED, "schedule"),
    (
        "no scheduler_cls option",
        _ARGS,
        "scheduler_cls: str | None = None",
        "",
        "scheduler_lever",
        DEGRADED,
        "scheduler_cls",
    ),
    (
        "no AsyncScheduler",
        "vllm/v1/core/sched/async_scheduler.py",
        "class AsyncScheduler",
        "class Other",
        "scheduler_lever",
        DEGRADED,
        "AsyncScheduler",
    ),
    (
        "no stat_loggers parameter",
        _LLM,
        "stat_loggers=None",
        "loggers=None",
        "stat_logger",
        OFF,
        "stat_loggers",
    ),
    (
        "no plugin group",
        "vllm/plugins/__init__.py",
        '"vllm.stat_logger_plugins"',
        '"vllm.other"',
        "stat_plugin",
        DEGRADED,
        "stat_logger_plugins",
    ),
    (
        "no worker_extension_cls option",
        _ARGS,
        'worker_extension_cls: str = ""',
        "",
        "worker_rpc",
        OFF,
        "worker_extension_cls",
    ),
    (
        "no collective_rpc",
        _LLM,
        "async def collective_rpc",
        "async def rpc",
        "worker_rpc",
        OFF,
        "collective_rpc",
    ),
    (
        "no dev-mode route",
        "vllm/entrypoints/serve/dev/rpc/api_router.py",
        '"/collective_rpc"',
        '"/rpc"',
        "worker_rpc",
        DEGRADED,
        "/collective_rpc",
    ),
    (
        "no cudagraph_metrics option",
        _ARGS,
        "cudagraph_metrics: bool = False",
        "",
        "cudagraph_stats",
        OFF,
        "cudagraph_metrics",
    ),
    (
        "no cudagraph_stats field",
        _STATS,
        "cudagraph_stats: object = None",
        "",
        "cudagraph_stats",
        OFF,
        "cudagraph_stats",
    ),
    (
        "CUDAGraphStat without paddings",
        "vllm/compilation/cuda_graph.py",
        "num_paddings: int",
        "",
        "cudagraph_stats",
        DEGRADED,
        "num_paddings",
    ),
    (
        "no spec_decoding_stats field",
        _STATS,
        "spec_decoding_stats: object = None",
        "",
        "spec_decode_stats",
        OFF,
        "spec_decoding_stats",
    ),
    (
        "no accepted-per-position counts",
        "vllm/v1/spec_decode/metrics.py",
        "num_accepted_tokens_per_pos: list = None",
        "",
        "spec_decode_stats",
        OFF,
        "num_accepted_tokens_per_pos",
    ),
    (
        "no draft-per-position counts",
        "vllm/v1/spec_decode/metrics.py",
        "num_draft_tokens_per_pos: list = None",
        "",
        "spec_decode_stats",
        DEGRADED,
        "lower bound",
    ),
    (
        "no per-request spec option",
        _ARGS,
        'per_request_spec_decode_metrics: str = "none"',
        "",
        "spec_decode_stats",
        DEGRADED,
        "per-request",
    ),
    (
        "no prefix_cache_stats field",
        _STATS,
        "prefix_cache_stats: PrefixCacheStats = None",
        "",
        "prefix_cache_stats",
        OFF,
        "prefix_cache_stats",
    ),
    ("no cache hits (inherited field)", _STATS, "    hits: int = 0\n", "", "prefix_cache_stats", OFF, "hits"),
    (
        "no prompt_token_stats",
        _STATS,
        "self.prompt_token_stats = PromptTokenStats()",
        "pass",
        "prefix_cache_stats",
        DEGRADED,
        "cached prompt tokens",
    ),
]
# A feature whose absence takes another with it.
_COUPLED = {"worker_rpc": {"allocator"}}


@pytest.mark.parametrize(
    ("rel", "old", "new", "feature", "state", "word"), [m[1:] for m in MISSING], ids=[m[0] for m in MISSING]
)
def test_each_internal_missing_in_turn(
    tmp_path: Path, rel: str, old: str, new: str, feature: str, state: str, word: str
) -> None:
    c = compat.detect(write_tree(tmp_path, {rel: (old, new)}), plugin_installed=True)
    f = c.get(feature)
    assert (f.state, word in f.detail) == (state, True), f
    if feature == "scheduler_lever":
        assert c.lever_attr is None and "admission gate" in f.detail  # what it falls back to, named
    coupled = _COUPLED.get(feature, set()) if state == OFF else set()
    others = {g.name: g.state for g in c.features if g.name != feature and g.name not in coupled}
    assert set(others.values()) == {LIVE}, others
    for name in coupled:
        assert c.get(name).state == OFF


def test_a_changed_record_signature_turns_off_both_stat_paths(tmp_path: Path) -> None:
    edits = {"vllm/v1/metrics/loggers.py": ("scheduler_stats, iteration_stats,", "stats,")}
    c = compat.detect(write_tree(tmp_path, edits), plugin_installed=True)
    assert c.get("stat_logger").state == OFF and c.get("stat_plugin").state == DEGRADED
    assert "record" in c.get("stat_logger").detail and "/metrics" in c.get("stat_plugin").detail


def test_soakd_plugin_not_installed_degrades_the_server_path(tmp_path: Path) -> None:
    c = compat.detect(write_tree(tmp_path), plugin_installed=False)
    assert c.get("stat_plugin").state == DEGRADED and "entry point" in c.get("stat_plugin").detail
    assert c.get("stat_logger").state == LIVE


def test_no_vllm_at_all(tmp_path: Path) -> None:
    c = compat.detect(tmp_path)
    assert not c.found and {f.state for f in c.features} == {OFF}


def _info(**kw: Any) -> EngineInfo:
    base: dict[str, Any] = {
        "kind": "vllm-local",
        "version": "0.32.0",
        "model": "m",
        "config_id": "c",
        "vocab_size": 100,
        "speculative_tokens": 3,
        "signals": ("per_step", "spec_per_pos", "spec_per_request", "allocator"),
        "details": {"platform": "cpu"},
    }
    return EngineInfo(**{**base, **kw})


def test_a_lever_the_engine_did_not_confirm_is_never_reported_live(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source says the lever is there, the engine's scheduler reported nothing: degraded to the
    admission gate in the table, meta.json's field and the event alike."""
    detected = compat.detect(write_tree(tmp_path), plugin_installed=True)
    monkeypatch.setattr(compat, "installed", lambda: detected)
    cfg = load(None, {"control.batch.lever": "scheduler"})
    info = _info(live_active_seqs=False)
    meta = compat.meta_field(cfg, info)["vllm_compat"]
    assert isinstance(meta, dict) and meta["features"]["scheduler_lever"]["state"] == DEGRADED
    assert "admission gate" in meta["features"]["scheduler_lever"]["detail"]
    events: list[tuple[str, str, dict[str, Any]]] = []
    compat.engine_event(cfg, info, lambda kind, text, **f: events.append((kind, text, f)))
    [(kind, text, fields)] = events
    assert kind == "vllm_compat" and fields["scheduler_lever"] == DEGRADED
    assert "scheduler_lever" not in text.split(";")[0]  # not among the live ones
    # Confirmed by the engine: live, with the attribute.
    live = compat.settle(detected, cfg, _info(live_active_seqs=True), "max_num_active_reqs")
    assert live.get("scheduler_lever").state == LIVE and live.lever_attr == "max_num_active_reqs"
    # Not asked: off, whatever the engine can do.
    off = compat.settle(
        detected, load(None, {"control.batch.lever": "admission"}), _info(live_active_seqs=True)
    )
    assert off.get("scheduler_lever").state == OFF


def test_settled_against_what_the_engine_delivers(tmp_path: Path) -> None:
    detected = compat.detect(write_tree(tmp_path), plugin_installed=True)
    cfg = load(None, {})
    c = compat.settle(detected, cfg, _info(speculative_tokens=0, signals=("per_step",)))
    assert c.get("spec_decode_stats").state == OFF  # no speculative decoding in this engine
    assert c.get("allocator").state == OFF and c.get("worker_rpc").state == OFF  # no allocator signal
    assert c.get("cudagraph_stats").state == OFF and "CPU" in c.get("cudagraph_stats").detail
    assert c.get("stat_plugin").state == OFF  # in process: not used
    cpu = compat.settle(detected, cfg, _info())
    assert cpu.get("allocator").state == DEGRADED and "RSS" in cpu.get("allocator").detail
    server = compat.settle(detected, cfg, _info(kind="vllm-server", signals=("metrics",)))
    assert server.get("stat_plugin").state == DEGRADED and server.get("stat_logger").state == OFF


def test_a_stub_engine_has_no_table() -> None:
    assert compat.meta_field(load(None, {}), _info(kind="stub")) == {}


def test_an_unknown_version_is_refused_unless_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    edits = {"vllm/_version.py": ("0.32.0", "0.40.1"), _LLM: ("stat_loggers=None", "loggers=None")}
    detected = compat.detect(write_tree(tmp_path, edits), plugin_installed=True)
    monkeypatch.setattr(compat, "installed", lambda: detected)
    assert not detected.known and "untested" in detected.tested_label()
    with pytest.raises(ConfigError) as err:
        compat.check_version(load(None, {}))
    assert err.value.key == compat.ALLOW_KEY and "stat_logger" in str(err.value)  # the degraded one named
    accepted = load(None, {compat.ALLOW_KEY: True})
    compat.check_version(accepted)
    [engine, features] = compat.check_lines(accepted)
    assert engine[1] is True and features[1] is True and "stat_logger off" in features[2]
    [refused, _] = compat.check_lines(load(None, {}))
    assert refused[1] is False and compat.ALLOW_KEY in refused[2]
    # Attach mode runs no local vLLM: nothing to refuse.
    compat.check_version(load(None, {"engine.kind": "openai", "engine.url": "http://127.0.0.1:1"}))


@pytest.mark.parametrize(
    ("version", "known"), [("0.26.0", True), ("0.34.0", True), ("0.25.1", False), ("1.0.0", False)]
)
def test_known_range(version: str, known: bool) -> None:
    assert compat.Compat(version, ()).known is known


def test_the_lever_degrades_to_the_admission_gate_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM without the lever: the lever chosen is soakd's admission gate, its note says why, and the
    engine does not load soakd's class; with it, the scheduler lever and the class."""
    from soakd import wiring
    from soakd.policies import lever

    cfg = load(None, {"control.batch.lever": "scheduler"})
    monkeypatch.setattr(compat, "lever_available", lambda: False)
    without = lever.choose_lever(cfg, tmp_path)
    assert without.kind == "admission" and without.limit_file is None
    assert "this vLLM has no admission limit the class can move" in without.note
    assert wiring.engine_config(cfg, without, 0.0).scheduler_cls == ""
    monkeypatch.setattr(compat, "lever_available", lambda: True)
    with_it = lever.choose_lever(cfg, tmp_path)
    assert with_it.kind == "scheduler" and with_it.note == ""
    assert wiring.engine_config(cfg, with_it, 0.0).scheduler_cls == "soakd.engine.sched.SoakdScheduler"


def test_the_installed_vllm_is_read_without_importing_it() -> None:
    """soakd's process reads vLLM's files: neither vLLM nor torch is imported for the table."""
    code = (
        "import sys; from soakd.engine import compat; c = compat.installed(); "
        "print(c.found, sorted(f.name for f in c.features) == sorted(compat.FEATURES), "
        "'torch' in sys.modules, 'vllm' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split()[1:] == ["True", "False", "False"], out
