"""The engine adapter protocol the replay drives, and the data it exchanges."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol


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
    start_s: float = 0.0
    """Seconds the engine took to start."""
    details: dict[str, str] = field(default_factory=dict)
    """Free-form facts for the run metadata (attention backend, device, ...)."""


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

    async def stop(self) -> None:
        """Stop the engine and its processes."""
        ...
