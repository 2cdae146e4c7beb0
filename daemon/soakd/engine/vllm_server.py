"""The server adapter: soakd launches `vllm serve` itself and drives it over the OpenAI streaming API.

This is how an acceptance soak usually runs: against the exact server command that will be deployed.
Per-step stats come from soakd's stat-logger plugin inside the server over a Unix stream socket
(engine/channel.py), allocator stats from the worker extension over the dev-mode `/collective_rpc`,
and the server's own `/metrics` is scraped as a cross-check. The server runs in its own process group,
its output goes to `engine-server.log` in the run folder, and stopping it stops the whole group.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import structlog

from soakd.config import MAX_VOCAB, EngineConfig
from soakd.engine.base import EngineInfo, GenerationRequest
from soakd.engine.channel import SOCKET_ENV, StepChannel
from soakd.engine.live_limit import reported_live
from soakd.engine.openai_http import OpenAIEngine
from soakd.engine.stats import StepStats
from soakd.engine.vllm_local import OPTIONAL_ARGS, SCHEDULER_CLS, config_id, engine_kwargs
from soakd.errors import EngineError
from soakd.files import open_private_append
from soakd.rundir import ENGINE_LOG_FILE

log = structlog.get_logger(__name__)

StepSink = Callable[[StepStats], None]
_HELLO_WAIT_S = 5.0
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}
# engine_kwargs keys that are not server flags (the model is positional or --model; the logger is ours).
_NOT_FLAGS = {"model", "disable_log_stats"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def server_argv(cfg: EngineConfig, model: str, port: int, known_args: set[str] | None = None) -> list[str]:
    """The server's command line for this config (pure: unit-tested without vLLM).

    `known_args`: the engine options the installed vLLM knows; soakd's optional telemetry options it
    does not know are left out rather than failing the server's start.
    """
    command = list(cfg.server.command) or [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    argv = [*command]
    # `vllm serve` takes the model as its first argument; the api_server module takes --model.
    if command[-1:] == ["serve"]:
        argv.append(model)
    else:
        argv += ["--model", model]
    argv += ["--host", cfg.server.host, "--port", str(port)]
    for key, value in engine_kwargs(cfg, model).items():
        if key in _NOT_FLAGS:
            continue
        if key in OPTIONAL_ARGS and known_args is not None and key not in known_args:
            continue
        flag = _flag(key)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict | list):
            argv += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            argv += [flag, str(value)]
    argv += list(cfg.server.extra_flags)
    return argv


def server_config_id(argv: list[str]) -> str:
    """The config id of a server command: its flags, without the port (a fresh one each start)."""
    flags: list[str] = []
    skip = False
    for arg in argv[1:]:
        if skip:
            skip = False
            continue
        if arg == "--port":
            skip = True
            continue
        flags.append(arg)
    return config_id({"argv": flags})


def _known_args() -> set[str] | None:
    """AsyncEngineArgs' option names in the installed vLLM (None: vLLM not importable here)."""
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
    except ImportError:
        return None
    return set(getattr(AsyncEngineArgs, "__dataclass_fields__", {}))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class VllmServerEngine:
    """A `vllm serve` process soakd owns, driven through an OpenAIEngine pointed at it."""

    def __init__(self, cfg: EngineConfig, model: str, step_sink: StepSink, log_dir: Path) -> None:
        self._cfg = cfg
        self._model = model
        self._sink = step_sink
        self._log_path = log_dir / ENGINE_LOG_FILE
        self._proc: subprocess.Popen[bytes] | None = None
        self._http: OpenAIEngine | None = None
        self._channel: StepChannel | None = None
        self._info: EngineInfo | None = None
        self.argv: list[str] = []
        self._t0_wall = 0.0
        self._dev_mode = cfg.worker_extension and cfg.server.host in _LOOPBACK
        if cfg.worker_extension and not self._dev_mode:
            log.warning(
                "allocator_telemetry_off",
                reason="the server listens beyond loopback; its dev-mode endpoints stay closed",
            )

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError("engine not started")
        return self._info

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        cfg = self._cfg
        t0 = time.monotonic()
        self._t0_wall = time.time()
        port = cfg.server.port or _free_port(cfg.server.host)
        known = await asyncio.to_thread(_known_args)
        self.argv = server_argv(cfg, self._model, port, known)
        self._channel = StepChannel(self._sink)
        await self._channel.open()
        env = dict(os.environ)
        env[SOCKET_ENV] = self._channel.path
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.cpu_kvcache_space_gib))
        env["PYTHONUNBUFFERED"] = "1"
        if self._dev_mode:
            # /collective_rpc (the allocator's channel) exists only in dev mode, which also opens
            # /sleep, /reset_prefix_cache and more: only for a server that listens on loopback.
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(cfg.server.env)
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        # The server's log may hold request details: 0600 like the run's other files.
        with os.fdopen(open_private_append(self._log_path), "ab") as out:
            out.write(f"# soakd: {' '.join(self.argv)}\n".encode())
            out.flush()
            try:
                # Popen forks: off the event loop, which is pacing requests of a running soak.
                # Popen returns once the child is forked (milliseconds), with no await in between: a
                # cancellation cannot leave a server running that soakd does not know about.
                proc = subprocess.Popen(  # noqa: ASYNC220
                    self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
                self._proc = proc
            except OSError as err:
                await self._channel.aclose()
                raise EngineError(f"cannot launch the server: {err}") from err
        log.info("engine_server_launched", pid=proc.pid, port=port, log=str(self._log_path))
        url = f"http://{cfg.server.host}:{port}"
        http_cfg = cfg.model_copy(update={"url": url, "kind": "openai"})
        self._http = OpenAIEngine(http_cfg)
        self._http.vocab_hint = self._vocab_hint
        try:
            await self._start_http(self._http)
            # The plugin's hello (the engine's facts) comes as the engine starts, well before /health.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._channel.hello.wait(), _HELLO_WAIT_S)
            self._info = self._describe(self._http.info, time.monotonic() - t0)
        except BaseException:
            # An error or a cancellation (the run stopping): the server's whole group goes with it.
            await self.stop()
            raise
        log.info("engine_started", start_s=round(self._info.start_s, 2), config_id=self._info.config_id)

    def _vocab_hint(self) -> int | None:
        """The model's vocabulary size from the plugin's hello (the engine's own model config), else
        from the model folder's config.json: without the plugin (soakd not installed where the server's
        vLLM finds entry points) probing would send ids past the embedding of a model whose tokenizer
        is larger, and vLLM 0.26 dies on a device-side assert (measured on an H200)."""
        value = self._channel.facts().get("vocab_size") if self._channel is not None else None
        if not isinstance(value, int):
            value = model_config_vocab(Path(self._model))
        return value if isinstance(value, int) and 0 < value <= MAX_VOCAB else None

    async def _start_http(self, http: OpenAIEngine) -> None:
        """Wait for health, unless the server process exits first (then say why, from its log)."""
        starting = asyncio.create_task(http.start())
        try:
            while not starting.done():
                await asyncio.wait({starting}, timeout=0.5)
                if not starting.done() and self._proc is not None and self._proc.poll() is not None:
                    raise EngineError(
                        f"the server exited with code {self._proc.returncode} while starting: "
                        f"{self._log_tail()}"
                    )
        except BaseException:
            # Cancelled (the run is stopping) or the process is gone: the start must not go on
            # using a session that stop() is about to close.
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            raise
        starting.result()

    def _log_tail(self) -> str:
        try:
            lines = self._log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return "(no log)"
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
        return (errors[-1] if errors else (lines[-1] if lines else "(empty log)"))[:300]

    def _describe(self, http: EngineInfo, start_s: float) -> EngineInfo:
        assert self._channel is not None
        facts = self._channel.facts()
        details = dict(http.details)
        details["server_log"] = str(self._log_path)
        details["load_format"] = _flag_value(self.argv, "--load-format") or "auto"
        signals = ["metrics"]
        cudagraphs = False
        spec_tokens = 0
        if facts.get("error"):
            log.warning("engine_facts_incomplete", error=str(facts["error"])[:200])
        if facts:
            signals += ["per_step", "spec_per_pos"]
            cg_mode = str(facts.get("cudagraph_mode", "NONE"))
            details["platform"] = "cpu" if facts.get("cpu", True) else "gpu"
            details["cudagraph_mode"] = cg_mode
            details["max_num_seqs"] = str(facts.get("max_num_seqs", ""))
            cudagraphs = not facts.get("cpu", True) and "NONE" not in cg_mode.upper()
            if cudagraphs and "--cudagraph-metrics" in self.argv:
                signals.append("cudagraphs")
            spec_tokens = int(str(facts.get("speculative_tokens", 0)))
        else:
            log.warning(
                "stat_logger_plugin_silent",
                hint="the server did not load soakd's stat-logger plugin (is soakd installed in the "
                "server's Python, and VLLM_PLUGINS unset or naming it?)",
            )
        if "--per-request-spec-decode-metrics" in self.argv:
            signals.append("spec_per_request")
        if "--worker-extension-cls" in self.argv and self._dev_mode:
            signals.append("allocator")
        return EngineInfo(
            kind="vllm-server",
            version=str(facts.get("version", http.version)),
            model=self._model,
            config_id=server_config_id(self.argv),
            vocab_size=http.vocab_size,
            reserved_ids=http.reserved_ids,
            max_model_len=http.max_model_len,
            speculative_tokens=spec_tokens,
            cudagraphs=cudagraphs,
            capture_sizes=_sizes(facts.get("cudagraph_capture_sizes")),
            # What the server's scheduler reported as it started, not what the flags asked for.
            live_active_seqs=_flag_value(self.argv, "--scheduler-cls") == SCHEDULER_CLS
            and reported_live(self._t0_wall),
            start_s=start_s,
            details=details,
            signals=tuple(signals),
            sends_at=http.sends_at,
        )

    def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        if self._http is None:
            raise EngineError("engine not started")
        return self._http.generate(request)

    def process_ids(self) -> list[int]:
        if self._proc is None:
            return []
        try:
            root = psutil.Process(self._proc.pid)
            return [root.pid] + [p.pid for p in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def alive(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            return False
        return self._http is not None and self._http.alive()

    async def memory_stats(self) -> list[Any]:
        if self._http is None or "allocator" not in self.info.signals:
            raise EngineError("no worker extension in this server")
        doc = await self._http.post_json("/collective_rpc", {"method": "soakd_memory_stats"})
        results = doc.get("results") if isinstance(doc, dict) else doc
        if not isinstance(results, list):
            raise EngineError("/collective_rpc: unexpected response")
        return results

    async def metrics_text(self) -> str:
        if self._http is None:
            raise EngineError("engine not started")
        return await self._http.metrics_text()

    async def prepare_replay(self, concurrency: int) -> None:
        if self._http is not None:
            await self._http.prepare_replay(concurrency)

    def telemetry_summary(self) -> dict[str, object]:
        http = self._http.telemetry_summary() if self._http is not None else {}
        return {"stat_logger": self._channel.summary() if self._channel is not None else None, **http}

    async def stop(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.stop()
        proc, self._proc = self._proc, None
        if proc is not None:
            # Even when the API server itself has exited, its engine core and workers may not have.
            await asyncio.to_thread(_stop_group, proc, self._cfg.server.stop_timeout)
        if self._channel is not None:
            await self._channel.aclose()


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the server's process group (the API server, engine core and workers), SIGKILL if it
    is still there after `timeout_s`."""
    pgid = proc.pid  # start_new_session: the server leads its own group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("engine_server_kill", pid=proc.pid, after_s=timeout_s)
    # Whatever of the group outlived the leader goes too (orphaned workers hold memory).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout_s)


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value after `flag` in a command line (the last one wins, as argparse does)."""
    value = None
    for i, arg in enumerate(argv[:-1]):
        if arg == flag:
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    if argv and argv[-1].startswith(flag + "="):
        value = argv[-1].split("=", 1)[1]
    return value


def _sizes(value: object) -> tuple[int, ...]:
    """Capture sizes from the plugin's hello (a list of ints), empty when absent or malformed."""
    if not isinstance(value, list):
        return ()
    return tuple(sorted(int(x) for x in value if isinstance(x, int)))


def model_config_vocab(model: Path) -> int | None:
    """vocab_size from a local model folder's config.json (a multimodal model's text_config's); None
    when the model is not a folder or does not say."""
    try:
        doc = json.loads((model / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    # vLLM sizes the embedding from the text config where a multimodal model has one.
    text = doc.get("text_config")
    value = text.get("vocab_size") if isinstance(text, dict) else None
    if value is None:
        value = doc.get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
