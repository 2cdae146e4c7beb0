"""One completion over HTTP: post it, read its event stream, count its tokens, and say what a failure means.

Shared by the OpenAI engine in soakd's own event loop and by the sender process (engine/sender.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import aiohttp

from soakd.engine.base import SpecSteps
from soakd.engine.stats import copy_spec_steps
from soakd.errors import EngineError
from soakd.sse import DataSplitter

CONTROL_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
ERROR_CHARS = 160
BODY_CHARS = 4096
# Validation messages can echo the request's input; nothing from there on is kept.
_ECHO = re.compile(r"input_value=|'input':|\"input\":", re.IGNORECASE)
# Error kinds a sender's final frame carries, mapped back to the exceptions raised here.
KIND_GONE = "gone"
KIND_ENGINE = "engine"
KIND_REQUEST = "request"


class RequestError(Exception):
    """One request failed (HTTP error status, an error event in the stream, a broken connection)."""


class ServerGone(EngineError):
    """Nothing listens at the server any more (a fresh connection refused): every later request would
    fail the same way."""


@dataclass(slots=True)
class SendTrace:
    """What the HTTP client did for one request before its bytes left: when its first bytes (headers
    with the body) were handed to the socket, i.e. the request as the server receives it, and whether a
    connection was opened for it."""

    written: float | None = None
    new_connection: bool = False


class SendFigures:
    """How the replay's requests left soakd: how many opened a connection, and the time from the start
    of a request's send to its first bytes reaching the socket (opening a connection included)."""

    __slots__ = ("new_connections", "over_1ms", "over_10ms", "requests", "warmed", "write_max_s")

    def __init__(self) -> None:
        self.requests = self.new_connections = self.warmed = self.over_1ms = self.over_10ms = 0
        self.write_max_s = 0.0

    def add(self, sent: float | None, written: float | None, new_connection: bool) -> None:
        if sent is None or written is None:
            return
        self.requests += 1
        self.new_connections += new_connection
        delay = max(0.0, written - sent)
        self.write_max_s = max(self.write_max_s, delay)
        self.over_1ms += delay > 0.001
        self.over_10ms += delay > 0.010

    def summary(self) -> dict[str, object]:
        return {
            "requests": self.requests,
            "connections_warmed": self.warmed,
            "connections_opened": self.new_connections,
            "write_max_ms": round(self.write_max_s * 1000, 3),
            "write_over_1ms": self.over_1ms,
            "write_over_10ms": self.over_10ms,
        }


def send_trace_config() -> aiohttp.TraceConfig:
    """aiohttp hooks that fill the SendTrace passed as a request's `trace_request_ctx`."""

    async def created(_: aiohttp.ClientSession, ctx: SimpleNamespace, __: object) -> None:
        trace = ctx.trace_request_ctx
        if isinstance(trace, SendTrace):
            trace.new_connection = True

    async def chunk_sent(_: aiohttp.ClientSession, ctx: SimpleNamespace, __: object) -> None:
        # aiohttp buffers the headers and writes them with the first body chunk, right after this
        # hook returns (it does not yield), in the same step: the first chunk's hook is the send.
        trace = ctx.trace_request_ctx
        if isinstance(trace, SendTrace) and trace.written is None:
            trace.written = time.monotonic()

    config = aiohttp.TraceConfig()
    config.on_connection_create_end.append(created)
    config.on_request_chunk_sent.append(chunk_sent)
    return config


async def open_connections(
    session: aiohttp.ClientSession, url: str, n: int, *, each: aiohttp.ClientTimeout = CONTROL_TIMEOUT
) -> int:
    """Open n connections to the server at once (concurrent GET /health, so none can reuse another's)
    and leave them in the session's pool: the replay's first burst then finds them open instead of
    connecting while its requests are due. Returns how many answered 200; `each`: one
    GET's time limit."""

    async def one() -> bool:
        try:
            async with session.get(url + "/health", timeout=each) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    return sum(await asyncio.gather(*(one() for _ in range(max(0, n)))))


def error_message(status: int, body: str) -> str:
    """A short message for a failed response: the status and the server's own message, truncated."""
    message = body
    with contextlib.suppress(ValueError):
        doc = json.loads(body)
        if isinstance(doc, dict):
            err = doc.get("error", doc.get("detail", doc.get("message", doc)))
            if isinstance(err, dict):
                err = err.get("message", err)
            message = str(err)
    message = _ECHO.split(message, maxsplit=1)[0]
    message = " ".join(message.split())[:ERROR_CHARS]
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


def tokens_from_usage(chunk: dict[str, Any]) -> int | None:
    """completion_tokens of a chunk's usage, when the server sent it."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        value = usage.get("completion_tokens")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


async def stream_completion(
    session: aiohttp.ClientSession,
    url: str,
    body: bytes,
    request_id: str,
    output_ids: list[int] | None,
    spec: SpecSteps | None,
    trace: SendTrace | None = None,
) -> AsyncIterator[int]:
    """POST one completion and yield the new output tokens of each delta that has some; `trace` is
    filled when the session has `send_trace_config()`.

    Raises ServerGone when nothing listens at the server any more, EngineError for other connection
    failures, RequestError for a request the server refused or cut short. Used by the engine in
    soakd's loop and by the sender process alike.
    """
    try:
        resp = await session.post(
            url + "/v1/completions",
            data=body,
            headers={"X-Request-Id": request_id, "Content-Type": "application/json"},
            trace_request_ctx=trace,
        )
    except aiohttp.ClientConnectorError as err:
        # Only a refused connection says the server is gone; a local error such as too many open files
        # does not.
        gone = isinstance(err.os_error, ConnectionRefusedError)
        raise (ServerGone if gone else EngineError)(f"server unreachable: {err}"[:200]) from err
    except aiohttp.ClientError as err:
        raise await _broken(session, url, err) from err
    finished = False
    try:
        if resp.status != 200:
            text = (await resp.content.read(BODY_CHARS)).decode("utf-8", errors="replace")
            raise RequestError(error_message(resp.status, text))
        splitter = DataSplitter()
        seen = 0
        async for chunk in resp.content.iter_any():
            for data in splitter.feed(chunk):
                if data == b"[DONE]":
                    finished = True
                    return
                n, seen = new_tokens(data, seen, output_ids, spec)
                if n:
                    yield n
        finished = True
    except aiohttp.ClientError as err:
        raise await _broken(session, url, err) from err
    finally:
        if finished:
            resp.release()
        else:
            # Cancelled or failed midway: dropping the connection is what makes vLLM abort the
            # request, so the engine does not keep generating tokens nobody reads.
            resp.close()


async def _broken(session: aiohttp.ClientSession, url: str, err: aiohttp.ClientError) -> Exception:
    """What a broken connection means: a server that died (ServerGone) or one failed request.

    A dropped keep-alive connection or a cut stream says nothing by itself; a fresh connection being
    refused does.
    """
    message = f"{type(err).__name__}: {err}"[:200]
    try:
        async with session.get(url + "/health", timeout=CONTROL_TIMEOUT) as resp:
            await resp.read()
    except aiohttp.ClientConnectorError as refused:
        gone = isinstance(refused.os_error, ConnectionRefusedError)
        return (ServerGone if gone else EngineError)(f"server unreachable after {message}"[:200])
    except (aiohttp.ClientError, TimeoutError):
        pass  # there, but slow or odd: judge this request alone
    return RequestError(message)


def error_of(error: dict[str, Any]) -> Exception:
    """The exception the in-loop path would have raised, from a sender's final frame."""
    message = str(error.get("message", ""))[:200]
    kind = error.get("kind")
    if kind == KIND_GONE:
        return ServerGone(message)
    if kind == KIND_ENGINE:
        return EngineError(message)
    return RequestError(message)


_USAGE_KEY = b'"completion_tokens":'
_DIGITS = re.compile(rb"\s*(\d+)")


def usage_tokens(data: bytes) -> int | None:
    """completion_tokens of a stream event's usage, read without parsing the event; None when the event
    needs parsing: no usage, an error, or vLLM's per-request speculative metrics (its last event).

    Most of a stream's events are deltas whose only figure soakd needs is the running token count, and
    a JSON parse per delta was the largest single cost of reading streams (benchmarks/RESULTS.md,
    "Capacity"). The keys' bytes cannot occur inside a JSON string (a quote there is always escaped, and
    these end in a letter before the quote), so a match is the key itself; an event holding `"error"`
    anywhere (even in its text) is left to the full parse, which raises only for a real one. Token ids
    (`return_token_ids`) need the parse: new_tokens comes here only when none are wanted."""
    at = data.rfind(_USAGE_KEY)
    if at < 0 or b'"error"' in data or b'"speculative_decoding"' in data:
        return None
    hit = _DIGITS.match(data, at + len(_USAGE_KEY))
    return int(hit.group(1)) if hit is not None else None


def new_tokens(
    data: bytes, seen: int, output_ids: list[int] | None, spec: SpecSteps | None = None
) -> tuple[int, int]:
    """(new completion tokens in this chunk, completion tokens so far) from one stream event's data;
    the chunk's token ids are appended to `output_ids` when it is a list and the server sends them,
    and the final chunk's per-request speculative metrics (vLLM, when enabled) go into `spec`. Without
    token ids wanted, an event whose count can be read without a parse (usage_tokens) is not parsed."""
    if output_ids is None and (total := usage_tokens(data)) is not None:
        return max(0, total - seen), max(seen, total)
    try:
        chunk = json.loads(data)
    except ValueError as err:
        raise RequestError("malformed stream event") from err
    if not isinstance(chunk, dict):
        raise RequestError("malformed stream event")
    if "error" in chunk:
        detail = chunk["error"]
        code = detail.get("code") if isinstance(detail, dict) else None
        status = code if isinstance(code, int) and not isinstance(code, bool) else 0
        raise RequestError("stream " + error_message(status, json.dumps(chunk)))
    choices = chunk.get("choices")
    if output_ids is not None and isinstance(choices, list):
        for choice in choices:
            ids = choice.get("token_ids") if isinstance(choice, dict) else None
            if isinstance(ids, list):
                output_ids.extend(int(i) for i in ids)
    if spec is not None:
        metrics = chunk.get("metrics")
        sd = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
        if isinstance(sd, dict):
            copy_spec_steps(sd, spec)
    total = tokens_from_usage(chunk)
    if total is not None:
        return max(0, total - seen), max(seen, total)
    # A server without continuous usage: each chunk that carries choices is one token.
    return (1 if choices else 0), seen
