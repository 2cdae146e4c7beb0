"""The engine adapter protocol the replay drives, and the data it exchanges."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Telemetry an engine can deliver (EngineInfo.signals); the report lists the ones a run lacked.
SIGNALS: dict[str, str] = {
    "per_step": "per-step engine stats (batch, KV cache, prefix cache, preemptions, tokens per step)",
    "spec_per_pos": "speculative acceptance per draft position with exact per-position draft counts",
    "spec_per_request": "speculative acceptance by output position and by turn (per-request, per-step)",
    "cudagraphs": "CUDA-graph hit rate and padding (per-step graph stats)",
    "allocator": "allocator fragmentation and worker memory (worker RPC)",
    "metrics": "the server's own /metrics counters and latency histograms",
}


@dataclass(slots=True)
class SpecSteps:
    """Filled by the engine when a request finishes: its verify steps, in order (vLLM's per-request
    "detailed" speculative metrics). Empty when the engine does not report them."""

    accepted: list[int] = field(default_factory=list)
    """Draft tokens accepted at each verify step."""
    drafted: list[int] = field(default_factory=list)
    """Draft tokens proposed at each verify step."""


@dataclass(slots=True)
class Stamps:
    """Filled by an engine that sends from a process of its own: when it sent the request and when its
    deltas arrived, on the system-wide monotonic clock (`time.monotonic`), taken where the stream is read
    so soakd's own event loop adds nothing to them. `sent` stays None when the engine stamps nothing."""

    handed: float | None = None
    """When the engine got the request (later than `send_at` when the engine held it, e.g. through its
    restart); soakd's own work after it (the body, its sender process's restart) counts as lateness."""
    sent: float | None = None
    """When the sender began the request (its due time reached); TTFT and E2E count from here."""
    written: float | None = None
    """When its first bytes were handed to the socket, after any connection was opened: its lateness
    counts to here (None: not stamped, `sent` stands in). Time spent opening a connection counts in
    both its lateness and its TTFT (which runs from `sent`, as a client sees it)."""
    new_connection: bool = False
    """A connection was opened for it (none was free in the pool)."""
    first: float | None = None
    """First delta with tokens."""
    last: float | None = None
    """Last delta with tokens."""
    gaps: float = 0.0
    """Sum of the gaps between deltas with tokens."""
    deltas: int = 0
    """Gaps counted in `gaps` (deltas with tokens after the first)."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One request as the engine sees it: token ids in, an exact number of tokens out."""

    request_id: str
    prompt_ids: Sequence[int]
    max_tokens: int
    seed: int = 0
    temperature: float | None = None
    """Recorded with the request in the trace; None: the engine's configured temperature."""
    top_p: float | None = None
    """Recorded with the request in the trace; None: 1.0."""
    output_ids: list[int] | None = None
    """When a list, the engine appends the generated token ids to it (a session's next turn replays
    the conversation with them); engines that cannot report ids leave it empty."""
    spec: SpecSteps | None = None
    """When given, the engine fills it with the request's per-step acceptance, if it can."""
    send_at: float | None = None
    """Monotonic time to send at, for an engine whose info says `sends_at` (it waits for it in its own
    sender); others are called at that time already. None: at once."""
    stamps: Stamps | None = None
    """When given, an engine with its own sender fills it (see Stamps)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What the rest of soakd needs to know about a started engine."""

    kind: str
    """Adapter name, e.g. "vllm-local"."""
    version: str
    """Engine version string."""
    model: str
    """Model path or name."""
    config_id: str
    """Short stable id of the engine configuration (tag `config` on engine series)."""
    vocab_size: int
    """Token ids are drawn from [0, vocab_size)."""
    reserved_ids: tuple[int, ...] = ()
    """Special token ids prompts must not contain."""
    max_model_len: int = 0
    """Longest prompt + output the engine accepts, in tokens."""
    speculative_tokens: int = 0
    """Draft tokens per step (0: no speculative decoding)."""
    cudagraphs: bool = False
    """True when the engine can run steps under CUDA graphs."""
    capture_sizes: tuple[int, ...] = ()
    """CUDA-graph capture sizes (tokens per step) the engine was built with; empty when unknown."""
    live_active_seqs: bool = False
    """True when soakd's scheduler class runs in the engine (the admission limit can move live)."""
    start_s: float = 0.0
    """Seconds the engine took to start."""
    details: dict[str, str] = field(default_factory=dict)
    """Free-form facts for the run metadata (attention backend, device, ...)."""
    signals: tuple[str, ...] = ()
    """Which of SIGNALS this engine delivers."""
    sends_at: bool = False
    """True when the engine sends each request at its `send_at` from a sender of its own (a process
    with its own event loop) and stamps it: the replay hands requests on ahead of their due time."""


class Engine(Protocol):
    """An inference engine soakd replays traffic through."""

    @property
    def info(self) -> EngineInfo:
        """Facts about the engine; valid after start()."""
        ...

    async def start(self) -> None:
        """Start the engine; raises EngineError when it cannot."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        """Stream the request; each item is the number of new output tokens in one delta.

        Cancelling the consumer aborts the request in the engine.
        """
        ...

    def process_ids(self) -> list[int]:
        """PIDs of the engine's processes (for RSS accounting); may be empty."""
        ...

    def alive(self) -> bool:
        """False once the engine is known to be dead (a process gone, the engine core failed); cheap."""
        ...

    async def memory_stats(self) -> list[Any]:
        """One dict of plain numbers per worker from soakd's worker extension; raises EngineError
        when the engine has no such channel."""
        ...

    async def metrics_text(self) -> str:
        """The server's Prometheus /metrics body; raises EngineError when there is none."""
        ...

    def telemetry_summary(self) -> dict[str, object]:
        """How the engine's own telemetry fared (steps received and lost, stat-logger cost)."""
        ...

    async def prepare_replay(self, concurrency: int) -> None:
        """Called just before the replay's first request: get ready for up to `concurrency` requests
        at once (an HTTP engine opens its connections). Never raises."""
        ...

    async def stop(self) -> None:
        """Stop the engine and its processes."""
        ...
