"""The sender's HTTP/1.1 client (engine/h1.py) against a scripted server on loopback: every body framing
read whatever the network's chunking, keep-alive reuse and its limits, stale connections never reused,
spare connections kept open ahead of demand, broken answers reported; and the per-delta shortcuts it
feeds (the data-only event splitter, the token count read without a JSON parse) agree with the full
parse on every input."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from soakd.config import EngineConfig
from soakd.engine.base import GenerationRequest, SpecSteps, Stamps
from soakd.engine.completions import RequestError, new_tokens, usage_tokens
from soakd.engine.h1 import Collect, ConnectError, Pool, ProtocolError, Target, request_head
from soakd.engine.openai_http import OpenAIEngine
from soakd.engine.sender import SenderProcess, stream_via, take_final
from soakd.sse import DataSplitter, EventSplitter

Answer = Callable[[int, int], list[bytes]]
"""(connection number, request number on it) -> the answer's bytes, written piece by piece."""


@dataclass
class Script:
    answer: Answer
    connections: int = 0
    requests: list[tuple[int, bytes]] = field(default_factory=list)
    close_after: set[tuple[int, int]] = field(default_factory=set)
    """(connection, request) pairs after which the server closes the connection."""
    drop_before: set[tuple[int, int]] = field(default_factory=set)
    """(connection, request) pairs the server closes on without answering."""


@pytest.fixture
async def server() -> AsyncIterator[tuple[Script, str]]:
    script = Script(answer=lambda c, r: [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"])

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        script.connections += 1
        conn = script.connections
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                if length:
                    await reader.readexactly(length)
                n += 1
                script.requests.append((conn, head.split(b"\r\n")[0]))
                if (conn, n) in script.drop_before:
                    return
                for piece in script.answer(conn, n):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                if (conn, n) in script.close_after:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield script, f"http://127.0.0.1:{port}"
    finally:
        srv.close()
        await srv.wait_closed()


async def fetch(pool: Pool, path: str = "/x") -> tuple[Collect, bool]:
    conn, new = await pool.acquire()
    sink = Collect()
    conn.send(request_head(pool.target, "GET", path, {}, 0), b"", sink)
    await sink.done
    return sink, new


def pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


SSE = (
    b"".join(
        b"%x\r\n%s\r\n" % (len(p), p)
        for p in (
            b'data: {"usage":{"completion_tokens":1}}\n\n',
            b'data: {"usage":{"completion_tokens":3}}\n\n',
        )
    )
    + b"0\r\n\r\n"
)
HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"


@pytest.mark.parametrize("size", [1, 2, 5, 17, 1000])
async def test_a_chunked_stream_is_read_whatever_the_network_chunking(
    server: tuple[Script, str], size: int
) -> None:
    script, url = server
    script.answer = lambda c, r: pieces(HEAD + SSE, size)
    pool = Pool(Target(url))
    first, new1 = await fetch(pool)
    second, new2 = await fetch(pool)
    expected = b'data: {"usage":{"completion_tokens":1}}\n\ndata: {"usage":{"completion_tokens":3}}\n\n'
    assert first.status == second.status == 200
    assert first.body == second.body == expected
    # The answer's end put the connection back: the second request reused it.
    assert (new1, new2) == (True, False) and script.connections == 1
    await pool.close()


async def test_content_length_until_close_and_interim_answers(server: tuple[Script, str]) -> None:
    script, url = server
    answers = {
        1: [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel", b"lo"],
        2: [b"HTTP/1.1 503 Busy\r\ncontent-length: 4\r\nconnection: close\r\n\r\nbusy"],
        3: [b"HTTP/1.0 200 OK\r\n\r\nuntil", b" close"],
    }
    script.answer = lambda c, r: answers[len(script.requests)]
    script.close_after = {(2, 1)}  # the HTTP/1.0 answer ends when the server closes
    pool = Pool(Target(url))
    got = [await fetch(pool) for _ in range(3)]
    assert [(s.status, s.body) for s, _ in got] == [(200, b"hello"), (503, b"busy"), (200, b"until close")]
    # The first connection served two (kept alive after the interim answer); `connection: close` ended it.
    assert [new for _, new in got] == [True, False, True] and script.connections == 2
    await pool.close()


async def test_an_answer_cut_short_or_malformed_is_a_protocol_error(server: tuple[Script, str]) -> None:
    script, url = server
    answers = {
        1: [HEAD + b"40\r\ndata: cut"],  # announces 64 bytes, closes after 9
        2: [HEAD + b"zz\r\n"],  # not a chunk size
        3: [b"SPDY/3 200 OK\r\n\r\n"],
    }
    script.answer = lambda c, r: answers[len(script.requests)]
    script.close_after = {(1, 1)}
    pool = Pool(Target(url))
    for _ in answers:
        with pytest.raises(ProtocolError):
            await fetch(pool)
    await pool.close()


async def test_a_stale_idle_connection_is_closed_not_reused(server: tuple[Script, str]) -> None:
    script, url = server
    pool = Pool(Target(url), idle_s=0.05)
    _, new1 = await fetch(pool)
    await asyncio.sleep(0.1)  # past idle_s whatever the machine's load: a sleep never ends early
    _, new2 = await fetch(pool)
    assert (new1, new2) == (True, True) and script.connections == 2
    await pool.close()


async def test_the_limit_makes_a_request_wait_for_a_connection(server: tuple[Script, str]) -> None:
    script, url = server
    pool = Pool(Target(url), limit=1)
    conn, _ = await pool.acquire()
    waiting = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.05)
    assert not waiting.done()  # the one connection is taken
    sink = Collect()
    conn.send(request_head(pool.target, "GET", "/x", {}, 0), b"", sink)
    await sink.done
    again, new = await asyncio.wait_for(waiting, 5)
    assert again is conn and not new and script.connections == 1
    await pool.close()


async def test_spare_connections_are_kept_open_and_replaced_when_stale(server: tuple[Script, str]) -> None:
    script, url = server
    pool = Pool(Target(url), idle_s=2.0)
    pool.keep_spare(3)
    for _ in range(200):
        if script.connections >= 3:
            break
        await asyncio.sleep(0.02)
    assert script.connections == 3
    # A burst of three finds them open.
    got = await asyncio.gather(*(fetch(pool) for _ in range(3)))
    assert not any(new for _, new in got) and script.connections == 3
    # Stale ones are replaced: new connections are opened without any request asking.
    for _ in range(1000):
        if script.connections >= 6:
            break
        await asyncio.sleep(0.02)
    assert script.connections >= 6
    await pool.close()


async def test_the_spare_pool_grows_to_the_bursts_the_traffic_brings(server: tuple[Script, str]) -> None:
    """Asked for 2 spare connections, the pool holds 1.5x the largest rise in connections in use
    between two of the keeper's looks: after a burst of 10 requests at once it keeps 15 open, and the
    next burst of 10 opens none."""
    script, url = server
    pool = Pool(Target(url))
    pool.keep_spare(2)

    async def until(done: Callable[[], bool]) -> None:
        for _ in range(1000):
            if done():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("not reached")

    await until(lambda: script.connections >= 2)
    held = [await pool.acquire() for _ in range(10)]  # a burst: 10 in use at once
    assert sum(new for _, new in held) == 8  # the 2 spares served first
    for conn, _ in held:
        pool.release(conn)
    await until(lambda: pool.spare_target == 15 and script.connections >= 15)
    again = [await pool.acquire() for _ in range(10)]
    assert not any(new for _, new in again)
    for conn, _ in again:
        pool.release(conn)
    await pool.close()


async def test_spare_connections_come_back_after_the_server_restarts() -> None:
    """A server that goes away (a restart) takes the pool's connections with it; the pool opens its
    spare ones again once something listens on the port, no request needed."""
    accepted: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        await reader.read()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0, reuse_address=True)
    port = srv.sockets[0].getsockname()[1]
    pool = Pool(Target(f"http://127.0.0.1:{port}"))
    pool.keep_spare(2)
    try:
        for _ in range(500):
            if len(accepted) >= 2:
                break
            await asyncio.sleep(0.01)
        assert len(accepted) == 2
        # A restart: the listener goes and every connection drops.
        srv.close()
        for w in list(pool._idle):
            assert w.transport is not None
            w.transport.abort()
        await srv.wait_closed()
        await asyncio.sleep(0.7)  # a tick of the keeper finds nothing listening
        srv = await asyncio.start_server(handle, "127.0.0.1", port, reuse_address=True)
        for _ in range(500):
            if len(accepted) >= 4:
                break
            await asyncio.sleep(0.01)
        assert len(accepted) >= 4
    finally:
        await pool.close()
        srv.close()
        await srv.wait_closed()


async def test_an_abort_for_an_answer_that_ended_leaves_the_next_request_alone(
    server: tuple[Script, str],
) -> None:
    """A request cancelled just after its answer ended must not drop the connection it gave back: the
    next request may already be on it."""
    script, url = server
    pool = Pool(Target(url))
    first, _ = await fetch(pool)
    conn, new = await pool.acquire()
    assert not new
    second = Collect()
    conn.send(request_head(pool.target, "GET", "/x", {}, 0), b"", second)
    conn.abort(first)  # the first request's late cancel
    await asyncio.wait_for(second.done, 5)
    assert second.status == 200 and not conn.closed and script.connections == 1
    await pool.close()


async def test_a_negative_size_is_a_protocol_error_not_a_hang(server: tuple[Script, str]) -> None:
    script, url = server
    script.answer = lambda c, r: [HEAD + b"-5\r\nxxxxx\r\n0\r\n\r\n"]
    pool = Pool(Target(url))
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(fetch(pool), 5)
    script.answer = lambda c, r: [b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n"]
    with pytest.raises(ProtocolError):
        await asyncio.wait_for(fetch(pool), 5)
    await pool.close()


async def test_a_waiter_cancelled_as_it_is_handed_a_connection_passes_it_on(
    server: tuple[Script, str],
) -> None:
    """At the limit: the connection handed to a waiter that is cancelled in the same step goes to the
    next waiter, not lost (the pool would otherwise stall with a slot free)."""
    _, url = server
    pool = Pool(Target(url), limit=1)
    conn, _ = await pool.acquire()
    first = asyncio.create_task(pool.acquire())
    second = asyncio.create_task(pool.acquire())
    await asyncio.sleep(0.02)
    pool.release(conn)  # handed to the first waiter...
    first.cancel()  # ...which is cancelled before it runs
    got, new = await asyncio.wait_for(second, 5)
    assert got is conn and not new
    await pool.close()


async def test_a_closed_port_is_a_refused_connection() -> None:
    srv = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    srv.close()
    await srv.wait_closed()
    with pytest.raises(ConnectError) as err:
        await Pool(Target(f"http://127.0.0.1:{port}")).acquire()
    assert err.value.refused


def test_targets_and_request_heads() -> None:
    t = Target("https://example.org/prefix/")
    assert (t.tls, t.host, t.port, t.prefix, t.host_header) == (
        True,
        "example.org",
        443,
        "/prefix",
        "example.org",
    )
    head = request_head(Target("http://[::1]:8000"), "POST", "/v1/completions", {"X-Request-Id": "r"}, 12)
    assert head == (
        b"POST /v1/completions HTTP/1.1\r\nHost: [::1]:8000\r\nX-Request-Id: r\r\nContent-Length: 12\r\n\r\n"
    )
    auth = request_head(Target("http://u%40x:p%3Aw@h:1"), "GET", "/health", {}, 0)
    assert b"Authorization: Basic dUB4OnA6dw==\r\n" in auth  # base64 of "u@x:p:w"
    with pytest.raises(ValueError, match="not an http"):
        Target("ftp://example.org")


async def test_the_sender_sends_again_when_a_reused_connection_closes_before_any_answer(
    server: tuple[Script, str],
) -> None:
    """A keep-alive connection the server closes as the request arrives (its idle timeout shorter than
    the pool's) never served it: the sender process sends it once more on a fresh connection; a stream
    cut after bytes arrived is the request's failure, never sent twice."""
    script, url = server
    script.answer = lambda c, r: [HEAD + SSE]
    script.drop_before = {(1, 3)}  # its start-up GET /health, then a, then b
    sender = SenderProcess(url, {}, 0)
    await sender.start()
    try:
        first = await send_via(sender, "a")
        second = await send_via(sender, "b")
        script.answer = lambda c, r: [HEAD + b"40\r\ndata: cut"]
        script.close_after = {(c, r) for c in range(1, 9) for r in range(1, 9)}
        third = await send_via(sender, "c")
    finally:
        await sender.stop()
    assert first[0] == second[0] == 3 and first[2] is None and second[2] is None
    assert first[1].stamps is not None and not first[1].stamps.new_connection  # the start's connection
    assert second[1].stamps is not None and second[1].stamps.new_connection
    sent = [line for _, line in script.requests if line.startswith(b"POST")]
    assert len(sent) == 4  # a, b (dropped), b again, c once
    assert third[0] == 0 and isinstance(third[2], dict) and third[2]["kind"] == "request"


async def send_via(sender: SenderProcess, rid: str, spec: bool = False) -> tuple[int, GenerationRequest, Any]:
    """One three-token request through the sender: (tokens reported, the request as finished, the
    final frame's error)."""
    request = GenerationRequest(
        rid, [1, 2, 3], max_tokens=3, stamps=Stamps(), spec=SpecSteps() if spec else None
    )
    n, error = 0, None
    async for header in stream_via(sender, request, b"{}"):
        n += int(header.get("n", 0))
        if header.get("final"):
            take_final(header, request)
            error = header.get("error")
    return n, request, error


def vllm_like(script: Script) -> Answer:
    """Answers as a vLLM server does to what soakd's OpenAI engine asks (three tokens per completion)."""
    bodies = {
        b"GET /v1/models": b'{"data": [{"id": "m", "max_model_len": 4096}]}',
        b"GET /version": b'{"version": "0.0-scripted"}',
        b"GET /health": b"",
    }

    def answer(conn: int, n: int) -> list[bytes]:
        line = script.requests[-1][1]
        if line.startswith(b"POST /v1/completions"):
            return [HEAD + SSE]
        body = next((b for k, b in bodies.items() if line.startswith(k + b" ")), None)
        if body is None:
            return [b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"]
        return [b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)]

    return answer


async def test_requests_are_spread_over_the_senders_and_a_restarted_one_is_warmed_again(
    server: tuple[Script, str],
) -> None:
    script, url = server
    script.answer = vllm_like(script)
    cfg = EngineConfig.model_validate({"kind": "openai", "url": url, "vocab_size": 100, "senders": 2})
    engine = OpenAIEngine(cfg)
    await engine.start()
    try:
        await engine.prepare_replay(4)  # two each, kept open ahead of demand
        requests = [GenerationRequest(f"r{i}", [1, 2, 3], max_tokens=3, stamps=Stamps()) for i in range(6)]
        got = await asyncio.gather(*(_tokens(engine, r) for r in requests))
        senders = engine.senders
        assert [s.submitted for s in senders] == [3, 3]
        assert len({s.pid for s in senders}) == 2
        summary = engine.telemetry_summary()
        assert summary["senders"] == 2 and summary["sender_loop"] in ("uvloop", "asyncio")
        sends = summary["sends"]
        assert isinstance(sends, dict) and sends["connections_warmed"] == 4
        # The first sender dies; its next request starts it again, with its two spare connections.
        dead = senders[0].pid
        assert dead is not None
        os.kill(dead, signal.SIGKILL)
        for _ in range(200):
            if not senders[0].running:
                break
            await asyncio.sleep(0.02)
        before = script.connections
        again = await _tokens(engine, GenerationRequest("again", [1, 2], max_tokens=3, stamps=Stamps()))
        assert engine.senders[0].pid not in (None, dead)
        assert engine.telemetry_summary()["sender_restarts"] == 1
        # Its start-up connection and the two warmed again (the request reused one of them).
        assert script.connections - before >= 3
    finally:
        await engine.stop()
    assert got == [3] * 6 and again == 3


async def _tokens(engine: OpenAIEngine, request: GenerationRequest) -> int:
    return sum([n async for n in engine.generate(request)])


# ------------------------------------------------------------------- the per-delta shortcuts, checked


def _event_bytes(data: str, crlf: bool, space: bool) -> bytes:
    nl = "\r\n" if crlf else "\n"
    return (f"data:{' ' if space else ''}{data}{nl}{nl}").encode()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(
                st.just("[DONE]"),
                st.text(min_size=1, max_size=40).filter(lambda s: "\n" not in s and "\r" not in s),
            ),
            st.booleans(),
            st.booleans(),
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(min_value=1, max_value=64),
)
def test_the_data_splitter_agrees_with_the_event_splitter(
    events: list[tuple[str, bool, bool]], size: int
) -> None:
    body = b"".join(_event_bytes(d, crlf, space) for d, crlf, space in events)
    full = EventSplitter()
    expected = [
        e.data.strip() for i in range(0, len(body), size) for e in full.feed(body[i : i + size]) if e.data
    ]
    expected = [d for d in expected if d]
    lean = DataSplitter()
    got = [d for i in range(0, len(body), size) for d in lean.feed(body[i : i + size])]
    assert got == expected


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(max_size=30),
    total=st.integers(min_value=0, max_value=10**6),
    error=st.booleans(),
    spec=st.booleans(),
)
def test_the_usage_shortcut_agrees_with_the_parse_or_steps_aside(
    text: str, total: int, error: bool, spec: bool
) -> None:
    chunk: dict[str, object] = {
        "choices": [{"index": 0, "text": text}],
        "usage": {"completion_tokens": total},
    }
    if error:
        chunk["error"] = {"message": "boom", "code": 500}
    if spec:
        chunk["metrics"] = {"speculative_decoding": {"num_drafts": 1}}
    data = json.dumps(chunk, separators=(",", ":") if total % 2 else (", ", ": ")).encode()
    quick = usage_tokens(data)
    if error or spec:
        assert quick is None  # left to the full parse: it raises for the error, reads the metrics
        return
    assert quick == total
    assert new_tokens(data, 0, None) == (total, total)


def test_text_that_mentions_the_keys_does_not_fool_the_shortcut() -> None:
    # Inside a JSON string every quote is escaped, so neither key's bytes can match there.
    chunk = {"choices": [{"text": '"completion_tokens": 999 "error"'}], "usage": {"completion_tokens": 4}}
    data = json.dumps(chunk).encode()
    assert usage_tokens(data) == 4
    assert new_tokens(data, 0, None) == (4, 4)
    with pytest.raises(RequestError):
        new_tokens(b'{"error": {"message": "boom"}}', 0, None)
    assert usage_tokens(b'{"error": {"message": "boom"}, "usage": {"completion_tokens": 4}}') is None
