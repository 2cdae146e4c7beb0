"""Load config.toml into frozen, typed sections; every error names the file, line and key.

Each component owns one section. Validation happens once, at start, so a bad value fails before the
run begins, never in the loop. Relative paths are resolved against the config file's folder.

Over 500 lines because every section and its bounds are here, one class each: the one schema a user reads.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from soakd.errors import ConfigError
from soakd.files import read_input_text
from soakd.lang.criteria import validate
from soakd.units import MAX_DURATION_S, parse_duration

MAX_CONFIG_BYTES = 1 << 20
# Bounds of the values that size memory or loops (each justified where used): token counts a model can
# hold, request counts a night can carry.
MAX_TOKENS = 1 << 20
MAX_SEED = (1 << 63) - 1
MAX_SYNTHETIC_REQUESTS = 10_000_000
MAX_BLOCK_SIZE = 1 << 16
"""Tokens per prefix block: real caches use 16-512, Mooncake's traces 512. The prompt builder makes and
caches whole blocks, so this bounds its memory per block (trace headers are held to it too)."""
MAX_VOCAB = 1 << 22
"""The largest vocabularies in use are ~262k tokens; a prompt is built from a table of this size."""
MAX_MODEL_LEN = 16 * MAX_TOKENS
"""A context window: beyond the longest any model has (10M tokens)."""


Duration = Annotated[float, BeforeValidator(parse_duration)]


class _Section(BaseModel):
    # No inf or NaN anywhere: every float is later used to sleep, scale or allocate.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class RunConfig(_Section):
    """[run]: what this soak is called, how long it lasts, where its files go."""

    name: str = Field(default="soak", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    duration: Duration = Field(default=120.0, gt=0)
    output_dir: str = "runs"
    host: str = ""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    snapshot_interval: Duration = Field(default=300.0, ge=1, le=86400)
    # How often the replay time reached is checkpointed for a resume (the journal of requests that came
    # due is exact; this bounds the replay time a resume repeats in a quiet stretch of the trace).
    checkpoint_interval: Duration = Field(default=5.0, ge=0.1, le=3600)
    # `soakd run --resume` continues an unfinished run only if it was active this recently: a restart
    # after a crash resumes, last week's abandoned run does not.
    resume_within: Duration = Field(default=3600.0, gt=0)
    # Write the sign-off report (report.html, report.json) when the run ends, on its own or by Ctrl-C; a
    # run stopped by SIGTERM or SIGHUP skips it (a service stop must be quick): `soakd report RUN` later.
    report: bool = True


class ArrivalConfig(_Section):
    """[trace.arrivals]: arrival times for a synthetic trace and for formats that record none (ShareGPT)."""

    process: Literal["poisson", "gamma", "constant"] = "poisson"
    rate_rps: float = Field(default=2.0, gt=0, le=100_000)
    # The gamma shape is 1/burstiness**2: outside 0.01-100 the gaps are all-or-nothing.
    burstiness: float = Field(default=1.0, ge=0.01, le=100)
    diurnal_amplitude: float = Field(default=0.0, ge=0, lt=1)
    diurnal_period: Duration = Field(default=86400.0, ge=1)
    diurnal_peak: Duration = Field(default=0.0, ge=0)
    think_time: Duration = Field(default=5.0, ge=0)


class SyntheticTraceConfig(_Section):
    """[trace.synthetic]: a generated trace for users with no recorded traffic."""

    duration: Duration = Field(default=60.0, gt=0)
    input_tokens_mean: int = Field(default=256, ge=1, le=MAX_TOKENS)
    input_tokens_max: int = Field(default=768, ge=1, le=MAX_TOKENS)
    output_tokens_mean: int = Field(default=64, ge=1, le=MAX_TOKENS)
    output_tokens_max: int = Field(default=192, ge=1, le=MAX_TOKENS)
    prefix_share: float = Field(default=0.5, ge=0, le=1)
    prefix_blocks: int = Field(default=1, ge=0, le=4096)
    block_size: int = Field(default=512, ge=1, le=MAX_BLOCK_SIZE)
    session_share: float = Field(default=0.0, ge=0, le=1)
    turns_mean: float = Field(default=4.0, ge=1, le=1000)
    turns_max: int = Field(default=16, ge=1, le=1000)
    turn_input_tokens_mean: int = Field(default=64, ge=1, le=MAX_TOKENS)


TraceFormat = Literal["auto", "native", "mooncake", "bailian", "azure", "burstgpt", "sharegpt", "synthetic"]


BUNDLED_PREFIX = "bundled:"
# Traces shipped with soakd (package data), by the name `trace.path = "bundled:NAME"` uses.
BUNDLED_TRACES = {
    "demo": "data/demo_trace.jsonl",  # Mooncake format, 247 requests over 2 min, prefix sharing (the default)
    "multiturn": "data/multiturn_trace.jsonl.gz",  # native, 7,983 requests over 9 min, multi-turn chat
}


def _trace_path(value: str) -> str:
    if value.startswith(BUNDLED_PREFIX) and value[len(BUNDLED_PREFIX) :] not in BUNDLED_TRACES:
        names = ", ".join(BUNDLED_PREFIX + n for n in BUNDLED_TRACES)
        raise ValueError(f"no bundled trace {value!r} (there are {names})")
    return value


class TraceConfig(_Section):
    """[trace]: the recorded traffic to replay."""

    path: Annotated[str, AfterValidator(_trace_path)] = ""
    format: TraceFormat = "auto"
    skip_bad_rows: bool = False
    sort: bool = False
    block_size: int = Field(default=0, ge=0, le=MAX_BLOCK_SIZE)
    tokenizer: str = ""
    default_output_tokens: int = Field(default=128, ge=1, le=MAX_TOKENS)
    arrivals: ArrivalConfig = ArrivalConfig()
    synthetic: SyntheticTraceConfig = SyntheticTraceConfig()

    @model_validator(mode="after")
    def _bounded_synthetic(self) -> TraceConfig:
        # A synthetic trace is generated whole: its request count sizes memory before anything runs.
        expected = self.arrivals.rate_rps * self.synthetic.duration
        if expected > MAX_SYNTHETIC_REQUESTS:
            raise ValueError(
                f"arrivals.rate_rps x synthetic.duration is {expected:.3g} requests; at most "
                f"{MAX_SYNTHETIC_REQUESTS:,} (lower one of them)"
            )
        return self


class SpeculativeConfig(_Section):
    """[engine.speculative]: speculative decoding (ngram works on the CPU build; mtp/eagle need a GPU)."""

    enabled: bool = True
    method: str = "ngram"
    num_speculative_tokens: int = Field(default=3, ge=1, le=16)
    prompt_lookup_min: int = Field(default=2, ge=1, le=64)
    prompt_lookup_max: int = Field(default=4, ge=1, le=64)
    model: str = ""


class ServerConfig(_Section):
    """[engine.server]: the `vllm serve` process soakd launches (engine.kind = "vllm-server")."""

    command: list[str] = Field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    extra_flags: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    stop_timeout: Duration = Field(default=30.0, gt=0, le=3600)


class RestartConfig(_Section):
    """[engine.restart]: what happens when the engine dies mid-run."""

    enabled: bool = True
    max_restarts: int = Field(default=3, ge=0, le=1000)


class EngineChange(_Section):
    """[[engine.changes]]: rebuild the engine with a changed configuration at a time into the replay."""

    at: Duration = Field(gt=0)
    mode: Literal["drain", "abort"] = "drain"
    reason: str = "scheduled change"
    max_num_seqs: int | None = Field(default=None, ge=1, le=65536)
    cudagraph_capture_sizes: list[Annotated[int, Field(ge=1, le=65536)]] | None = None
    num_speculative_tokens: int | None = Field(default=None, ge=1, le=16)
    speculative_enabled: bool | None = None
    extra_args: dict[str, Any] = Field(default_factory=dict)


class EngineConfig(_Section):
    """[engine]: the vLLM engine under test."""

    kind: Literal["vllm-local", "vllm-server", "openai"] = "vllm-local"
    url: str = ""
    api_key_env: str = "SOAKD_OPENAI_API_KEY"
    """The environment variable holding an API key (a bearer token), used when set and non-empty. With
    credentials in `url` (user:password@, basic auth) as well, the run is refused (exit 2): one way only."""
    sender: Literal["process", "loop"] = "process"
    """Where an HTTP engine's completions are sent and read: a process of soakd's own (its event loop
    does nothing else, so no collector or sink delays a send) or soakd's main event loop."""
    senders: int = Field(default=1, ge=1, le=64)
    """Sender processes (with `sender = "process"`): requests are spread over them in turn, each with
    its own connections. One read 50,000 output tokens/s on an H200 host in under half a core
    (benchmarks/RESULTS.md, "Capacity"); a second bought nothing there."""
    sender_nice: int = Field(default=0, ge=-20, le=0)
    """The sender processes' nice value (with `sender = "process"`), for a host shared with a busy
    server. -10 measured no better than 0 beside a vLLM CPU server on two cores (benchmarks/RESULTS.md,
    "Capacity"), so 0 is the default. Needs CAP_SYS_NICE or an RLIMIT_NICE allowing it (systemd:
    LimitNICE=); refused, the senders run at soakd's own and `sender_nice_refused` says why."""
    sender_reader: Literal["auto", "native", "python"] = "auto"
    """What reads the token streams in the sender processes: the native reader (C, polled every 5 ms,
    each read stamped by the kernel: about half the sender's CPU per token, benchmarks/RESULTS.md, "A
    native reader"), or the Python path (a read per delta in the event loop). "auto": the native one
    where it is built and the server is not behind TLS; requests that want token ids are read in Python
    either way. "native" refuses a run where it did not build (exit 2, before the run)."""

    warm_connections: int = Field(default=32, ge=0, le=1024)
    """An HTTP engine's connections opened just before the replay (at most replay.max_concurrency) and
    kept open, idle, ahead of demand for the whole run (stale ones replaced before the server's
    keep-alive timeout closes them): a connection opened while a request is due delays it. More are
    kept when the traffic's bursts need them (engine/h1.py), and opened on demand beyond those."""
    served_model: str = ""
    vocab_size: int = Field(default=0, ge=0, le=MAX_VOCAB)
    model: str = "models/tiny"
    dtype: str = "bfloat16"
    load_format: Literal["auto", "dummy"] = "auto"
    """vLLM's weight loading: "dummy" fills the config's shapes with random weights (a shape folder,
    `soakd model shape`, always loads so)."""
    max_model_len: int = Field(default=2048, ge=16, le=MAX_MODEL_LEN)
    max_num_seqs: int = Field(default=16, ge=1, le=65536)
    gpu_memory_utilization: float = Field(default=0.3, gt=0, le=1)
    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    """GPUs per replica (vLLM's tensor parallelism): every step waits for the slowest of them, so harm on
    any one is the engine's harm."""
    data_parallel_size: int = Field(default=1, ge=1, le=64)
    """Replicas (vLLM's data parallelism), each on its own `tensor_parallel_size` GPUs. The engine takes
    the first tensor x data parallel GPUs CUDA_VISIBLE_DEVICES leaves (all when unset); soakd judges
    those and records every GPU."""
    cpu_kvcache_space_gib: int = Field(default=1, ge=1, le=65536)
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    temperature: float = Field(default=0.0, ge=0, le=100)
    cudagraph_metrics: bool = True
    scheduler_cls: str = ""
    per_request_spec_metrics: bool = True
    worker_extension: bool = True
    allow_untested_vllm: bool = False
    """Run on a vLLM outside the versions soakd knows (docs/vllm-versions.md): refused otherwise (exit 2).
    The run then names, at engine start, which of soakd's vLLM features are live, degraded or off."""
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    start_timeout: Duration = Field(default=900.0, gt=0, le=86400)
    drain_timeout: Duration = Field(default=60.0, ge=0)
    speculative: SpeculativeConfig = SpeculativeConfig()
    server: ServerConfig = ServerConfig()
    restart: RestartConfig = RestartConfig()
    changes: list[EngineChange] = Field(default_factory=list)
    extra_args: dict[str, Any] = Field(default_factory=dict)

    @property
    def pipeline_parallel_size(self) -> int:
        """vLLM's pipeline parallelism, given in extra_args (1 when not, or not a whole number >= 1)."""
        pp = self.extra_args.get("pipeline_parallel_size", 1)
        return pp if isinstance(pp, int) and not isinstance(pp, bool) and pp >= 1 else 1

    @property
    def gpus_needed(self) -> int:
        """GPUs the engine runs on: tensor x pipeline x data parallel (1: a one-GPU engine)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    @property
    def parallel_key(self) -> str:
        """The key that made the engine parallel, for an error about its GPUs."""
        if self.tensor_parallel_size > 1:
            return "engine.tensor_parallel_size"
        if self.data_parallel_size > 1:
            return "engine.data_parallel_size"
        return "engine.extra_args.pipeline_parallel_size"


class ReplayConfig(_Section):
    """[replay]: how the trace is paced and admitted."""

    # Up to 1,000x: the replay yields to the event loop on every request, so a run still ends on time.
    speed: float = Field(default=1.0, gt=0, le=1000)
    start: Duration = Field(default=0.0, ge=0)
    end: Duration = Field(default=0.0, ge=0)
    rate_scale: float = Field(default=1.0, gt=0, le=64)
    sessions: Literal["closed", "open"] = "closed"
    loop: bool = True
    warmup_requests: int = Field(default=8, ge=0, le=100_000)
    max_concurrency: int = Field(default=16, ge=1, le=100_000)
    max_pending: int = Field(default=4096, ge=1, le=10_000_000)
    drain_timeout: Duration = Field(default=60.0, ge=0)


CollectorName = Literal["host", "engine", "gpu", "allocator", "metrics"]
_ALL_COLLECTORS: tuple[CollectorName, ...] = ("host", "engine", "gpu", "allocator", "metrics")


class SpecDriftConfig(_Section):
    """[telemetry.spec_drift]: speculative acceptance against the run's first window."""

    baseline: Duration = Field(default=300.0, gt=0)
    window: Duration = Field(default=300.0, gt=0)
    threshold: float = Field(default=0.2, gt=0, lt=1)
    min_draft_tokens: int = Field(default=200, ge=1, le=10**12)


class TelemetryConfig(_Section):
    """[telemetry]: which collectors run and how often."""

    # Sampling periods: below these a collector is a busy loop; above, a night has no samples.
    interval: Duration = Field(default=1.0, ge=0.01, le=3600)
    slow_interval: Duration = Field(default=10.0, ge=0.01, le=3600)
    gpu_fast_interval: Duration = Field(default=0.1, ge=0.01, le=60)
    gpu_slow_interval: Duration = Field(default=2.0, ge=0.01, le=3600)
    gpu_energy_interval: Duration = Field(default=10.0, ge=0.01, le=3600)
    gpu_recording: str = ""
    gpu_recording_speed: float = Field(default=1.0, gt=0, le=1000)
    ceiling_bandwidth_gbs: float = Field(default=0.0, ge=0, le=1e6)
    collectors: list[CollectorName] = Field(default_factory=lambda: list(_ALL_COLLECTORS))
    spec_drift: SpecDriftConfig = SpecDriftConfig()


class SpoolConfig(_Section):
    """[sinks.spool]: the durable local spool every sample goes through first.

    At `max_bytes` (0: unbounded), or with less than `min_free_bytes` free on its filesystem, the spool
    keeps only essential measurements; on a full disk it writes nothing; both are counted and reported
    (soakd.sinks.spool.Spool)."""

    segment_bytes: int = Field(default=8 * 1024 * 1024, ge=4096, le=1 << 30)
    fsync_interval: Duration = Field(default=1.0, ge=0.01, le=3600)
    # The H200 runs in tests/data/h200 spooled 8.8-14.2 kB/s (26-44 lines/s, 10-19 req/s, one GPU):
    # 0.25-0.41 GB in 8 h. 4 GiB is ten times that: room for 8 GPUs (~2.1 kB/s each) at 100 req/s
    # (~420 B a request), about 1.9 GB in 8 h, twice over.
    max_bytes: int = Field(default=4 * 1024**3, ge=0, le=1 << 50)
    # Kept free for everything else on the disk; essential lines (requests: ~5 kB/s at 12 req/s) may
    # still use it, which at that rate lasts about 15 h.
    min_free_bytes: int = Field(default=256 * 1024**2, ge=0, le=1 << 50)


def _http_url(value: object) -> object:
    if isinstance(value, str) and value:
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 - raises ValueError on a port that is not a number or out of range
        except ValueError:
            raise ValueError("not a URL (expected http://HOST[:PORT][/PATH])") from None
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL with a host")
    return value


class InfluxConfig(_Section):
    """[sinks.influx]: where the forwarder ships the spool."""

    enabled: bool = False
    url: Annotated[str, BeforeValidator(_http_url)] = "http://127.0.0.1:8086"
    api: Literal["v1", "v2"] = "v1"
    database: str = "soakd"
    retention_policy: str = ""
    org: str = "-"
    bucket: str = ""
    username: str = ""
    password_env: str = "SOAKD_INFLUX_PASSWORD"
    token_env: str = "SOAKD_INFLUX_TOKEN"
    batch_lines: int = Field(default=5000, ge=1, le=1_000_000)
    timeout: Duration = Field(default=10.0, gt=0, le=3600)
    interval: Duration = Field(default=1.0, ge=0.05, le=3600)
    final_drain_timeout: Duration = Field(default=60.0, ge=0, le=86400)

    @model_validator(mode="after")
    def _url_when_enabled(self) -> InfluxConfig:
        if self.enabled and not self.url:
            raise ValueError("enabled without a url")
        return self


# Event kinds the webhook sink can alert on (soakd.sinks.webhook.RULES; "verdict" is the run's end).
WebhookKind = Literal[
    "throttle_enter",
    "spec_drift",
    "spool_degraded",
    "sink_outage",
    "webhook_outage",
    "sink_rejected",
    "engine_failed",
    "engine_error",
    "engine_restart",
    "engine_rebuild",
    "replay_error",
    "gpu_xid",
    "gpu_error",
    "cotenant_enter",
    "verdict",
]
# Every kind but two, which are opt-in: the alert sink's own outage (told to a receiver it cannot reach
# until the outage is over) and an InfluxDB batch refusal (a data problem for the morning, not a page).
_OPT_IN_WEBHOOK_KINDS = frozenset({"webhook_outage", "sink_rejected"})
_DEFAULT_WEBHOOK_KINDS: tuple[WebhookKind, ...] = tuple(
    k for k in get_args(WebhookKind) if k not in _OPT_IN_WEBHOOK_KINDS
)


class WebhookConfig(_Section):
    """[sinks.webhook]: critical events POSTed as alerts from the spool (soakd.sinks.webhook)."""

    enabled: bool = False
    url: Annotated[str, BeforeValidator(_http_url)] = ""
    format: Literal["alertmanager", "webhook"] = "alertmanager"
    kinds: list[WebhookKind] = Field(default_factory=lambda: list(_DEFAULT_WEBHOOK_KINDS))
    severity: dict[WebhookKind, Literal["critical", "warning", "info"]] = Field(default_factory=dict)
    external_url: Annotated[str, BeforeValidator(_http_url)] = ""
    receiver: str = "soakd"
    username: str = ""
    password_env: str = "SOAKD_WEBHOOK_PASSWORD"
    token_env: str = "SOAKD_WEBHOOK_TOKEN"
    # Absent: 1m for "alertmanager" (below its 5m resolve_timeout), 4h for "webhook" (Alertmanager's
    # own repeat_interval); 0: never.
    resend_interval: Duration | None = None
    max_alerts: int = Field(default=64, ge=1, le=100_000)
    # Lines read per step: the event loop waits ~20-30 ms for 5,000 on a busy 2-core host (RESULTS.md).
    batch_lines: int = Field(default=5000, ge=1, le=1_000_000)
    timeout: Duration = Field(default=5.0, gt=0, le=3600)
    interval: Duration = Field(default=2.0, ge=0.05, le=3600)
    final_drain_timeout: Duration = Field(default=20.0, ge=0, le=86400)


class SinksConfig(_Section):
    """[sinks]"""

    spool: SpoolConfig = SpoolConfig()
    influx: InfluxConfig = InfluxConfig()
    webhook: WebhookConfig = WebhookConfig()


class BatchControlConfig(_Section):
    """[control.batch]: the concurrency ceiling follows harm, each downscale verified on the objective
    (soakd.policies.downscale)."""

    enabled: bool = True
    objective: Literal["goodput", "tokens", "tokens_per_joule"] = "goodput"
    floor: int = Field(default=1, ge=1, le=1_000_000)
    step: float = Field(default=0.25, gt=0, lt=1)
    dwell: Duration = Field(default=10.0, ge=0, le=86400)
    settle: Duration = Field(default=10.0, ge=0, le=86400)
    eval: Duration = Field(default=20.0, gt=0, le=86400)
    min_gain: float = Field(default=0.03, ge=0, lt=10)
    min_binding: float = Field(default=0.5, ge=0, le=1)
    cooldown: Duration = Field(default=30.0, ge=0, le=86400)
    sustain: Duration = Field(default=600.0, ge=0, le=7 * 86400)
    retry: Duration = Field(default=3600.0, ge=0, le=7 * 86400)
    lever: Literal["admission", "scheduler", "rebuild"] = "scheduler"


class HarmControlConfig(_Section):
    """[control.harm]: when throttling costs enough to act on (soakd.policies.throttle.HarmJudge)."""

    power_loss: float = Field(default=0.10, gt=0, lt=1)
    thermal_loss: float = Field(default=0.03, gt=0, lt=1)
    window: Duration = Field(default=1.0, gt=0, le=600)
    enter: Duration = Field(default=1.0, ge=0, le=3600)
    leave: Duration = Field(default=10.0, ge=0, le=3600)
    stale: Duration = Field(default=60.0, gt=0, le=3600)
    throughput_loss: float = Field(default=0.2, gt=0, lt=1)
    prefill_weight: float = Field(default=0.5, ge=0, le=4)
    act_on_throughput: bool = False

    @model_validator(mode="after")
    def _ordered(self) -> HarmControlConfig:
        if self.thermal_loss > self.power_loss:
            raise ValueError("thermal_loss must be <= power_loss (thermal throttling weighs more)")
        return self


class RecaptureControlConfig(_Section):
    """[control.recapture]: CUDA-graph capture sizes for the traffic seen (soakd.policies.recapture)."""

    enabled: bool = True
    idle: Duration = Field(default=60.0, ge=0)
    min_hit_rate: float = Field(default=0.9, ge=0, le=1)
    min_gain: float = Field(default=0.05, ge=0, le=1)
    min_steps: int = Field(default=1000, ge=1, le=10**12)
    cooldown: Duration = Field(default=1800.0, ge=0)
    long_idle: Duration = Field(default=3600.0, ge=0)
    quantile: float = Field(default=0.99, gt=0, le=1)
    max_sizes: int = Field(default=12, ge=1, le=128)
    max_size: int = Field(default=0, ge=0, le=65536)
    align: int = Field(default=1, ge=1, le=4096)
    idle_below_running: int = Field(default=0, ge=0, le=100_000)
    without_graphs: bool = False


class MtpControlConfig(_Section):
    """[control.mtp]: advice (and optionally action) when speculative acceptance drifts."""

    enabled: bool = True
    hold: Duration = Field(default=300.0, ge=0)
    spec_off: bool = False
    retry: Duration = Field(default=1800.0, ge=0)
    workload_change: float = Field(default=0.25, gt=0, le=10)


class ControlConfig(_Section):
    """[control]: the control loop: policies over telemetry, one actuator, every action an event."""

    enabled: bool = True
    dry_run: bool = False
    interval: Duration = Field(default=1.0, ge=0.05, le=3600)
    scope: Literal["any", "gpu", "host"] = "any"
    batch: BatchControlConfig = BatchControlConfig()
    harm: HarmControlConfig = HarmControlConfig()
    recapture: RecaptureControlConfig = RecaptureControlConfig()
    mtp: MtpControlConfig = MtpControlConfig()


# A criterion set to false is not checked (TOML has no null, and a removed key takes its default).
Ratio = Annotated[float, Field(ge=0, le=1)] | Literal[False]
Millis = Annotated[float, Field(gt=0, le=MAX_DURATION_S * 1000)] | Literal[False]


def _check_expr(text: str) -> str:
    return validate(text)


class CriteriaConfig(_Section):
    """[criteria]: the acceptance thresholds of the verdict; `false` switches one off."""

    max_error_rate: Ratio = 0.01
    ttft_p99_ms: Millis = 5000.0
    tpot_p99_ms: Millis = 500.0
    min_completed_ratio: Ratio = 0.95
    # Daemon crashes resumed during the run. Each one restarted the engine, so the soak did not show
    # `run.duration` of continuous serving: by default an interrupted soak cannot pass.
    max_interruptions: Annotated[int, Field(ge=0, le=1_000_000)] | Literal[False] = 0
    # k6-threshold-style lines over the run's metrics, e.g. "p99(ttft_offered_ms) < 500" (lang.criteria).
    checks: list[Annotated[str, AfterValidator(_check_expr)]] = Field(default_factory=list)
    # Checks judged during the run too (k6's abortOnFail): once one fails, past `abort_grace` of replay,
    # the run stops early (drained, FAIL, exit 3) instead of spending the night on a soak that cannot pass.
    abort_on: list[Annotated[str, AfterValidator(_check_expr)]] = Field(default_factory=list)
    abort_grace: Duration = Field(default=120.0, ge=0)


class Config(_Section):
    """The whole configuration. `base_dir` anchors relative paths (the config file's folder)."""

    run: RunConfig = RunConfig()
    trace: TraceConfig = TraceConfig()
    engine: EngineConfig = EngineConfig()
    replay: ReplayConfig = ReplayConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    sinks: SinksConfig = SinksConfig()
    control: ControlConfig = ControlConfig()
    criteria: CriteriaConfig = CriteriaConfig()

    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)
    _source: str = PrivateAttr(default="<defaults>")
    _text: str = PrivateAttr(default="")
    _overridden: dict[tuple[str, ...], str | None] = PrivateAttr(default_factory=dict)

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @property
    def source(self) -> str:
        return self._source

    def where(self, dotted: str) -> tuple[str | None, int | None]:
        """(file, line) that set `dotted` (the environment variable or the command line when it came from
        there), for a value found wrong only when the run starts (against the GPUs it sees)."""
        return _blame(self._source, self._text, dotted.split("."), self._overridden)

    def resolve(self, path: str) -> Path:
        """An absolute path for a path given in the config (relative ones are relative to base_dir)."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else self._base_dir / p


def read_toml(path: Path) -> tuple[str, dict[str, Any]]:
    """A TOML file's text and data; unreadable, not UTF-8 or bad TOML is a ConfigError naming the line."""
    text = read_input_text(path, MAX_CONFIG_BYTES, "a soakd config", ConfigError)
    try:
        return text, tomllib.loads(text)
    except RecursionError:  # tomllib recurses per level: [[[[... or {a={b=... thousands deep
        raise ConfigError("TOML nested deeper than the parser goes: not a soakd config", file=path) from None
    except tomllib.TOMLDecodeError as err:
        line = _decode_error_line(str(err))
        reason = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(err))
        raise ConfigError(f"TOML syntax: {reason}", file=path, line=line) from None


ENV_PREFIX = "SOAKD_"


def parse_value(raw: str) -> Any:
    """A value given outside the file (`--set`, the environment), read as TOML so 8, 0.5, true, "x" and
    [1, 2] all work; a bare word is a string. Raises ValueError for nesting deeper than the parser goes."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except RecursionError:  # tomllib recurses per nesting level
        raise ValueError("value nested deeper than the parser goes") from None
    except tomllib.TOMLDecodeError:
        return raw


def env_overrides(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    """Overrides from the environment, pydantic-settings' style: `SOAKD_RUN__DURATION=8h` sets
    run.duration, `SOAKD_SINKS__INFLUX__URL=...` sets sinks.influx.url (double underscores between levels,
    single ones kept). Names without a double underscore (SOAKD_CONFIG, secrets) are not overrides.
    Returns dotted key -> (value, the variable's name)."""
    out: dict[str, tuple[Any, str]] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        keys = name[len(ENV_PREFIX) :].lower().split("__")
        origin = f"environment {name}"
        if not all(keys):
            raise ConfigError("expected SOAKD_SECTION__KEY (an empty level)", file=origin)
        try:
            out[".".join(keys)] = (parse_value(env[name]), origin)
        except ValueError as err:
            raise ConfigError(str(err), file=origin, key=".".join(keys)) from None
    return out


# vLLM's parallelism options: first-class engine keys (they decide which GPUs soakd judges), never given
# another way (extra_args, a change's extra_args, a server's flags). Pipeline parallelism stays in
# extra_args: the engine's GPUs count it (collectors/engine_gpus).
PARALLEL_KEYS = ("tensor_parallel_size", "data_parallel_size")
_PARALLEL_FLAGS = {
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--data-parallel-size": "data_parallel_size",
    "-dp": "data_parallel_size",
}


def _parallel_elsewhere(e: EngineConfig) -> tuple[list[str], str, str] | None:
    """Where a parallelism option is set other than by its engine key: (its location in the TOML, the key
    to name, the engine key to set instead); None when nowhere."""
    for name in PARALLEL_KEYS:
        if name in e.extra_args:
            return ["engine", "extra_args"], f"engine.extra_args.{name}", name
        for n, change in enumerate(e.changes):
            if name in change.extra_args:
                return ["engine", "changes", str(n), "extra_args"], f"engine.changes.extra_args.{name}", name
    for flag in e.server.extra_flags:
        option = _PARALLEL_FLAGS.get(flag.split("=", 1)[0])
        if option is not None:
            return ["engine", "server", "extra_flags"], "engine.server.extra_flags", option
    return None


def load(
    path: str | Path | None,
    overrides: dict[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> Config:
    """Read and validate a config file (None: the built-in defaults), then apply dotted overrides: those
    of `env` (SOAKD_SECTION__KEY variables), then `overrides` (the command line's, which win).

    `overrides` maps dotted keys ("run.duration") to values.
    """
    data: dict[str, Any] = {}
    text = ""
    source = "<defaults>"
    base_dir = Path.cwd()
    if path is not None:
        p = Path(path)
        source = str(p)
        text, data = read_toml(p)
        base_dir = p.resolve().parent
    overridden: dict[tuple[str, ...], str | None] = {}
    given = {**env_overrides(env or {}), **{k: (v, None) for k, v in (overrides or {}).items()}}
    for dotted, (value, origin) in given.items():
        keys = dotted.split(".")
        clash = _set_dotted(data, keys, value)
        if clash is not None:
            file, line = _blame(source, text, clash, overridden)
            key = ".".join(clash)
            raise ConfigError(f"expected a table (to set {dotted})", file=origin or file, line=line, key=key)
        overridden[tuple(keys)] = origin
    try:
        cfg = Config.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = _key_path(data, first["loc"])
        key = ".".join(loc) if loc else "(top level)"
        file, line = _blame(source, text, loc, overridden)
        line = _item_line(text, line, first.get("input")) if file is not None else line
        raise ConfigError(_reason(first, Config), file=file, line=line, key=key) from None
    if cfg.replay.end and cfg.replay.end <= cfg.replay.start:
        file, line = _blame(source, text, ["replay", "end"], overridden)
        raise ConfigError(
            f"must be after replay.start ({cfg.replay.start:g} s), or 0 for the end of the trace",
            file=file,
            line=line,
            key="replay.end",
        )
    if cfg.sinks.webhook.enabled and not cfg.sinks.webhook.url:
        file, line = _blame(source, text, ["sinks", "webhook", "url"], overridden)
        raise ConfigError("needed when sinks.webhook.enabled", file=file, line=line, key="sinks.webhook.url")
    where = _parallel_elsewhere(cfg.engine)
    if where is not None:
        loc, key, name = where
        file, line = _blame(source, text, loc, overridden)
        raise ConfigError(
            f"set engine.{name} instead: soakd picks and judges the engine's GPUs by it",
            file=file,
            line=line,
            key=key,
        )
    cfg._base_dir = base_dir
    cfg._source = source
    cfg._text = text
    cfg._overridden = overridden
    return cfg


def _blame(
    source: str, text: str, loc: Sequence[str], overridden: Mapping[tuple[str, ...], str | None]
) -> tuple[str | None, int | None]:
    """(file, line) to name for a bad value at `loc`: for a value from outside the file, its origin (the
    environment variable; nothing for the command line), not the file's own line for that key."""
    key = tuple(loc)
    for k, origin in overridden.items():
        if key and (key[: len(k)] == k or k[: len(key)] == key):
            return origin, None
    return source, _find_line(text, loc) if text else None


def _item_line(text: str, line: int | None, value: object) -> int | None:
    """A string item of a multi-line array: the line that holds it, rather than the array's key line."""
    if line is None or not isinstance(value, str) or not value:
        return line
    lines = text.splitlines()
    for number in range(line, min(len(lines), line + 200) + 1):
        if value in lines[number - 1]:
            return number
    return line


def _reason(error: Any, model: type[BaseModel] | None = None) -> str:
    """An error's one-line reason; an unknown key of `model` (the root its location starts at) with the
    closest known key at that place, for a typo."""
    kind = error["type"]
    if kind == "extra_forbidden":
        loc = [str(x) for x in error["loc"] if not isinstance(x, int)]
        known = _known_keys(model, loc[:-1]) if model is not None and loc else []
        close = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6) if loc else []
        return f"unknown key (did you mean {close[0]!r}?)" if close else "unknown key"
    msg = str(error["msg"])
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return msg[:1].lower() + msg[1:]


def _known_keys(model: type[BaseModel], path: Sequence[str]) -> list[str]:
    """The keys a table at `path` under `model` may hold (none when the path leads to no model)."""
    node: Any = model
    for key in path:
        field = node.model_fields.get(key) if isinstance(node, type) and issubclass(node, BaseModel) else None
        if field is None:
            return []
        node = _model_in(field.annotation)
    return list(node.model_fields) if isinstance(node, type) and issubclass(node, BaseModel) else []


def _model_in(annotation: Any) -> Any:
    """The model a field holds, through lists, optionals and Annotated; None if it holds none."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _key_path(data: Any, loc: Sequence[int | str]) -> list[str]:
    """The keys of `loc` that exist in the data; pydantic adds union-branch names that are not keys."""
    path: list[str] = []
    node = data
    for elem in loc:
        if isinstance(node, dict) and str(elem) in node:
            node = node[str(elem)]
        elif isinstance(node, list) and isinstance(elem, int) and elem < len(node):
            node = node[elem]
        elif isinstance(node, dict):
            # A missing key (pydantic names it) is still part of the path; a union tag is not.
            if not path or elem not in _UNION_TAGS:
                path.append(str(elem))
            break
        else:
            continue
        path.append(str(elem))
    return path


_UNION_TAGS = {"constrained-float", "float", "int", "str", "bool", "literal[False]", "list", "dict"}


def _set_dotted(data: dict[str, Any], keys: Sequence[str], value: Any) -> list[str] | None:
    """Set data[k1][k2]... = value; the path of a value that is not a table in the way, if any."""
    node = data
    for depth, key in enumerate(keys[:-1]):
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return list(keys[: depth + 1])
    node[keys[-1]] = value
    return None


def _decode_error_line(message: str) -> int | None:
    match = re.search(r"at line (\d+)", message)
    return int(match.group(1)) if match else None


# Linear in the line (a config line may be 1 MiB long): the table name is every character up to the
# first "]", taken whole and stripped after (a lazy name between optional spaces tried every split of
# a long run of spaces: cubic); each run is possessive.
_HEADER = re.compile(r"^\s*+\[\[?+([^\]]++)\]\]?+\s*+(?:#.*+)?+$")
_KEY = re.compile(r"""^\s*+("[^"]*+"|'[^']*+'|[A-Za-z0-9_.-]++)\s*+=""")


def _find_line(text: str, loc: Sequence[str]) -> int | None:
    """The 1-based line that sets the key at `loc` (or opens its table), for error messages."""
    table: list[str] = []
    items: dict[tuple[str, ...], int] = {}  # [[array]] headers seen so far, per array
    best: int | None = None
    for number, raw in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(raw)
        if header:
            table = [part.strip().strip("\"'") for part in header.group(1).strip().split(".")]
            if raw.lstrip().startswith("[["):
                # The n-th [[a.b]] opens item n of array a.b, which pydantic's location names a.b.n.
                n = items.get(tuple(table), 0)
                items[tuple(table)] = n + 1
                table.append(str(n))
            if table == list(loc[: len(table)]) and best is None:
                best = number
            continue
        key = _KEY.match(raw)
        if not key:
            continue
        full = table + [part.strip("\"'") for part in key.group(1).split(".")]
        if full == list(loc[: len(full)]):
            # The exact key, or an inline table/array holding it.
            return number
    return best
