"""OpenAIEngine against a real vLLM api_server (CPU build, tiny model): discovery, exact streamed token
counts, TTFT through the replay runner, a refused request recorded as an error, cancellation that
aborts the request in the server, and EngineError once the server is gone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from servers import Server, free_port

from soakd.clock import SystemClock
from soakd.config import EngineConfig
from soakd.engine import native
from soakd.engine.base import GenerationRequest, Stamps
from soakd.engine.completions import RequestError
from soakd.engine.openai_http import OpenAIEngine
from soakd.errors import EngineError
from soakd.replay.admission import AdmissionGate
from soakd.replay.pacer import schedule
from soakd.replay.prompts import PromptSynth
from soakd.replay.runner import Replayer, RequestRecord
from soakd.traces.model import RequestSpec

pytestmark = pytest.mark.integration


def engine_cfg(url: str, **kw: object) -> EngineConfig:
    return EngineConfig.model_validate({"kind": "openai", "url": url, "start_timeout": 60.0, **kw})


@contextlib.asynccontextmanager
async def started(url: str, **kw: object) -> AsyncIterator[OpenAIEngine]:
    engine = OpenAIEngine(engine_cfg(url, **kw))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def collect(engine: OpenAIEngine, request: GenerationRequest) -> list[tuple[float, int]]:
    """(arrival time, tokens) of each streamed delta."""
    return [(time.monotonic(), n) async for n in engine.generate(request)]


def metric(server: Server, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include `labels`."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if not match:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_check_in_attach_mode_names_what_the_server_serves(vllm_server: Server, tmp_path: Path) -> None:
    import subprocess
    import sys

    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[engine]\nkind = "openai"\nurl = "{vllm_server.url}"\n', encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "soakd", "check", "--config", str(cfg), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    engine = {c["name"]: c for c in json.loads(done.stdout)}["engine"]
    assert engine["ok"] and engine["detail"] == f"{vllm_server.url} serves tiny (0.32.0, max_model_len 2048)"
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


async def test_discovers_the_server(vllm_server: Server, tiny_model: Path) -> None:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    async with started(vllm_server.url + "/v1/") as engine:
        info = engine.info
        assert info.kind == "openai"
        assert info.version == "0.32.0"
        assert info.model == "tiny"
        assert info.max_model_len == 2048
        assert info.vocab_size == vocab
        assert info.details["vocab_source"].startswith("probe")
        # Said in the run's summary: completions the server got that are not the trace's (id 0, doubling
        # bounds until one is refused, a bisection between the last two: about 2 log2(vocab)).
        probes = engine.telemetry_summary()["vocab_probe_requests"]
        assert isinstance(probes, int) and vocab.bit_length() <= probes <= 2 * vocab.bit_length() + 2
        assert 0 in info.reserved_ids  # <|endoftext|>, from /tokenizer_info
        assert engine.process_ids() == []
        assert info.details["url"] == vllm_server.url


async def test_unknown_served_model_is_an_engine_error(vllm_server: Server) -> None:
    engine = OpenAIEngine(engine_cfg(vllm_server.url, served_model="nope"))
    with pytest.raises(EngineError, match="does not serve 'nope'"):
        await engine.start()


def sender_kw(sender: str) -> dict[str, object]:
    """The engine's sender settings for a test's parameter: "loop", "process" (the stream reader soakd
    takes where it is built: native) or "process-python" (the Python reader)."""
    if sender == "process-python":
        return {"sender": "process", "sender_reader": "python"}
    return {"sender": sender}


def assert_reader(engine: OpenAIEngine, sender: str) -> None:
    want = {"loop": None, "process-python": "python"}.get(
        sender, "native" if native.available() else "python"
    )
    assert engine.telemetry_summary().get("sender_reader") == want


@pytest.mark.parametrize("sender", ["loop", "process", "process-python"])
async def test_streams_exact_token_counts(vllm_server: Server, sender: str) -> None:
    async with started(vllm_server.url, **sender_kw(sender)) as engine:
        assert engine.info.sends_at == sender.startswith("process")
        assert_reader(engine, sender)
        lengths = [1, 7, 64, 300]
        requests = [
            GenerationRequest(f"exact-{n}", list(range(1, 100 + n)), max_tokens=n, seed=n, stamps=Stamps())
            for n in lengths
        ]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
    for n, deltas in zip(lengths, results, strict=True):
        assert sum(k for _, k in deltas) == n
        assert all(k >= 1 for _, k in deltas)
    stamps = requests[3].stamps
    assert stamps is not None
    if sender == "loop":
        assert stamps.sent is None  # the caller times a stream read in its own loop
        # Streamed as generated, not buffered into one answer.
        assert len(results[3]) > 10
        assert results[3][-1][0] - results[3][0][0] > 0
    else:
        # The sender reads the stream and stamps each delta; it reports tokens at most twice a second.
        assert stamps.sent is not None and stamps.first is not None and stamps.last is not None
        assert stamps.deltas > 10 and stamps.sent < stamps.first <= stamps.last
        # A reader held off the CPU (a busy machine) can find the whole answer waiting and read it in one
        # read: one kernel stamp for all of it (first == last, no gaps); otherwise the gaps are its span.
        assert 0 <= stamps.gaps <= stamps.last - stamps.first + 1e-9
        assert (stamps.gaps > 0) == (stamps.last > stamps.first)


async def test_the_sender_sends_at_the_given_time(vllm_server: Server) -> None:
    async def sent_at(at: float) -> float:
        request = GenerationRequest("at", [5, 6, 7], max_tokens=3, send_at=at, stamps=Stamps())
        assert sum(n for _, n in await collect(engine, request)) == 3
        assert request.stamps is not None and request.stamps.sent is not None
        return request.stamps.sent

    async with started(vllm_server.url) as engine:
        for delay in (0.05, 0.3):
            # How late this machine sends a request that is due at once, measured alongside: the frame
            # to the sender and its wake-up (a busy machine's scheduling).
            now = time.monotonic()
            reference = await sent_at(now) - now
            at = time.monotonic() + delay
            sent = await sent_at(at)
            # Not before its time; late by no more than that scheduling (and 50 ms), not by a poll.
            assert at <= sent < at + 0.05 + 2 * reference, (sent - at, reference)


async def test_a_sender_that_died_fails_its_requests_and_is_restarted(vllm_server: Server) -> None:
    async with started(vllm_server.url) as engine:
        pid = engine.sender_pid
        assert pid is not None
        request = GenerationRequest("doomed", list(range(1, 20)), max_tokens=1500)
        # Killed once its stream has begun, not at a fixed time: a quiet machine generated all 1,500
        # tokens within half a second.
        with pytest.raises(RequestError, match="sender process exited"):
            async for _ in engine.generate(request):
                os.kill(pid, signal.SIGKILL)
        # The next request waits for the new sender: soakd's own wait, counted from its hand-over to the
        # engine (its lateness), not as the engine's hold.
        began = time.monotonic()
        after = GenerationRequest("after", [1, 2, 3], max_tokens=4, send_at=began, stamps=Stamps())
        deltas = await collect(engine, after)
        assert sum(n for _, n in deltas) == 4
        assert after.stamps is not None and after.stamps.handed is not None and after.stamps.sent is not None
        assert after.stamps.handed - began < (after.stamps.sent - began) / 4
        assert engine.sender_pid not in (None, pid)
        assert engine.telemetry_summary()["sender_restarts"] == 1


async def test_reports_output_ids_and_takes_recorded_sampling(vllm_server: Server) -> None:
    async with started(vllm_server.url) as engine:
        greedy: list[list[int]] = [[], []]
        for ids in greedy:
            request = GenerationRequest(
                "ids", [11, 12, 13, 14], max_tokens=20, temperature=0.0, output_ids=ids
            )
            assert sum(n for _, n in await collect(engine, request)) == 20
        sampled: list[int] = []
        request = GenerationRequest(
            "hot", [11, 12, 13, 14], 20, seed=5, temperature=1.5, top_p=0.5, output_ids=sampled
        )
        await collect(engine, request)
    assert len(greedy[0]) == 20 and greedy[0] == greedy[1]
    assert len(sampled) == 20 and all(0 <= i < engine.info.vocab_size for i in sampled)


async def test_replay_through_the_runner_records_ttft(vllm_server: Server) -> None:
    """The runner drives the engine as in a soak: every request completes with TTFT <= E2E."""
    specs = [
        RequestSpec(
            index=i, arrival_s=i * 0.1, input_tokens=100 + 50 * i, output_tokens=8 + 4 * i, block_size=64
        )
        for i in range(6)
    ]
    # One request asks for more than the server's context: the server refuses it, the replay goes on.
    specs.append(RequestSpec(index=6, arrival_s=0.65, input_tokens=2100, output_tokens=8, block_size=64))
    records: list[RequestRecord] = []
    async with started(vllm_server.url) as engine:
        info = engine.info
        replayer = Replayer(
            engine,
            schedule(specs, span_s=0.65, requests=len(specs), speed=1.0, duration_s=10.0, loop=False),
            PromptSynth(info.vocab_size, 0, info.reserved_ids),
            AdmissionGate(8),
            SystemClock(),
            records.append,
            run_tag="t",
            max_pending=100,
            # Larger than the server's context, so the long prompt is sent unclipped.
            max_model_len=4096,
            drain_timeout_s=60.0,
        )
        stats = await replayer.run()
    assert not replayer.fatal
    by_index = {r.index: r for r in records}
    assert stats.completed == 6 and stats.failed == 1
    for i in range(6):
        r = by_index[i]
        assert r.ok, r.error
        assert r.output_tokens == r.output_tokens_expected == 8 + 4 * i
        assert r.ttft_s is not None and r.e2e_s is not None
        assert 0 < r.ttft_s <= r.e2e_s
    refused = by_index[6]
    assert refused.error.startswith("engine: RequestError: HTTP 400")
    assert "maximum context length" in refused.error
    assert refused.output_tokens == 0


async def test_refused_request_raises_request_error_without_the_prompt(vllm_server: Server) -> None:
    prompt = [7] * 2100
    async with started(vllm_server.url) as engine:
        with pytest.raises(RequestError) as caught:
            await collect(engine, GenerationRequest("long", prompt, max_tokens=4))
    message = str(caught.value)
    assert message.startswith("HTTP 400:")
    assert "7, 7" not in message and len(message) < 200


@pytest.mark.parametrize("sender", ["loop", "process", "process-python"])
async def test_cancelling_the_consumer_aborts_the_request_in_the_server(
    vllm_server: Server, sender: str
) -> None:
    asked = 1900
    got_tokens = asyncio.Event()

    async def consume(engine: OpenAIEngine) -> None:
        async for _ in engine.generate(GenerationRequest("cancel-me", list(range(1, 20)), max_tokens=asked)):
            got_tokens.set()

    async with started(vllm_server.url, **sender_kw(sender)) as engine:
        assert_reader(engine, sender)
        # After start: it sends a few one-token requests of its own.
        generated_before = metric(vllm_server, "vllm:generation_tokens_total")
        finished_before = metric(vllm_server, "vllm:request_success_total")
        task = asyncio.create_task(consume(engine))
        await asyncio.wait_for(got_tokens.wait(), timeout=30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Scraping /metrics while the server streams can hold its event loop up (seen on two cores), so
        # the first scrape waits a moment; the request would run for seconds more if not aborted.
        await asyncio.sleep(1.0)
        # A hang guard: the proof is the token count below (short of what was asked; a request left
        # running ends with all of it, in a few seconds even on a busy machine).
        deadline = time.monotonic() + 60
        while metric(vllm_server, "vllm:num_requests_running") != 0:
            assert time.monotonic() < deadline, "the server kept generating after the client left"
            await asyncio.sleep(0.1)
    # Stopped short of what was asked, and not counted as a finished request.
    assert metric(vllm_server, "vllm:generation_tokens_total") - generated_before < asked
    assert metric(vllm_server, "vllm:request_success_total") == finished_before


async def test_no_server_is_an_engine_error_at_start() -> None:
    engine = OpenAIEngine(engine_cfg(f"http://127.0.0.1:{free_port()}", start_timeout=2.0))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="not healthy within 2 s"):
        await engine.start()
    assert time.monotonic() - t0 < 10


class Relay:
    """A TCP relay to the server that can be shut, as if the server had died."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0
        self.accepted = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream_port)
        self._writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def shut(self) -> None:
        assert self._server is not None
        self._server.close()
        for w in self._writers:
            w.close()
        await self._server.wait_closed()


@pytest.mark.parametrize("sender", ["loop", "process"])
async def test_server_gone_after_start_is_an_engine_error(vllm_server: Server, sender: str) -> None:
    relay = Relay(vllm_server.ports["http"])
    await relay.start()
    async with started(f"http://127.0.0.1:{relay.port}", sender=sender) as engine:
        deltas = await collect(engine, GenerationRequest("before", [1, 2, 3], max_tokens=4))
        assert sum(n for _, n in deltas) == 4
        await relay.shut()
        with pytest.raises(EngineError, match="server unreachable"):
            # The pooled connection breaks first; a fresh one is refused.
            await collect(engine, GenerationRequest("after", [1, 2, 3], max_tokens=4))
        assert not engine.alive()  # the soak ends: every later request would fail the same way


@pytest.mark.parametrize("warm", [False, True])
async def test_connections_opened_before_the_replay_serve_its_first_burst(
    vllm_server: Server, warm: bool
) -> None:
    """prepare_replay opens the pool's connections; a burst then opens none and its requests' bytes
    leave as soon as the sender takes them. Without it, each concurrent request beyond the pool opens
    one (and says so)."""
    relay = Relay(vllm_server.ports["http"])
    await relay.start()
    async with started(f"http://127.0.0.1:{relay.port}") as engine:
        if warm:
            await engine.prepare_replay(6)
        accepted = relay.accepted
        requests = [
            GenerationRequest(f"burst-{i}", [1, 2, 3, i + 4], max_tokens=8, stamps=Stamps()) for i in range(6)
        ]
        results = await asyncio.gather(*(collect(engine, r) for r in requests))
        summary = engine.telemetry_summary()["sends"]
    await relay.shut()
    assert all(sum(n for _, n in deltas) == 8 for deltas in results)
    stamps = [r.stamps for r in requests if r.stamps is not None]
    assert all(s.sent is not None and s.written is not None and s.sent <= s.written for s in stamps)
    opened = sum(s.new_connection for s in stamps)
    assert isinstance(summary, dict) and summary["requests"] == 6
    assert summary["connections_opened"] == opened == relay.accepted - accepted
    if warm:
        assert summary["connections_warmed"] == 6 and opened == 0
    else:
        # The sender's start left at most one connection pooled: the other five opened their own.
        assert summary["connections_warmed"] == 0 and opened >= 5
