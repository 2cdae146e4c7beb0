"""`soakd check`: validate what a run would use and ask each outside party whether it answers."""

from __future__ import annotations

import os
from dataclasses import dataclass

from soakd.collectors.gpu import probe_nvml
from soakd.config import Config
from soakd.engine import compat
from soakd.errors import ConfigError, EngineError, SinkError
from soakd.redact import redact_text, redact_url
from soakd.sinks.influx import make_writer
from soakd.traces.loader import open_trace
from soakd.wiring import check_engine_auth, resolve_model


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    ok: bool
    detail: str

    def __post_init__(self) -> None:
        # A detail may quote a URL from the config (InfluxDB, a server) or an error holding one.
        object.__setattr__(self, "detail", redact_text(self.detail))


# How long `check` waits for an attached server to answer /health: it checks, it does not wait for a start.
SERVER_CHECK_TIMEOUT_S = 10.0


async def _check_server(cfg: Config) -> CheckResult:
    """Attach mode: the server answers and serves a model (no local vLLM is needed or looked for)."""
    from soakd.engine.openai_http import OpenAIEngine

    try:
        check_engine_auth(cfg, os.environ)
    except ConfigError as err:
        return CheckResult("engine", False, err.reason)  # not tried: aiohttp refuses both at once
    # A check sends no replay: no sender process.
    engine = OpenAIEngine(
        cfg.engine.model_copy(update={"start_timeout": SERVER_CHECK_TIMEOUT_S, "sender": "loop"})
    )
    try:
        await engine.start()
    except EngineError as err:
        return CheckResult("engine", False, str(err))
    try:
        info = engine.info
        return CheckResult(
            "engine",
            True,
            f"{redact_url(cfg.engine.url)} serves {info.model} ({info.version or 'version unknown'}, "
            f"max_model_len {info.max_model_len})",
        )
    finally:
        await engine.stop()


async def run_checks(cfg: Config) -> list[CheckResult]:
    """Config validity was proven by loading it; these check the trace, the model, vLLM, GPU, InfluxDB.

    A bad trace raises TraceError (bad input, exit 2) like `soakd run` would.
    """
    out = [CheckResult("config", True, f"{cfg.source} is valid")]
    trace = open_trace(cfg.trace, cfg.resolve, cfg.run.seed, cfg.replay)
    s = trace.summary
    out.append(
        CheckResult(
            "trace",
            True,
            f"{s.path} ({s.format}): {s.requests} requests over {s.span_s:.1f} s, "
            f"block reuse {s.block_reuse_ratio:.0%}, {s.sessions} multi-turn sessions"
            + (f", {s.bad_rows} bad rows skipped" if s.bad_rows else ""),
        )
    )
    try:
        model = resolve_model(cfg)
        out.append(CheckResult("model", True, model or "the server's own (engine.served_model unset)"))
    except ConfigError as err:
        out.append(CheckResult("model", False, err.reason))
    if cfg.engine.kind == "openai":
        out.append(await _check_server(cfg))
    else:
        out += [CheckResult(*line) for line in compat.check_lines(cfg)]
    if "gpu" in cfg.telemetry.collectors:
        gpu = probe_nvml()
        detail = f"{gpu.count} GPU(s), driver {gpu.driver}" if gpu.count else f"no GPU: {gpu.reason}"
        # No GPU is not a failure: the soak runs on with host and engine telemetry.
        out.append(CheckResult("gpu", True, detail))
    icfg = cfg.sinks.influx
    if icfg.enabled:
        writer = make_writer(icfg, os.environ)
        try:
            version = await writer.ping()
            out.append(CheckResult("influx", True, f"{icfg.url} ({icfg.api}) answers: {version}"))
        except SinkError as err:
            out.append(CheckResult("influx", False, f"{icfg.url} ({icfg.api}): {err}"))
        finally:
            await writer.aclose()
    else:
        out.append(CheckResult("influx", True, "disabled: samples stay in the local spool"))
    return out
