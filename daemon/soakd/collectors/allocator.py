"""Allocator telemetry from the engine's workers: one `allocator` sample per worker per slow-tier refresh.

The readings come from `SoakdWorkerExtension.soakd_memory_stats` (soakd.engine.worker_ext), called on
every worker through vLLM's collective_rpc: in process (`local_rpc`, an AsyncLLM) or over HTTP on a
server started with VLLM_SERVER_DEV_MODE=1 (`server_rpc`).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp

from soakd.errors import CollectorError
from soakd.metric import FieldValue, Sample

if TYPE_CHECKING:
    from soakd.engine.base import EngineInfo

RPC_METHOD = "soakd_memory_stats"

Rpc = Callable[[], Awaitable[list[Any]]]


def validate_result(index: int, result: object) -> dict[str, FieldValue]:
    """One worker's reading as Sample fields; CollectorError naming what is wrong otherwise.

    A reading is a dict of str keys to ints, floats or strs. Anything else (a bool, None, a nested
    value, a non-dict result such as the str vLLM's HTTP endpoint makes of an unknown object) is
    rejected rather than written, since InfluxDB fixes a field's type on its first write.
    """
    if not isinstance(result, dict):
        raise CollectorError(
            f"{RPC_METHOD} from worker {index}: expected a dict, got {type(result).__name__}: "
            f"{str(result)[:120]!r}"
        )
    if not result:
        raise CollectorError(f"{RPC_METHOD} from worker {index}: empty dict")
    fields: dict[str, FieldValue] = {}
    for key, value in result.items():
        if not isinstance(key, str) or not key:
            raise CollectorError(f"{RPC_METHOD} from worker {index}: key {key!r} is not a non-empty str")
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise CollectorError(
                f"{RPC_METHOD} from worker {index}: field {key!r} is {type(value).__name__} "
                f"({str(value)[:60]!r}), expected int, float or str"
            )
        fields[key] = value
    return fields


class AllocatorCollector:
    """RefreshingCollector (`allocator`): `refresh()` awaits the RPC, `collect()` hands each worker's
    latest reading out once.

    A reading is written at most once: `collect()` clears what it returned, so when refreshes stop
    succeeding the measurement goes quiet instead of repeating a stale value.
    """

    name = "allocator"

    def __init__(self, rpc: Rpc, config_id: str = "") -> None:
        self._rpc = rpc
        self.config_id = config_id
        self._latest: dict[int, dict[str, FieldValue]] = {}

    def engine_started(self, info: EngineInfo) -> None:
        """After a rebuild the series carry the new configuration's id."""
        self.config_id = info.config_id

    async def refresh(self) -> None:
        results: object = await self._rpc()
        if not isinstance(results, list):
            raise CollectorError(
                f"{RPC_METHOD}: expected a list of per-worker results, got {type(results).__name__}"
            )
        # Validate every worker before keeping any, so one bad reading never half-updates a refresh.
        readings = {i: validate_result(i, r) for i, r in enumerate(results)}
        self._latest.update(readings)

    def collect(self, now_ns: int) -> Sequence[Sample]:
        out: list[Sample] = []
        for index in sorted(self._latest):
            tags = {"worker": str(index)}
            if self.config_id:
                tags["config"] = self.config_id
            out.append(Sample("allocator", self._latest[index], now_ns, tags=tags))
        self._latest.clear()
        return out

    def close(self) -> None:
        self._latest.clear()


def local_rpc(llm: Any, timeout_s: float | None = None) -> Rpc:
    """The rpc for an in-process AsyncLLM started with the soakd worker extension.

    vLLM 0.32's `AsyncLLM.collective_rpc(method, timeout=None, args=(), kwargs=None)`
    (vllm/v1/engine/async_llm.py:1205) returns one result per worker, in rank order.
    """

    async def rpc() -> list[Any]:
        results = await llm.collective_rpc(RPC_METHOD, timeout=timeout_s)
        return list(results) if results is not None else []

    return rpc


# One connection per call, never pooled. When a call fails, vLLM's handler raises through Starlette
# after sending its 500 and uvicorn then closes the connection (uvicorn/protocols/http/
# httptools_impl.py:431, "Exception in ASGI application"); aiohttp has usually pooled it already (a
# small body is read with the headers), so the session's next request, ours or another user's of a
# shared session, failed with a connection reset against vLLM 0.32. A loopback connect per slow-tier
# refresh costs well under a millisecond.
_CLOSE = {"Connection": "close"}


def server_rpc(
    session: aiohttp.ClientSession, base_url: str, timeout_s: float = 10.0, method: str = RPC_METHOD
) -> Rpc:
    """The rpc for a vLLM OpenAI server started with VLLM_SERVER_DEV_MODE=1 and the soakd extension.

    The dev-mode endpoint (vllm/entrypoints/serve/dev/rpc/api_router.py:23-59 in vLLM 0.32) takes
    POST /collective_rpc with a JSON object {"method": str, "args": [str], "kwargs": {str: str},
    "timeout": float | null} (only "method" required) and answers 200 {"results": [...]}, one entry per
    worker: a dict or list as returned, anything else as str(result); a call returning None gives an
    empty 200 body. Without dev mode the route does not exist (404); a method the workers lack (or one
    that raises) is a 500 whose JSON names the worker's error, and the engine keeps serving.
    `method` is for tests; soakd calls soakd_memory_stats.
    """
    url = base_url.rstrip("/") + "/collective_rpc"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    request = {"method": method}

    async def rpc() -> list[Any]:
        try:
            async with session.post(url, json=request, headers=_CLOSE, timeout=timeout) as resp:
                text = await resp.text()
                if resp.status != 200:
                    hint = " (is VLLM_SERVER_DEV_MODE=1 set on the server?)" if resp.status == 404 else ""
                    raise CollectorError(f"POST {url}: HTTP {resp.status}{hint}: {text[:200]}")
        except (aiohttp.ClientError, TimeoutError) as err:
            raise CollectorError(f"POST {url}: {type(err).__name__}: {err}") from err
        if not text.strip():
            raise CollectorError(f"POST {url}: empty answer ({method} returned nothing)")
        try:
            body = json.loads(text)
        except json.JSONDecodeError as err:
            raise CollectorError(f"POST {url}: answer is not JSON: {text[:200]!r}") from err
        results = body.get("results") if isinstance(body, dict) else None
        if not isinstance(results, list):
            raise CollectorError(f"POST {url}: no 'results' list in the answer: {text[:200]!r}")
        return results

    return rpc
