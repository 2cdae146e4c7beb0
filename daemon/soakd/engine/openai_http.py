"""The OpenAI-compatible HTTP adapter: a running server (vLLM's api_server) driven with token-id prompts.

soakd does not own the server here: it waits for it to answer, learns the model, context length and
token id range from its endpoints, and streams /v1/completions with exact output lengths. A request the
server refuses is a recorded failure; a server that no longer accepts connections ends the soak.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import structlog

from soakd.clock import SystemClock
from soakd.config import MAX_MODEL_LEN, MAX_VOCAB, EngineConfig
from soakd.engine.base import EngineInfo, GenerationRequest
from soakd.engine.completions import (
    BODY_CHARS,
    CONTROL_TIMEOUT,
    ERROR_CHARS,
    RequestError,
    SendFigures,
    SendTrace,
    ServerGone,
    error_message,
    error_of,
    open_connections,
    send_trace_config,
    stream_completion,
)
from soakd.engine.sender import SenderProcess, Senders, stream_via, take_final
from soakd.engine.stats import StepStats
from soakd.engine.vllm_local import config_id
from soakd.errors import EngineError
from soakd.redact import redact_url

_ENCODE = msgspec.json.Encoder().encode

log = structlog.get_logger(__name__)

StepSink = Callable[[StepStats], None]
SendHook = Callable[[GenerationRequest], None]

_HEALTH_POLL_S = 0.5
_HEALTH_LOG_EVERY_S = 30.0
# Used when the server does not reveal its token id range: every byte-level BPE and byte-fallback
# SentencePiece vocabulary has at least this many ids, so prompts stay valid (if less varied).
FALLBACK_VOCAB = 256
# Ids probed up to this bound; a server accepting even this one does not check ids at all.
_PROBE_LIMIT = MAX_VOCAB
_SYSTEM_CLOCK = SystemClock()


def base_url(url: str) -> str:
    """The server root: trailing slashes and an OpenAI-style `/v1` suffix removed."""
    text = url.strip().rstrip("/")
    return text[: -len("/v1")] if text.endswith("/v1") else text


class OpenAIEngine:
    """A running OpenAI-compatible server, reached over one shared HTTP connection pool."""

    def __init__(
        self,
        cfg: EngineConfig,
        on_step: StepSink | None = None,
        *,
        max_connections: int = 0,
    ) -> None:
        self._cfg = cfg
        self._on_step = on_step  # attach mode: no per-step stats (the server has no soakd plugin)
        self._dead = False
        self._url = base_url(cfg.url)
        # 0: no pool limit, so the pool never becomes a second, hidden concurrency ceiling behind
        # soakd's own admission gate.
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._headers: dict[str, str] = {}
        self._senders: Senders | None = None
        self._sends = SendFigures()
        self._probes = 0  # completions sent to find the vocabulary (not the trace's)
        self._info: EngineInfo | None = None
        self._model = ""
        self.on_send: SendHook | None = None
        """Called as each completion request is issued from soakd's loop, or handed to the sender
        process (up to its lead before it is sent)."""
        self.vocab_hint: Callable[[], int | None] | None = None
        """Where the vocabulary size is known without probing (a server soakd launched tells it)."""

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineError("engine not started")
        return self._info

    async def start(self) -> None:
        if not self._url:
            raise EngineError("engine.url is empty: the OpenAI-compatible server's base URL is needed")
        shown = redact_url(self._url)
        headers = {"Accept": "application/json"}
        key = os.environ.get(self._cfg.api_key_env, "") if self._cfg.api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._headers = headers
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=0),
            headers=headers,
            # No total limit: a long generation under load is a result, not a hang. A stuck request is
            # cut by the replay's drain timeout.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
            trace_configs=[send_trace_config()],
        )
        t0 = time.monotonic()
        try:
            await self._wait_healthy(shown, t0 + self._cfg.start_timeout)
            self._info = await self._discover(shown, time.monotonic() - t0)
            if self._cfg.sender == "process":
                self._senders = Senders(
                    self._url,
                    self._headers,
                    self._max_connections,
                    self._cfg.senders,
                    self._cfg.api_key_env,
                    nice=self._cfg.sender_nice,
                    reader=self._cfg.sender_reader,
                )
                await self._senders.start()
                refused = self._senders.slots[0].nice_error
                if refused:
                    # Not a failure: the sender runs at soakd's own priority, and the summary says so.
                    log.warning("sender_nice_refused", wanted=self._cfg.sender_nice, error=refused[:200])
        except BaseException:
            await self.stop()
            raise
        info = self._info
        log.info(
            "engine_started",
            url=shown,
            model=info.model,
            version=info.version,
            max_model_len=info.max_model_len,
            vocab_size=info.vocab_size,
            vocab_source=info.details.get("vocab_source", ""),
            start_s=round(info.start_s, 2),
        )

    async def _wait_healthy(self, shown: str, deadline: float) -> None:
        session = self._require_session()
        next_log = time.monotonic()
        while True:
            now = time.monotonic()
            try:
                timeout = aiohttp.ClientTimeout(total=max(0.5, min(5.0, deadline - now)))
                async with session.get(self._url + "/health", timeout=timeout) as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as err:
                last = f"{type(err).__name__}: {err}"[:ERROR_CHARS] if str(err) else type(err).__name__
            if now >= next_log:
                log.info("engine_waiting", url=shown, last=last)
                next_log = now + _HEALTH_LOG_EVERY_S
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EngineError(
                    f"server at {shown} not healthy within {self._cfg.start_timeout:.0f} s (last: {last})"
                )
            await asyncio.sleep(min(_HEALTH_POLL_S, remaining))

    async def _discover(self, shown: str, health_s: float) -> EngineInfo:
        details: dict[str, str] = {"url": shown}
        models = await self._get_json("/v1/models", required=True)
        cards = [c for c in (models or {}).get("data", []) if isinstance(c, dict) and "id" in c]
        if not cards:
            raise EngineError(f"server at {shown} lists no models at /v1/models")
        wanted = self._cfg.served_model
        card = next((c for c in cards if c["id"] == wanted), None) if wanted else cards[0]
        if card is None:
            names = ", ".join(str(c["id"]) for c in cards)[:200]
            raise EngineError(f"server at {shown} does not serve {wanted!r} (it serves: {names})")
        self._model = str(card["id"])
        max_len = card.get("max_model_len")
        if isinstance(max_len, int) and 0 < max_len <= MAX_MODEL_LEN:
            details["max_model_len_source"] = "/v1/models"
        else:
            if max_len is not None:  # a context no model has: prompts would be sized by it
                log.warning("max_model_len_implausible", reported=str(max_len)[:40], limit=MAX_MODEL_LEN)
            max_len = self._cfg.max_model_len
            details["max_model_len_source"] = "engine.max_model_len (the server does not say)"
        version_doc = await self._get_json("/version")
        version = str((version_doc or {}).get("version", "unknown"))
        vocab, reserved = await self._vocabulary(details, is_vllm=version_doc is not None)
        return EngineInfo(
            kind="openai",
            version=version,
            model=self._model,
            config_id=config_id({"kind": "openai", "url": shown, "model": self._model, "version": version}),
            vocab_size=vocab,
            reserved_ids=reserved,
            max_model_len=int(max_len),
            start_s=health_s,
            details=details,
            signals=("metrics",),
            sends_at=self._cfg.sender == "process",
        )

    async def _vocabulary(self, details: dict[str, str], *, is_vllm: bool) -> tuple[int, tuple[int, ...]]:
        """The token id range prompts are drawn from, and the special ids to leave out.

        vLLM 0.32 exposes no vocabulary size: /tokenizer_info (only with
        --enable-tokenizer-info-endpoint) gives the tokenizer's init settings and its added (special)
        tokens, /tokenize gives ids of a text and max_model_len. It does reject a prompt id beyond the
        vocabulary with a 400 ("Token id N is out of vocabulary"), so the range is found by bisection
        on one-token, one-output-token completions (about 2 log2(vocab) of them).
        """
        reserved: tuple[int, ...] = ()
        info = await self._get_json("/tokenizer_info")
        vocab: int | None = None
        hint = self.vocab_hint() if self.vocab_hint is not None else None
        if self._cfg.vocab_size or hint:
            # Known without asking: probing sends ids past the model's embedding when its tokenizer is
            # larger, and vLLM 0.26 then fails a device-side assert and the engine core dies.
            vocab = self._cfg.vocab_size or hint
            details["vocab_source"] = (
                "engine.vocab_size" if self._cfg.vocab_size else "the engine's model config"
            )
        if info is not None:
            added = info.get("added_tokens_decoder")
            if isinstance(added, dict):
                reserved = tuple(sorted(int(k) for k in added if str(k).isdigit()))
            declared = info.get("vocab_size")
            if vocab is None and isinstance(declared, int) and 0 < declared <= MAX_VOCAB:
                vocab = declared
                details["vocab_source"] = "/tokenizer_info"
            elif vocab is None and declared is not None:
                # Not a tokenizer's (the largest are ~260k): prompts drawn from it would be refused,
                # or sized by it. Found by probing instead, as for a server that says nothing.
                log.warning("vocab_implausible", declared=str(declared)[:40], limit=MAX_VOCAB)
            details["reserved_ids_source"] = "/tokenizer_info added tokens"
        else:
            details["reserved_ids_source"] = (
                "unknown: special tokens may appear in prompts (start vLLM with "
                "--enable-tokenizer-info-endpoint to exclude them)"
            )
        if vocab is None and is_vllm:
            try:
                vocab = await self._probe_vocab()
            except (RequestError, aiohttp.ClientError, TimeoutError) as err:
                log.warning("vocab_probe_failed", error=str(err)[:ERROR_CHARS])
                vocab = None
            if vocab is not None:
                details["vocab_source"] = "probe: highest prompt token id the server accepts, + 1"
        if vocab is None:
            vocab = FALLBACK_VOCAB
            details["vocab_source"] = (
                f"fallback: the server does not say, prompts use ids below {FALLBACK_VOCAB} only"
            )
            log.warning("vocab_unknown", fallback=FALLBACK_VOCAB)
        return vocab, reserved

    async def _probe_vocab(self) -> int | None:
        """Bisect for the smallest id the server refuses; None when it refuses none or answers otherwise."""
        if not await self._accepts(0):
            return None
        good, bad = 0, 0
        probe = 1024
        while probe <= _PROBE_LIMIT:
            if not await self._accepts(probe - 1):
                bad = probe - 1
                break
            good = probe - 1
            probe *= 2
        if not bad:
            return None
        while bad - good > 1:
            mid = (good + bad) // 2
            if await self._accepts(mid):
                good = mid
            else:
                bad = mid
        return bad

    async def _accepts(self, token_id: int) -> bool:
        session = self._require_session()
        self._probes += 1
        body = {"model": self._model, "prompt": [token_id], "max_tokens": 1, "temperature": 0.0}
        async with session.post(self._url + "/v1/completions", json=body, timeout=CONTROL_TIMEOUT) as resp:
            if resp.status == 200:
                await resp.read()
                return True
            text = await resp.text(errors="replace")
            if resp.status == 400 and "vocabulary" in text:
                return False
            raise RequestError(error_message(resp.status, text[:BODY_CHARS]))

    async def _get_json(self, path: str, *, required: bool = False) -> dict[str, Any] | None:
        """A control endpoint's JSON object; None when the server does not have it (unless required)."""
        session = self._require_session()
        try:
            async with session.get(self._url + path, timeout=CONTROL_TIMEOUT) as resp:
                if resp.status != 200:
                    if required:
                        text = (await resp.content.read(BODY_CHARS)).decode("utf-8", errors="replace")
                        raise EngineError(f"GET {path}: {error_message(resp.status, text)}")
                    return None
                doc = await resp.json(content_type=None)
        except aiohttp.ClientConnectorError as err:
            raise EngineError(f"server unreachable: {err}"[:200]) from err
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            if required:
                raise EngineError(f"GET {path}: {type(err).__name__}: {err}"[:200]) from err
            return None
        return doc if isinstance(doc, dict) else None

    def _require_session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise EngineError("engine not started")
        return self._session

    def _body(self, request: GenerationRequest) -> bytes:
        body: dict[str, Any] = {
            "model": self._model,
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_tokens,
            # Output lengths follow the trace: no early stop on EOS.
            "min_tokens": request.max_tokens,
            "ignore_eos": True,
            "temperature": self._cfg.temperature if request.temperature is None else request.temperature,
            "seed": request.seed,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if request.top_p is not None:
            body["top_p"] = request.top_p
        if request.output_ids is not None:
            body["return_token_ids"] = True  # vLLM: each chunk carries its new token ids
        return _ENCODE(body)  # msgspec: ~10x faster than json.dumps on a prompt's ids

    async def generate(self, request: GenerationRequest) -> AsyncIterator[int]:
        if request.stamps is not None:
            # The engine has it from here: a wait before (its restart or rebuild, in the supervisor) is
            # the engine's hold; what follows (the body's encoding, a restart of soakd's own sender
            # process) is soakd's, and counts in the request's lateness.
            request.stamps.handed = time.monotonic()
        session = self._require_session()
        body = self._body(request)
        if self.on_send is not None:
            self.on_send(request)
        try:
            if self._senders is not None:
                async for n in self._through_sender(self._senders, request, body):
                    yield n
                return
            if request.send_at is not None:
                await _SYSTEM_CLOCK.sleep_until(request.send_at)
            trace, sent = SendTrace(), time.monotonic()
            try:
                async for n in stream_completion(
                    session, self._url, body, request.request_id, request.output_ids, request.spec, trace
                ):
                    yield n
            finally:
                self._sends.add(sent, trace.written, trace.new_connection)
        except ServerGone:
            self._dead = True
            raise

    async def _through_sender(
        self, senders: Senders, request: GenerationRequest, body: bytes
    ) -> AsyncIterator[int]:
        sender = await senders.next()
        async for header in stream_via(sender, request, body):
            n = int(header.get("n", 0))
            if n:
                yield n  # a failed request's last tokens count too, as in the loop's path
            if header.get("final"):
                take_final(header, request)
                if (stamps := request.stamps) is not None:
                    self._sends.add(stamps.sent, stamps.written, stamps.new_connection)
                error = header.get("error")
                if isinstance(error, dict):
                    raise error_of(error)

    def process_ids(self) -> list[int]:
        return []  # the server is not a process of ours

    def alive(self) -> bool:
        return self._session is not None and not self._dead

    async def memory_stats(self) -> list[Any]:
        raise EngineError("an attached server has no soakd worker extension")

    async def metrics_text(self) -> str:
        session = self._require_session()
        try:
            async with session.get(self._url + "/metrics", timeout=CONTROL_TIMEOUT) as resp:
                text = await resp.text(errors="replace")
                if resp.status != 200:
                    raise EngineError(f"GET /metrics: {error_message(resp.status, text[:BODY_CHARS])}")
                return text
        except (aiohttp.ClientError, TimeoutError) as err:
            raise EngineError(f"GET /metrics: {type(err).__name__}: {err}"[:200]) from err

    async def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST a control endpoint (e.g. a dev-mode server's /collective_rpc) and return its JSON."""
        session = self._require_session()
        # Connection: close. After an error answer vLLM's dev routes re-raise and uvicorn drops the
        # connection, which aiohttp may already have pooled: the next request (a completion) would fail.
        headers = {"Connection": "close"}
        try:
            async with session.post(
                self._url + path, json=body, timeout=CONTROL_TIMEOUT, headers=headers
            ) as resp:
                text = await resp.text(errors="replace")
                if resp.status != 200:
                    raise EngineError(f"POST {path}: {error_message(resp.status, text[:BODY_CHARS])}")
                return json.loads(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            raise EngineError(f"POST {path}: {type(err).__name__}: {err}"[:200]) from err

    @property
    def senders(self) -> list[SenderProcess]:
        """The sender processes now (a restarted one replaces its slot)."""
        return list(self._senders.slots) if self._senders is not None else []

    @property
    def sender_pid(self) -> int | None:
        """The first sender process's pid (soakd's own process, not the engine's); None without one."""
        return self.senders[0].pid if self.senders else None

    async def prepare_replay(self, concurrency: int) -> None:
        # The figures are the replay's: warm-up requests (before this) opened connections of their own.
        self._sends = SendFigures()
        n = max(0, min(concurrency, self._cfg.warm_connections))
        if n == 0:
            return
        try:
            if self._senders is not None:
                opened = await self._senders.warm(n)
            else:
                opened = await open_connections(self._require_session(), self._url, n)
        # Opening connections ahead is an optimisation: its failure (a session closed by a restart, a
        # sender that will not start) never ends a soak; the replay opens them as it goes.
        except Exception as err:  # noqa: BLE001
            log.warning("warm_connections_failed", error=f"{type(err).__name__}: {err}"[:200])
            return
        self._sends.warmed = opened
        log.info("connections_warmed", wanted=n, opened=opened)

    def telemetry_summary(self) -> dict[str, object]:
        restarts = self._senders.restarts if self._senders is not None else 0
        out: dict[str, object] = {"sender_restarts": restarts} if restarts else {}
        if self.senders and self.senders[0].loop_kind:
            out["sender_loop"] = self.senders[0].loop_kind
            out["senders"] = len(self.senders)
            if self.senders[0].nice is not None:
                out["sender_nice"] = self.senders[0].nice
            if self.senders[0].reader:
                out["sender_reader"] = self.senders[0].reader
            if self.senders[0].reader_note:
                out["sender_reader_note"] = self.senders[0].reader_note
        if self._sends.requests or self._sends.warmed:
            out["sends"] = self._sends.summary()
        if self._probes:
            out["vocab_probe_requests"] = self._probes
        return out

    async def stop(self) -> None:
        if self._senders is not None:
            await self._senders.stop()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()
