"""The in-process vLLM adapter: AsyncLLM driven with token-id prompts, plus soakd's stat logger.

Every import of vLLM lives in this module, so the rest of soakd runs (and is tested) without it and
the differences between vLLM releases stay in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import psutil
import structlog

from soakd import console
from soakd.config import EngineConfig
from soakd.engine.base import EngineInfo, GenerationRequest
from soakd.engine.live_limit import reported_live
from soakd.engine.stats import RecordCost, StepStats, copy_spec_steps, step_from_vllm
from soakd.errors import EngineError
from soakd.rundir import ENGINE_OUTPUT_FILE
from soakd.shapes import engine_overrides

log = structlog.get_logger(__name__)

StepSink = Callable[[StepStats], None]


def engine_kwargs(cfg: EngineConfig, model_path: str) -> dict[str, Any]:
    """AsyncEngineArgs keyword arguments for this config (pure: unit-tested without vLLM)."""
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "max_num_seqs": cfg.max_num_seqs,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "enforce_eager": cfg.enforce_eager,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "seed": cfg.seed,
        # soakd's own logger is the one consumer; vLLM's periodic log lines would only be noise.
        "disable_log_stats": True,
    }
    # Only when parallel: a one-GPU engine's kwargs (and so its config id) stay as they were.
    if cfg.tensor_parallel_size > 1:
        kwargs["tensor_parallel_size"] = cfg.tensor_parallel_size
    if cfg.data_parallel_size > 1:
        kwargs["data_parallel_size"] = cfg.data_parallel_size
    # A shape folder has no weights: vLLM fills the config's shapes with random ones.
    kwargs.update(engine_overrides(model_path))
    if cfg.load_format != "auto":
        kwargs["load_format"] = cfg.load_format
    if cfg.cudagraph_metrics:
        kwargs["cudagraph_metrics"] = True
    if cfg.worker_extension:
        kwargs["worker_extension_cls"] = WORKER_EXTENSION
    if cfg.scheduler_cls:
        kwargs["scheduler_cls"] = cfg.scheduler_cls
    spec = cfg.speculative
    if spec.enabled:
        spec_cfg: dict[str, Any] = {
            "method": spec.method,
            "num_speculative_tokens": spec.num_speculative_tokens,
        }
        if spec.method == "ngram":
            spec_cfg["prompt_lookup_min"] = spec.prompt_lookup_min
            spec_cfg["prompt_lookup_max"] = spec.prompt_lookup_max
        if spec.model:
            spec_cfg["model"] = spec.model
        kwargs["speculative_config"] = spec_cfg
        if cfg.per_request_spec_metrics:
            kwargs["per_request_spec_decode_metrics"] = "detailed"
    kwargs.update(cfg.extra_args)
    return kwargs


# Options soakd adds for its own telemetry; a release that lacks one runs without that signal.
OPTIONAL_ARGS = (
    "cudagraph_metrics",
    "per_request_spec_decode_metrics",
    "worker_extension_cls",
    "scheduler_cls",
)
WORKER_EXTENSION = "soakd.engine.worker_ext.SoakdWorkerExtension"
SCHEDULER_CLS = "soakd.engine.sched.SoakdScheduler"
"""soakd's scheduler class (engine/sched.py): the batch lever that moves vLLM's admission limit live."""


def config_id(kwargs: dict[str, Any]) -> str:
    """A short stable id of an engine configuration, for the `config` tag."""
    blob = json.dumps(kwargs, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def make_logger_factory(sink: StepSink, cost: RecordCost) -> Callable[[Any, int], Any]:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SoakdStatLogger(StatLoggerBase):
        """Hands each step's stats to soakd; record() runs on the engine's output loop, so it only
        converts and appends."""

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            t0 = time.perf_counter_ns()
            sink(step_from_vllm(scheduler_stats, iteration_stats, time.time_ns(), engine_idx))
            cost.add(time.perf_counter_ns() - t0)

        def log_engine_initialized(self) -> None:
            return None

    def factory(vllm_config: Any, engine_index: int = 0) -> Any:
        return SoakdStatLogger(vllm_config, engine_index)

    return factory


def _engine_dead_error() -> type[BaseException]:
    try:
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError:  # a release without it: nothing to translate
        return _NeverRaised
    return EngineDeadError


def _is_vllm(proc: psutil.Process) -> bool:
    """vLLM names its engine core and worker processes (VLLM::EngineCore, VLLM::Worker...); short-lived
    helpers (compile workers, resource trackers) are not the engine and may come and go."""
    try:
        return "vllm" in " ".join([proc.name(), *proc.cmdline()[:2]]).lower()
    except psutil.Error:
        return False


class _NeverRaised(Exception):
    pass


TERMINAL_SIGNALS = frozenset({signal.SIGINT, signal.SIGHUP})
"""What a terminal sends its whole foreground process group (Ctrl-C, a hang-up). soakd drains on them; the
engine's processes, which share soakd's group, must not see them: vLLM's engine core and workers treat
SIGINT as a shutdown (the core aborts the requests in flight, a worker raises SystemExit) and SIGHUP
kills them, under a soakd that is still draining: the stop reads as an engine death. vLLM stops its
children with SIGTERM and SIGKILL only (v1/utils.py shutdown, the executor's worker shutdown), so
blocking these two leaves its shutdown whole."""
_KILL_WAIT_S = 5.0
"""How long a start cut short waits for the constructing thread once the engine's processes are killed."""


async def _construct(build: Callable[[], Any], timeout_s: float, before: set[int]) -> Any:
    """`build()` (AsyncLLM's construction, which starts the engine core and its workers) in a thread of
    its own with the terminal's signals blocked. A signal mask is inherited across fork and execve, so
    every process vLLM starts from that thread (spawned or forked), and theirs, keep them blocked even
    where vLLM installs SIGINT handlers; soakd's main thread still gets them.

    Cut short (the run stopping: a cancellation; or the start timeout), the engine's processes started
    meanwhile are killed, which ends the construction (its handshake sees the engine core die); the
    thread is waited for a few seconds at most, and an engine that came up at that very moment is shut
    down. A daemon thread: one stuck in a C call cannot hold soakd's exit."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    box: list[Any] = []
    finished = threading.Event()
    # Set when the start is given up; under the lock, whichever side sees a built engine second shuts
    # it down: the thread (built after the give-up, e.g. still loading the tokenizer when the stop came,
    # no engine process to kill yet) or the coroutine (built before).
    lock = threading.Lock()
    abandoned = threading.Event()

    def run() -> None:
        # multiprocessing's resource tracker, launched on its first use, *unblocks* SIGINT in the thread
        # that launches it (resource_tracker.ensure_running): launched first, before the mask, later
        # uses find it running and leave the mask alone.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, TERMINAL_SIGNALS)
        try:
            value = build()
        except BaseException as err:  # noqa: BLE001  (handed to the awaiting coroutine)
            box.append((False, err))
        else:
            with lock:
                orphan = abandoned.is_set()
                if not orphan:
                    box.append((True, value))
            if orphan:  # nobody reads the box any more: the engine is this thread's to shut down
                with contextlib.suppress(Exception):
                    value.shutdown()
        finished.set()
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits it any more
            loop.call_soon_threadsafe(done.set)

    threading.Thread(target=run, name="vllm-start", daemon=True).start()
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    except BaseException:
        with lock:
            abandoned.set()
            built = box[0][1] if box and box[0][0] else None
        killed = _kill_started(before)
        log.warning("engine_start_cut_short", killed=killed)
        if built is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(built.shutdown)
        await asyncio.to_thread(finished.wait, _KILL_WAIT_S)
        raise
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _kill_started(before: set[int]) -> list[int]:
    """SIGKILL to the processes started since `before` (this process's descendants then) and to their
    descendants: a half-started engine has nothing to drain. multiprocessing's resource tracker, shared
    by the whole process, is left alone."""
    procs: list[psutil.Process] = []
    for child in psutil.Process().children():
        try:
            if child.pid in before or "resource_tracker" in " ".join(child.cmdline()):
                continue
            procs += [*child.children(recursive=True), child]
        except psutil.Error:
            continue  # already gone
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [p.pid for p in procs]


MULTIPROC_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


class VllmLocalEngine:
    """vLLM's AsyncLLM in this process (engine core and workers in child processes)."""

    def __init__(
        self, cfg: EngineConfig, model_path: str, step_sink: StepSink, log_dir: Path | None = None
    ) -> None:
        self._log_dir = log_dir
        """Where the engine's own output goes (rundir.ENGINE_OUTPUT_FILE), when soakd's console was
        detached (soakd.console); None: it shares soakd's stdout and stderr."""
        self._cfg = cfg
        self._model_path = model_path
        self._sink = step_sink
        self._kwargs = engine_kwargs(cfg, model_path)
        self._llm: Any = None
        self._info: EngineInfo | None = None
        self._sampling: Any = None
        self._pids: list[int] = []
        self.record_cost = RecordCost()
        self.detokenize = False
        """Whether vLLM detokenizes the output (soakd never reads text; benchmarks/bench_frontend.py
        measures what it would cost)."""

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError("engine not started")
        return self._info

    async def start(self) -> None:
        # Before vLLM is imported (it reads its environment once). vLLM forks its engine-core process
        # by default on a GPU; soakd's own threads (the NVML event listener waiting in
        # nvmlEventSetWait, the slow tier's NVML reads) may hold NVML's internal locks at that moment,
        # and the forked child then deadlocks in its first NVML call (seen on an H200: an engine start
        # stuck for minutes in nvmlShutdown). A spawned child inherits no locks.
        os.environ.setdefault(MULTIPROC_ENV, "spawn")
        self._route_output()
        import vllm
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        is_cpu = bool(current_platform.is_cpu())
        if is_cpu:
            # The CPU build sizes its KV cache from this variable, not gpu_memory_utilization.
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self._cfg.cpu_kvcache_space_gib))
        fields = getattr(AsyncEngineArgs, "__dataclass_fields__", {})
        kwargs = {k: v for k, v in self._kwargs.items() if k not in OPTIONAL_ARGS or k in fields}
        t0 = time.monotonic()
        t0_wall = time.time()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            args = AsyncEngineArgs(**kwargs)
            factory = make_logger_factory(self._sink, self.record_cost)
            self._llm = await _construct(
                lambda: AsyncLLM.from_engine_args(args, stat_loggers=[factory]),
                self._cfg.start_timeout,
                before,
            )
        except TimeoutError:
            raise EngineError(f"vLLM did not start within {self._cfg.start_timeout:.0f} s") from None
        except (RuntimeError, ValueError, TypeError, OSError) as err:
            raise EngineError(f"vLLM failed to start: {type(err).__name__}: {err}") from err
        start_s = time.monotonic() - t0
        vcfg = self._llm.vllm_config
        vocab, special = await self._vocabulary(int(vcfg.model_config.get_vocab_size()))
        spec = vcfg.speculative_config
        comp = vcfg.compilation_config
        cg_mode = str(getattr(comp, "cudagraph_mode", "NONE"))
        cudagraphs = (not is_cpu) and "NONE" not in cg_mode.upper()
        # This engine's core and workers: if one of them is gone, the engine is dead. Processes that
        # were there before (a previous engine still exiting after a rebuild) are not this engine's.
        self._pids = [
            p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before and _is_vllm(p)
        ]
        signals = ["per_step", "spec_per_pos"]
        if cudagraphs and "cudagraph_metrics" in kwargs:
            signals.append("cudagraphs")
        if "per_request_spec_decode_metrics" in kwargs:
            signals.append("spec_per_request")
        if "worker_extension_cls" in kwargs:
            signals.append("allocator")
        self._info = EngineInfo(
            kind="vllm-local",
            version=str(vllm.__version__),
            model=self._model_path,
            config_id=config_id(self._kwargs),
            vocab_size=vocab,
            reserved_ids=special,
            max_model_len=int(vcfg.model_config.max_model_len),
            speculative_tokens=int(spec.num_speculative_tokens) if spec is not None else 0,
            cudagraphs=cudagraphs,
            capture_sizes=tuple(sorted(int(x) for x in getattr(comp, "cudagraph_capture_sizes", None) or ())),
            # What the engine's scheduler reported as it started, not what was configured.
            live_active_seqs=str(getattr(vcfg.scheduler_config, "scheduler_cls", "") or "") == SCHEDULER_CLS
            and reported_live(t0_wall),
            start_s=start_s,
            signals=tuple(signals),
            details={
                "platform": "cpu" if is_cpu else str(current_platform.device_name),
                "cudagraph_mode": cg_mode,
                "max_num_seqs": str(vcfg.scheduler_config.max_num_seqs),
                "load_format": str(kwargs.get("load_format", "auto")),
            },
        )
        log.info("engine_started", start_s=round(start_s, 2), config_id=self._info.config_id)

    def _route_output(self) -> None:
        """The engine's output to the run's engine log, before vLLM is imported and its children start
        (they inherit descriptors 1 and 2). What vLLM logs while importing, before it configures its own
        handler (Triton's notice), goes there too instead of up to soakd's handler."""
        if self._log_dir is None or not console.route_engine_output(self._log_dir / ENGINE_OUTPUT_FILE):
            return
        vllm_log = logging.getLogger("vllm")
        if not vllm_log.handlers:
            vllm_log.addHandler(logging.StreamHandler(sys.__stderr__))
            vllm_log.propagate = False

    async def _vocabulary(self, model_vocab: int) -> tuple[int, tuple[int, ...]]:
        """The token ids prompts may use: the vocabulary size and the special ids to leave out."""
        assert self._llm is not None
        tokenizer = self._llm.get_tokenizer()
        if asyncio.iscoroutine(tokenizer):
            tokenizer = await tokenizer
        special = tuple(sorted(int(i) for i in getattr(tokenizer, "all_special_ids", []) or []))
        vocab = model_vocab
        # Models pad their embedding past the tokenizer's vocabulary (Qwen: 151936 vs 151665); ids in
        # the padding are not real tokens and some releases reject them.
        with contextlib.suppress(TypeError):
            vocab = min(vocab, len(tokenizer))
        return vocab, special

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise EngineError("engine not started")
        params = SamplingParams(
            max_tokens=request.max_tokens,
            # Output lengths follow the trace: no early stop on EOS.
            min_tokens=request.max_tokens,
            ignore_eos=True,
            temperature=self._cfg.temperature if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            seed=request.seed,
            output_kind=RequestOutputKind.DELTA,
            # soakd counts tokens and never reads text: incremental detokenization in vLLM's front end,
            # which runs in this process, would be pure cost, and this process's one core is what
            # bounds a fast GPU's streaming throughput here (benchmarks/RESULTS.md, H200 soak).
            detokenize=self.detokenize,
        )
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_ids))
        try:
            async for out in self._llm.generate(prompt, params, request_id=request.request_id):
                n = 0
                for c in out.outputs:
                    n += len(c.token_ids)
                    if request.output_ids is not None:
                        request.output_ids.extend(c.token_ids)
                    metrics = getattr(c, "spec_decode_metrics", None)
                    if metrics is not None and request.spec is not None:
                        copy_spec_steps(metrics, request.spec)
                if n:
                    yield n
        except _engine_dead_error() as err:
            # One request failing is a result; the engine core dying ends the soak.
            raise EngineError(f"vLLM engine core died: {err}") from err

    def process_ids(self) -> list[int]:
        me = psutil.Process()
        return [me.pid] + [p.pid for p in me.children(recursive=True)]

    def alive(self) -> bool:
        if self._llm is None:
            return False
        if bool(getattr(self._llm, "errored", False)):
            return False
        for pid in self._pids:
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                return False
        return True

    async def memory_stats(self) -> list[Any]:
        if self._llm is None or "allocator" not in self.info.signals:
            raise EngineError("no worker extension in this engine")
        result = await self._llm.collective_rpc("soakd_memory_stats")
        return list(result)

    async def metrics_text(self) -> str:
        raise EngineError("an in-process engine has no /metrics endpoint")

    async def prepare_replay(self, concurrency: int) -> None:
        return None  # requests go to the engine in this process: nothing to open

    def telemetry_summary(self) -> dict[str, object]:
        return {"stat_logger": self.record_cost.summary()}

    async def stop(self) -> None:
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        # AsyncLLM.shutdown stops the engine core first and cancels its output handler after: the
        # handler, still awaiting outputs on this loop, meets a dead engine and logs "output_handler
        # failed" with an EngineDeadError traceback at every clean stop. Cancelled first, it does not.
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            handler.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await handler
        await asyncio.to_thread(llm.shutdown)
        # Collected now, while the interpreter is whole: AsyncLLM.__del__ shuts down again, and at
        # interpreter exit that raised a TypeError from half torn-down modules.
        del llm
        gc.collect()
