"""soakd's stat logger for a vLLM server it launched: per-step stats to soakd over a Unix stream socket.

vLLM loads it from the `vllm.stat_logger_plugins` entry point in every process that builds an AsyncLLM
(the API server; also soakd's own in-process engine). It does nothing unless SOAKD_STATS_SOCKET names
soakd's socket, so installing soakd next to a production server costs one environment lookup.

`record()` runs on the server's output loop once per engine step: it converts the step, appends one
JSON line to its buffer and writes what the socket takes without blocking. A stream socket, not
datagrams: Linux queues only `net.unix.max_dgram_qlen` (often 10) datagrams, so a soakd busy for a few
milliseconds lost steps; a stream buffers ~200 kB in the kernel plus this buffer. Past `_MAX_PENDING`
a step is dropped; its sequence number is skipped, so soakd counts it when the next step arrives.
Steps still buffered when the server is killed at the end of a run are not counted.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from soakd.engine.channel import SOCKET_ENV
from soakd.engine.stats import step_from_vllm, step_to_wire


def engine_facts(vllm_config: Any) -> dict[str, object]:
    """What soakd needs to know about the engine the server built (sent once, at start)."""
    facts: dict[str, object] = {}
    try:
        import vllm
        from vllm.platforms import current_platform

        facts["version"] = str(vllm.__version__)
        facts["cpu"] = bool(current_platform.is_cpu())
        comp = vllm_config.compilation_config
        facts["cudagraph_mode"] = str(getattr(comp, "cudagraph_mode", "NONE"))
        sizes = getattr(comp, "cudagraph_capture_sizes", None) or []
        facts["cudagraph_capture_sizes"] = [int(x) for x in sizes]
        facts["max_num_seqs"] = int(vllm_config.scheduler_config.max_num_seqs)
        spec = vllm_config.speculative_config
        facts["speculative_tokens"] = int(spec.num_speculative_tokens) if spec is not None else 0
        facts["enforce_eager"] = bool(vllm_config.model_config.enforce_eager)
        facts["vocab_size"] = int(vllm_config.model_config.get_vocab_size())
        facts["max_model_len"] = int(vllm_config.model_config.max_model_len)
    # Facts are a courtesy: a release that moved one must not stop the server from starting.
    except Exception as err:  # noqa: BLE001
        facts["error"] = f"{type(err).__name__}: {err}"[:200]
    return facts


_MAX_PENDING = 16 * 1024 * 1024  # bytes of steps held while soakd does not read (~30 k steps)


class SoakdStatLogger(StatLoggerBase):
    """Sends each step's stats to soakd; see the module docstring."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self._sock: socket.socket | None = None
        self._out = bytearray()
        self._seq = 0
        self._dropped = 0
        self._cost_ns = 0
        path = os.environ.get(SOCKET_ENV, "")
        if not path:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        self._sock = sock
        self._send({"hello": engine_facts(vllm_config), "pid": os.getpid(), "engine": engine_index})

    def _send(self, message: dict[str, object]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        if len(self._out) + len(data) > _MAX_PENDING:
            self._dropped += 1  # soakd has not read for a long while: count it, never block the server
            return
        self._out += data
        self._flush()

    def _flush(self) -> None:
        if self._sock is None or not self._out:
            return
        try:
            sent = self._sock.send(self._out)
        except BlockingIOError:
            return
        except OSError:  # soakd is gone: stop sending
            self._sock.close()
            self._sock = None
            return
        del self._out[:sent]

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if self._sock is None:
            return
        t0 = time.perf_counter_ns()
        step = step_from_vllm(scheduler_stats, iteration_stats, time.time_ns(), engine_idx)
        self._seq += 1
        # The cost of the previous record() rides on this one: the logger's overhead, measured in place.
        self._send(
            {
                "s": step_to_wire(step),
                "q": self._seq,
                "d": self._dropped,
                "c": self._cost_ns,
                "pid": os.getpid(),
            }
        )
        self._cost_ns = time.perf_counter_ns() - t0

    def log(self) -> None:
        """vLLM calls this every few seconds (its stats-log interval): write out what an idle engine
        left in the buffer."""
        self._flush()

    def log_engine_initialized(self) -> None:
        return None
