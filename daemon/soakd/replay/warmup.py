"""The warm-up before a soak: the trace's first requests sent once, unrecorded, so one-off kernel
compilation (Triton JIT, first-shape allocations) does not land in the soak's latencies."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from soakd.clock import SystemClock
from soakd.engine.base import Engine
from soakd.metric import FieldValue
from soakd.replay.admission import AdmissionGate
from soakd.replay.pacer import Scheduled
from soakd.replay.prompts import PromptSynth
from soakd.replay.runner import Replayer, RequestRecord
from soakd.traces.model import RequestSpec


async def warm_up(
    engine: Engine,
    first: Sequence[RequestSpec],
    prompts: PromptSynth,
    gate: AdmissionGate,
    on_event: Callable[..., None],
    on_replayer: Callable[[Replayer], None],
    *,
    run_tag: str,
    max_model_len: int,
    timeout_s: float,
    seed: int,
) -> int:
    """Send `first` all at once and wait for the answers; returns how many were sent. Its prompts use
    their own salt (`run_tag`), so they warm no prefix the replay will look up. `on_replayer` gets the
    replayer before it runs (a stop signal during warm-up ends it)."""
    records: list[RequestRecord] = []
    warm = Replayer(
        engine,
        [Scheduled(spec=spec, loop=-1, due_s=0.0) for spec in first],
        prompts,
        gate,
        SystemClock(),
        records.append,
        run_tag=run_tag,
        max_pending=len(first),
        max_model_len=max_model_len,
        drain_timeout_s=timeout_s,
        seed=seed,
        sessions="open",  # all at once: warm-up only needs the kernels compiled
    )
    on_replayer(warm)
    t0 = time.monotonic()
    stats = await warm.run()
    took = time.monotonic() - t0
    fields: dict[str, FieldValue] = {
        "requests": len(records),
        "failed": stats.failed,
        # Cut by its timeout or a stop: a warm-up that hung shows here, not as failures.
        "incomplete": stats.incomplete,
        "warmup_s": took,
    }
    on_event("warmup", f"{stats.completed} warm-up requests in {took:.1f} s", **fields)
    return len(records)
