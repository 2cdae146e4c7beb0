"""Record live traffic as a soakd-native trace: a pass-through proxy in front of an OpenAI-compatible server.

Clients talk to the proxy as they would to the server. Every request is forwarded unchanged (the
Authorization header included) and every answer comes back unchanged, streamed as it arrives. For each
POST /v1/completions and /v1/chat/completions that succeeds, one native record is written:

- `t`: arrival, seconds since the proxy started (monotonic clock);
- `input_tokens`, `output_tokens`: the server's own `usage` counts. A streaming request that did not ask
  for usage gets `stream_options.include_usage` added upstream, and the usage-only chunk it brings is
  taken out of what the client receives (its `system_fingerprint` goes on the finishing chunks, where
  the server puts it when usage is off);
- `hash_ids`: the prompt's prefix blocks. The prompt is tokenized by the server's POST /tokenize (token
  id prompts are used as they are) once the request is under way, off the client's path; the ids are cut
  into `block_size` blocks, each block is hashed chained to the one before it (so equal ids mean equal
  prefixes), and each distinct chain hash gets a small sequential id. Left out when tokenizing fails or
  disagrees with the server's prompt count (counted in `RecorderStats.untokenized`);
- `sampling`: the request's numeric and boolean sampling parameters; `api`: "completions" or "chat";
- `session` and `turn`: from an `X-Session-Id` request header, turns counted per session from 0;
- `prompt`: the prompt string or the messages, only when prompts are recorded on purpose.

Records are written in arrival order: a finished request waits in a small reorder buffer until every
request that arrived before it has finished, so the file reads back with `t` never decreasing. Each
record is flushed as it is written, so a crash loses only requests still in flight or waiting behind
one. Requests the server refuses or that break off are passed on to the client, counted and logged,
and not recorded: a trace describes traffic the server served. Prompt text and headers are never logged.

Over 500 lines because the proxy, the stream relay and the record writer share one request's state; split,
each half would need the other's internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import os
import signal
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import structlog
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from soakd.engine.openai_http import base_url
from soakd.errors import InputError, UsageError
from soakd.redact import redact_url
from soakd.sse import Event, EventSplitter
from soakd.traces.native import FORMAT_NAME, VERSION

log = structlog.get_logger(__name__)

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "n",
    "ignore_eos",
)
"""Request fields kept in a record's `sampling` when they are numbers or booleans."""

_APIS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
# Fields of a chat request that change how its messages are templated, hence its tokens.
_CHAT_TEMPLATE_KEYS = (
    "model",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
# Per-connection headers (RFC 9110 7.6.1) and those the proxy sets itself.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        # Bodies are parsed for usage, so they travel uncompressed between proxy and server.
        "accept-encoding",
        "content-encoding",
        "date",
        "server",
    }
)
_SESSION_HEADER = "X-Session-Id"
_MAX_BODY = 256 * 1024 * 1024  # multimodal requests carry images inline
_MAX_SESSIONS = 100_000


@dataclass(slots=True)
class RecorderStats:
    """What the recorder saw and wrote."""

    requests: int = 0
    """Completion and chat requests received."""
    recorded: int = 0
    """Records written to the trace."""
    failed: int = 0
    """Requests the server refused or that broke off (passed on, not recorded)."""
    client_gone: int = 0
    """Requests whose client disconnected before the end (the server's request was dropped too)."""
    unusable: int = 0
    """Successful answers without usable token counts (no usage, zero tokens): not recorded."""
    untokenized: int = 0
    """Records written without hash_ids (tokenizing failed or disagreed with the server's count)."""
    dropped_late: int = 0
    """Records given up because too many later ones waited behind their still-running request."""
    write_errors: int = 0
    """Records the disk refused (logged)."""
    passthrough: int = 0
    """Other requests forwarded (models, health, metrics, ...)."""
    errors: dict[str, int] = field(default_factory=dict)
    """Failures by kind (HTTP status, "stream error", "unreachable", ...)."""

    def count_error(self, kind: str) -> None:
        self.failed += 1
        self.errors[kind] = self.errors.get(kind, 0) + 1


class PrefixHasher:
    """Maps token-id prompts to prefix block ids: equal prefixes of whole blocks get equal ids.

    Each block's hash covers the hash of the block before it, so an id stands for the whole prefix up to
    and including its block, as vLLM's prefix cache keys its blocks. Distinct chain hashes get
    sequential ids from 0; the map keeps the `max_blocks` most recently seen (about 150 bytes each), and
    a forgotten prefix seen again gets a new id.
    """

    def __init__(self, block_size: int, max_blocks: int = 1_000_000) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._max = max_blocks
        self._ids: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0

    def ids(self, tokens: Sequence[int]) -> list[int]:
        out: list[int] = []
        prev = b""
        size = self.block_size
        for start in range(0, len(tokens), size):
            block = array("I", tokens[start : start + size]).tobytes()
            prev = hashlib.blake2b(prev + block, digest_size=16).digest()
            known = self._ids.get(prev)
            if known is None:
                known = self._next
                self._next += 1
                self._ids[prev] = known
                if len(self._ids) > self._max:
                    self._ids.popitem(last=False)
            else:
                self._ids.move_to_end(prev)
            out.append(known)
        return out


class OrderedRecordWriter:
    """Writes records in arrival order, each as soon as every earlier arrival has finished.

    `reserve()` at arrival, `finish(seq, record or None)` exactly once at the end. At most `max_waiting`
    finished records wait behind a running request; past that, the oldest running one is given up (its
    record is dropped when it finishes) so memory stays bounded under a request that never ends.
    """

    def __init__(self, fh: IO[str], stats: RecorderStats, max_waiting: int = 10_000) -> None:
        self._fh = fh
        self._stats = stats
        self._max_waiting = max_waiting
        self._next_seq = 0
        self._head = 0
        self._done: dict[int, dict[str, Any] | None] = {}
        self._given_up: set[int] = set()

    def reserve(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def finish(self, seq: int, record: dict[str, Any] | None) -> None:
        if seq in self._given_up:
            self._given_up.discard(seq)
            if record is not None:
                self._stats.dropped_late += 1
                log.warning("record_dropped_late", waited_behind=self._max_waiting)
            return
        self._done[seq] = record
        self._flush_ready()
        while len(self._done) > self._max_waiting:
            self._given_up.add(self._head)
            self._head += 1
            self._flush_ready()

    def _flush_ready(self) -> None:
        while self._head in self._done:
            record = self._done.pop(self._head)
            self._head += 1
            if record is not None:
                self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        try:
            self._fh.write(json.dumps(record, separators=(",", ":"), ensure_ascii=False) + "\n")
            self._fh.flush()
        except (OSError, ValueError) as err:
            self._stats.write_errors += 1
            if self._stats.write_errors == 1 or self._stats.write_errors % 1000 == 0:
                log.error("record_not_written", error=str(err), lost=self._stats.write_errors)
            return
        self._stats.recorded += 1

    @property
    def waiting(self) -> int:
        return len(self._done)


def sampling_of(body: dict[str, Any]) -> dict[str, float | int | bool]:
    """The request's sampling parameters that are numbers or booleans."""
    out: dict[str, float | int | bool] = {}
    for key in SAMPLING_KEYS:
        value = body.get(key)
        if isinstance(value, bool | int | float):
            out[key] = value
    return out


def check_listen(host: str, *, allow_remote: bool) -> None:
    """Refuse to listen beyond loopback unless asked: the proxy forwards credentials and prompts."""
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UsageError(f"--listen {host}: not a loopback address (pass --allow-remote to listen there)")


def _forward_headers(headers: Any) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        if name.lower() not in _HOP_BY_HOP:
            out.add(name, value)
    return out


def _sse(obj: dict[str, Any]) -> bytes:
    # vLLM's own serialization: compact JSON, UTF-8 as is.
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _usage(obj: dict[str, Any]) -> tuple[int, int] | None:
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        return prompt, completion
    return None


def _maybe_finishing(data: bytes) -> bool:
    """Cheap pre-check before parsing: a chunk whose finish_reason is not null."""
    return b'"finish_reason"' in data and b'"finish_reason":null' not in data


def _finishing(obj: dict[str, Any]) -> bool:
    choices = obj.get("choices")
    return isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") is not None for c in choices
    )


class _ClientGone(Exception):
    """The client disconnected while its answer was streaming."""


@dataclass(slots=True)
class _Call:
    """One completion or chat request on its way through the proxy."""

    seq: int
    t: float
    api: str
    body: dict[str, Any]
    session: str
    turn: int
    usage: tuple[int, int] | None = None


class Recorder:
    """The proxy's handlers and state; `serve_recorder` runs it."""

    def __init__(
        self,
        upstream: str,
        writer: OrderedRecordWriter,
        stats: RecorderStats,
        *,
        block_size: int,
        record_prompts: bool,
    ) -> None:
        self._upstream = base_url(upstream)
        self._writer = writer
        self.stats = stats
        self._hasher = PrefixHasher(block_size)
        self._record_prompts = record_prompts
        self._t0 = time.monotonic()
        self._turns: OrderedDict[str, int] = OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._finalizers: set[asyncio.Task[None]] = set()
        self._tokenize_missing = False

    async def open(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
        )

    async def close(self) -> None:
        if self._finalizers:
            await asyncio.gather(*self._finalizers, return_exceptions=True)
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        return app

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("recorder not opened")
        return self._session

    def _target(self, request: web.Request) -> URL:
        return URL(self._upstream + request.raw_path, encoded=True)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        api = _APIS.get(request.path) if request.method == "POST" else None
        if api is None:
            self.stats.passthrough += 1
            return await self._passthrough(request)
        t = time.monotonic() - self._t0
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            # The server will answer it (with an error): nothing to record.
            self.stats.passthrough += 1
            return await self._passthrough(request, raw)
        self.stats.requests += 1
        session = request.headers.get(_SESSION_HEADER, "")
        call = _Call(self._writer.reserve(), t, api, body, session, self._next_turn(session))
        finished = False
        try:
            response, finished = await self._complete(request, call, raw)
            return response
        finally:
            if not finished:
                self._writer.finish(call.seq, None)

    def _next_turn(self, session: str) -> int:
        if not session:
            return 0
        turn = self._turns.pop(session, -1) + 1
        self._turns[session] = turn
        if len(self._turns) > _MAX_SESSIONS:
            self._turns.popitem(last=False)
        return turn

    async def _complete(
        self, request: web.Request, call: _Call, raw: bytes
    ) -> tuple[web.StreamResponse, bool]:
        """Forward one completion/chat request; (the client's response, whether its record is handed on)."""
        body = call.body
        stream = body.get("stream") is True
        injected = False
        if stream:
            options = body.get("stream_options")
            if not (isinstance(options, dict) and options.get("include_usage") is True):
                options = dict(options) if isinstance(options, dict) else {}
                options["include_usage"] = True
                raw = json.dumps({**body, "stream_options": options}).encode()
                injected = True
        headers = _forward_headers(request.headers)
        try:
            upstream = await self._client().request(
                request.method, self._target(request), data=raw, headers=headers
            )
        except aiohttp.ClientError as err:
            return self._unreachable(call, err), False
        # Tokenizing waits until the server has the request, so it never delays the request itself.
        tokens = asyncio.create_task(self._prompt_tokens(call, request.headers.get("Authorization")))
        handed_on = False
        try:
            response: web.StreamResponse
            if upstream.status != 200:
                response = await self._relay_whole(upstream)
                self._failed(call, f"HTTP {upstream.status}")
                return response, False
            if stream:
                response, ok = await self._relay_stream(request, upstream, call, injected)
                if not ok:
                    return response, False
            else:
                whole = response = await self._relay_whole(upstream)
                with contextlib.suppress(ValueError):
                    doc = json.loads(whole.body) if isinstance(whole.body, bytes) else None
                    if isinstance(doc, dict):
                        call.usage = _usage(doc)
            if call.usage is None:
                self.stats.unusable += 1
                return response, False
            self._finalize_later(call, tokens)
            handed_on = True
            return response, True
        except aiohttp.ClientError as err:  # the answer broke off while being read whole
            return self._unreachable(call, err), False
        finally:
            if not handed_on:
                tokens.cancel()
            # Returns a fully read connection to the pool; closes one cut short, which makes the
            # server abort the request.
            upstream.release()

    def _unreachable(self, call: _Call, err: BaseException) -> web.Response:
        kind = "unreachable" if isinstance(err, aiohttp.ClientConnectorError) else type(err).__name__
        self.stats.count_error(kind)
        log.warning("upstream_unreachable", api=call.api, error=type(err).__name__)
        doc = {"error": {"message": "upstream server unreachable", "type": "BadGateway", "code": 502}}
        return web.json_response(doc, status=502)

    def _failed(self, call: _Call, kind: str) -> None:
        self.stats.count_error(kind)
        log.warning("upstream_error", api=call.api, kind=kind)

    async def _relay_whole(self, upstream: aiohttp.ClientResponse) -> web.Response:
        data = await upstream.read()
        return web.Response(body=data, status=upstream.status, headers=_forward_headers(upstream.headers))

    async def _relay_stream(
        self, request: web.Request, upstream: aiohttp.ClientResponse, call: _Call, injected: bool
    ) -> tuple[web.StreamResponse, bool]:
        """Pass the event stream on as it comes; (the response, whether it ended well with usage seen).

        With `injected`, the usage the proxy asked for is taken out again (see _Relay).
        """
        response = web.StreamResponse(status=upstream.status, headers=_forward_headers(upstream.headers))
        relay = _Relay(response, call, injected)
        try:
            try:
                await response.prepare(request)
            except ConnectionError as err:
                raise _ClientGone from err
            async for chunk in upstream.content.iter_any():
                for event in relay.splitter.feed(chunk):
                    await relay.event(event)
            for event in relay.splitter.close():
                await relay.send(event.raw)
            await relay.release_held()
        except _ClientGone:
            self.stats.client_gone += 1
            log.info("client_disconnected", api=call.api)
            # Close, not release: the server aborts a request only when its connection goes away, and
            # releasing a response cut short does not reliably close it (seen: a 1,900-token answer
            # generated to the end for a client long gone).
            upstream.close()
            return response, False
        except aiohttp.ClientError as err:
            relay.broken = f"stream broken: {type(err).__name__}"
        broken = relay.broken or ("" if relay.done else "stream ended without [DONE]")
        if broken:
            self._failed(call, broken)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
        return response, not broken

    async def _passthrough(self, request: web.Request, raw: bytes | None = None) -> web.StreamResponse:
        if raw is None:
            raw = await request.read()
        try:
            upstream = await self._client().request(
                request.method,
                self._target(request),
                data=raw if raw else None,
                headers=_forward_headers(request.headers),
            )
        except aiohttp.ClientError as err:
            log.warning("upstream_unreachable", path=request.path, error=type(err).__name__)
            doc = {"error": {"message": "upstream server unreachable", "type": "BadGateway", "code": 502}}
            return web.json_response(doc, status=502)
        try:
            response = web.StreamResponse(status=upstream.status, headers=_forward_headers(upstream.headers))
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
        finally:
            upstream.close()

    async def _prompt_tokens(self, call: _Call, authorization: str | None) -> list[int] | None:
        """The prompt's token ids: as sent, or from the server's /tokenize; None when unknown."""
        body = call.body
        if call.api == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]  # a batch of one
            if isinstance(prompt, list) and all(isinstance(i, int) for i in prompt):
                return [int(i) for i in prompt]
            if not isinstance(prompt, str):
                return None  # a batch of prompts: one record cannot say which blocks are whose
            query: dict[str, Any] = {"prompt": prompt}
            for key in ("model", "add_special_tokens"):
                if key in body:
                    query[key] = body[key]
        else:
            if not isinstance(body.get("messages"), list):
                return None
            query = {"messages": body["messages"]}
            for key in _CHAT_TEMPLATE_KEYS:
                if key in body:
                    query[key] = body[key]
        if self._tokenize_missing:
            return None
        headers = {"Authorization": authorization} if authorization else None
        try:
            async with self._client().post(
                self._upstream + "/tokenize",
                json=query,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=60.0),
            ) as resp:
                if resp.status == 404:
                    if not self._tokenize_missing:
                        log.warning("tokenize_unavailable", hint="the server has no /tokenize: no hash_ids")
                    self._tokenize_missing = True
                    return None
                if resp.status != 200:
                    log.warning("tokenize_failed", api=call.api, status=resp.status)
                    return None
                doc = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            log.warning("tokenize_failed", api=call.api, error=type(err).__name__)
            return None
        tokens = doc.get("tokens") if isinstance(doc, dict) else None
        if isinstance(tokens, list) and all(isinstance(i, int) for i in tokens):
            return tokens
        return None

    def _finalize_later(self, call: _Call, tokens: asyncio.Task[list[int] | None]) -> None:
        task = asyncio.create_task(self._finalize(call, tokens))
        self._finalizers.add(task)
        task.add_done_callback(self._finalizers.discard)

    async def _finalize(self, call: _Call, tokens: asyncio.Task[list[int] | None]) -> None:
        record: dict[str, Any] | None = None
        try:
            try:
                ids = await tokens
            except asyncio.CancelledError:
                me = asyncio.current_task()
                if me is not None and me.cancelling():
                    raise  # we are being cancelled, not just the tokenizing
                ids = None
            record = self._record(call, ids)
        finally:
            self._writer.finish(call.seq, record)

    def _record(self, call: _Call, ids: list[int] | None) -> dict[str, Any] | None:
        assert call.usage is not None
        input_tokens, output_tokens = call.usage
        if input_tokens < 1 or output_tokens < 1:
            self.stats.unusable += 1
            return None
        record: dict[str, Any] = {
            "t": round(call.t, 6),
            "input_tokens": input_tokens,
            "output_tokens": output_tokens,
        }
        if ids is not None and len(ids) == input_tokens:
            record["hash_ids"] = self._hasher.ids(ids)
        else:
            self.stats.untokenized += 1
            if ids is not None:
                log.warning("tokenize_mismatch", api=call.api, tokenized=len(ids), usage=input_tokens)
        if call.session:
            record["session"] = call.session
            record["turn"] = call.turn
        sampling = sampling_of(call.body)
        if sampling:
            record["sampling"] = sampling
        record["api"] = call.api
        if self._record_prompts:
            prompt = call.body.get("prompt") if call.api == "completions" else call.body.get("messages")
            if isinstance(prompt, str | list):
                record["prompt"] = prompt
        return record


async def serve_recorder(
    listen_host: str,
    listen_port: int,
    upstream: str,
    out: Path,
    *,
    block_size: int = 16,
    record_prompts: bool = False,
    allow_remote: bool = False,
    stop: asyncio.Event | None = None,
    ready: Callable[[int], None] | None = None,
    drain_timeout_s: float = 30.0,
) -> RecorderStats:
    """Proxy `listen_host:listen_port` to `upstream`, recording into `out` until `stop` is set.

    `listen_port` 0 picks a free port; `ready` is called with the bound port once clients can connect.
    On stop, requests in flight get `drain_timeout_s` to finish (and be recorded). Refuses to overwrite
    an existing `out`. Prints nothing.
    """
    if block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {block_size}")
    check_listen(listen_host, allow_remote=allow_remote)
    if not upstream.startswith(("http://", "https://")):
        raise UsageError(f"--upstream {upstream!r}: expected an http:// or https:// URL")
    try:
        fh = out.open("x", encoding="utf-8", newline="\n")
    except FileExistsError:
        raise InputError("exists; recording never overwrites a trace", file=out) from None
    except OSError as err:
        raise InputError(f"cannot create: {err.strerror}", file=out) from None
    stats = RecorderStats()
    header = {"format": FORMAT_NAME, "version": VERSION, "block_size": block_size}
    runner: web.AppRunner | None = None
    recorder: Recorder | None = None
    listening = False
    try:
        fh.write(json.dumps(header, separators=(",", ":")) + "\n")
        fh.flush()
        writer = OrderedRecordWriter(fh, stats)
        recorder = Recorder(upstream, writer, stats, block_size=block_size, record_prompts=record_prompts)
        await recorder.open()
        runner = web.AppRunner(recorder.app(), access_log=None, shutdown_timeout=drain_timeout_s)
        await runner.setup()
        site = web.TCPSite(runner, listen_host, listen_port)
        try:
            await site.start()
        except OSError as err:
            raise UsageError(f"--listen {listen_host}:{listen_port}: {err.strerror}") from None
        listening = True
        port = int(runner.addresses[0][1])
        log.info(
            "recorder_listening",
            host=listen_host,
            port=port,
            upstream=redact_url(upstream),
            out=str(out),
            block_size=block_size,
            record_prompts=record_prompts,
        )
        if ready is not None:
            ready(port)
        await (stop or asyncio.Event()).wait()
    finally:
        if runner is not None:
            await runner.cleanup()
        if recorder is not None:
            await recorder.close()
        with contextlib.suppress(OSError):
            fh.flush()
            os.fsync(fh.fileno())
        fh.close()
        if not listening:
            _discard(out)  # it never started: leave no header-only file behind
    log.info("recorder_stopped", **asdict(stats))
    return stats


def _discard(path: Path) -> None:
    path.unlink(missing_ok=True)


def run_recorder(
    listen_host: str,
    listen_port: int,
    upstream: str,
    out: Path,
    *,
    block_size: int = 16,
    record_prompts: bool = False,
    allow_remote: bool = False,
    ready: Callable[[int], None] | None = None,
) -> RecorderStats:
    """`serve_recorder` until SIGINT or SIGTERM."""

    async def main() -> RecorderStats:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        return await serve_recorder(
            listen_host,
            listen_port,
            upstream,
            out,
            block_size=block_size,
            record_prompts=record_prompts,
            allow_remote=allow_remote,
            stop=stop,
            ready=ready,
        )

    return asyncio.run(main())


class _Relay:
    """One streamed answer passed on event by event. With `injected`, the usage-only chunk the proxy
    asked for is dropped, and chunks that finish a choice wait for it, to carry its `system_fingerprint`
    as the server would have put it there without usage."""

    def __init__(self, response: web.StreamResponse, call: _Call, injected: bool) -> None:
        self.response = response
        self.call = call
        self.injected = injected
        self.splitter = EventSplitter()
        self.held: list[dict[str, Any]] = []
        self.done = False
        self.broken = ""

    async def send(self, data: bytes) -> None:
        try:
            await self.response.write(data)
        except ConnectionError as err:
            raise _ClientGone from err

    async def release_held(self, fingerprint: object = None) -> None:
        for obj in self.held:
            if fingerprint is not None and obj.get("system_fingerprint") is None:
                obj["system_fingerprint"] = fingerprint
            await self.send(_sse(obj))
        self.held.clear()

    async def event(self, event: Event) -> None:
        injected = self.injected
        data = event.data.strip() if event.data is not None else b""
        if data == b"[DONE]":
            self.done = True
            await self.release_held()
            await self.send(event.raw)
            return
        obj: dict[str, Any] | None = None
        if b'"usage"' in data or b'"error"' in data or (injected and _maybe_finishing(data)):
            with contextlib.suppress(ValueError):
                parsed = json.loads(data)
                obj = parsed if isinstance(parsed, dict) else None
        if obj is None:
            await self.release_held()
            await self.send(event.raw)
            return
        if "error" in obj:
            self.broken = "stream error"
        usage = _usage(obj)
        if usage is not None:
            self.call.usage = usage
        if injected and usage is not None and obj.get("choices") == []:
            await self.release_held(obj.get("system_fingerprint"))
            return  # the usage chunk only the proxy asked for
        rewritten = injected and "usage" in obj
        if rewritten:
            del obj["usage"]
        if injected and _finishing(obj):
            self.held.append(obj)
            return
        await self.release_held()
        await self.send(_sse(obj) if rewritten else event.raw)
