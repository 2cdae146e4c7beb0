"""The sender's native stream reader (engine/_reader.c, driven by engine/native.py) against the Python
path it replaces: the same tokens, deltas, speculative metrics and failures on any stream cut any way
over a real loopback socket; the chunked framing's errors, a stream cut short and bytes after the end
each reported; the kernel's receive stamps kept when the read waits for the poll; and the sender
process reading through it end to end (the scripted server of test_h1)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_h1 import HEAD, Script, send_via, server  # noqa: F401  (the scripted server fixture)

from soakd.engine import native
from soakd.engine.base import SpecSteps, Stamps
from soakd.engine.completions import RequestError
from soakd.engine.sender import SenderProcess
from soakd.engine.sender_child import _Stream

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native reader {native.UNAVAILABLE}")


class _Parent:
    """The sender's frame writer, kept: progress frames are what the parent would see."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []

    def write(self, header: dict[str, Any]) -> None:
        self.frames.append(header)

    def progress(self, key: int, n: int) -> None:
        self.frames.append({"key": key, "n": n})


@contextlib.contextmanager
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(server side, client side) of a loopback TCP connection: the reader reads the client side."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    srv, _ = listener.accept()
    listener.close()
    client.setblocking(False)
    try:
        yield srv, client
    finally:
        srv.close()
        client.close()


def chunked(payload: bytes, sizes: list[int]) -> bytes:
    """`payload` framed as HTTP chunks of the given sizes (cycled), then the last chunk."""
    out, at, k = [], 0, 0
    while at < len(payload):
        size = max(1, sizes[k % len(sizes)]) if sizes else len(payload)
        piece = payload[at : at + size]
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        at, k = at + size, k + 1
    return b"".join(out) + b"0\r\n\r\n"


def cut(data: bytes, points: list[int]) -> list[bytes]:
    marks = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(marks) if b > a]


def python_path(payload: bytes, pieces: list[bytes], spec: bool) -> tuple[_Stream, _Parent]:
    """The answer read as the Python path reads it (the de-chunked body fed to `_Stream.on_body`)."""

    async def run() -> tuple[_Stream, _Parent]:
        parent = _Parent()
        stream = _Stream(parent, 1, Stamps(sent=time.monotonic()), None, SpecSteps() if spec else None)  # type: ignore[arg-type]
        stream.on_head(200, {})
        at = 0
        for piece in pieces:  # the same cuts, over the payload
            stream.on_body(payload[at : at + len(piece)])
            at += len(piece)
        stream.on_body(payload[at:])
        stream.on_end()
        return stream, parent

    return asyncio.run(run())


class _Conn:
    """The connection's side of the native path (engine/h1.py's Connection), kept: how the answer
    ended. The sink is a real `_Stream`, the reader and its driver the real ones."""

    def __init__(self, sink: _Stream) -> None:
        self.sink = sink
        self.native_held = True
        self.end: tuple[int, str | None] | None = None

    def native_end(self, reusable: bool) -> None:
        self.native_held, self.end = False, (1 if reusable else 2, None)
        self.sink.on_end()

    def native_error(self, why: str) -> None:
        self.native_held, self.end = False, (-1, why)
        self.sink.on_error(RuntimeError(why))

    def abort(self, sink: object = None) -> None:  # what an error event does to the connection
        self.native_held, self.end = False, (0, "aborted")


def native_path(
    answer: bytes, pieces: list[bytes], spec: bool, report_s: float = 0.0
) -> tuple[_Stream, _Parent, int, str | None]:
    """The same answer's bytes (chunked) written piece by piece to a socket the reader reads, driven by
    NativeStreams' poll (tokens handed out every poll, or with `report_s` summed between reports)."""

    async def run() -> tuple[_Stream, _Parent, int, str | None]:
        parent = _Parent()
        stream = _Stream(parent, 1, Stamps(sent=time.monotonic()), None, SpecSteps() if spec else None)  # type: ignore[arg-type]
        stream.on_head(200, {})
        conn = _Conn(stream)
        stream.conn = conn  # type: ignore[assignment]
        streams = native.NativeStreams(report_s=report_s)
        try:
            with tcp_pair() as (srv, client):
                first, rest = pieces[0], pieces[1:]
                streams.add(conn, stream, client.fileno(), first)  # bytes the head's read brought along
                for piece in rest:
                    if conn.end is not None:
                        break
                    srv.sendall(piece)
                    streams.poll()
                deadline = time.monotonic() + 10
                while conn.end is None:
                    assert time.monotonic() < deadline, "the stream did not end"
                    select.select([client], [], [], 0.05)
                    streams.poll()
                if conn.end[0] == 0:
                    streams.remove(client.fileno())
        finally:
            streams.close()
        return stream, parent, conn.end[0], conn.end[1]

    return asyncio.run(run())


def _event(kind: str, total: int, text: str, crlf: bool) -> bytes:
    nl = "\r\n" if crlf else "\n"
    body: dict[str, Any] = {"choices": [{"index": 0, "text": text}]}
    if kind != "nousage":
        body["usage"] = {"completion_tokens": total}
    if kind == "spec":
        body["metrics"] = {"speculative_decoding": {"per_step_accepted": [1, 2], "per_step_drafted": [3, 3]}}
    if kind == "error":
        body = {"error": {"message": "boom", "code": 500}}
    if kind == "comment":
        return f": keep-alive{nl}{nl}".encode()
    if kind == "done":
        return f"data: [DONE]{nl}{nl}".encode()
    return f"data: {json.dumps(body)}{nl}{nl}".encode()


_events = st.lists(
    st.tuples(
        st.sampled_from(["count", "count", "count", "same", "spec", "nousage", "comment", "done", "error"]),
        st.integers(min_value=1, max_value=4),
        st.text(max_size=12),
        st.booleans(),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=150, deadline=None)
@given(
    _events,
    st.lists(st.integers(min_value=1, max_value=300), min_size=1, max_size=4),
    st.lists(st.integers(min_value=0, max_value=10**6), max_size=8),
    st.booleans(),
    st.sampled_from([0.0, 60.0]),
)
def test_the_native_reader_reads_what_the_python_path_reads(
    events: list[tuple[str, int, str, bool]], sizes: list[int], points: list[int], spec: bool, report_s: float
) -> None:
    total, parts = 0, []
    for kind, step, text, crlf in events:
        if kind in ("count", "spec"):
            total += step
        parts.append(_event(kind, total, text, crlf))
    payload = b"".join(parts)
    answer = chunked(payload, sizes)
    pieces = cut(answer, points)
    got, got_frames, end, why = native_path(answer, pieces, spec, report_s)
    want, want_frames = python_path(payload, cut(payload, points), spec)
    failed = want.done.exception() if want.done.done() else None
    if isinstance(failed, RequestError):
        # The error event fails the request either way; what was counted before it does not matter.
        assert isinstance(got.done.exception(), RequestError)
        return
    assert (end, why) == (1, None)
    assert got.done.done() and got.done.exception() is None
    assert sum(f.get("n", 0) for f in got_frames.frames) + got.pending == (
        sum(f.get("n", 0) for f in want_frames.frames) + want.pending
    )
    assert got.stamps.deltas == want.stamps.deltas
    assert (got.stamps.first is None) == (want.stamps.first is None)
    if spec:
        assert got._spec == want._spec
    if got.stamps.first is not None:
        assert got.stamps.last is not None and got.stamps.last >= got.stamps.first
        assert got.stamps.gaps == pytest.approx(got.stamps.last - got.stamps.first, abs=1e-9)


@pytest.mark.parametrize(
    ("answer", "end", "why"),
    [
        (b"zz\r\ndata: x\n\n\r\n0\r\n\r\n", -1, "malformed chunk size"),
        (b"3\r\nabcXY0\r\n\r\n", -1, "malformed chunk"),
        (b"4\r\nab\n\n\r\n0\r\n\r\nHTTP/1.1 200", 2, None),  # bytes after the end: done, not reused
        (b"4;ext=1\r\nab\n\n\r\n0\r\ntrailer: x\r\n\r\n", 1, None),  # an extension and a trailer
        (b"5\r\ndata:\r\n0\r\n\r\n", 1, None),  # an unended last event dropped, as the Python path does
        (b"3;" + b"x" * 300 + b"\r\nab\n\r\n0\r\n\r\n", 1, None),  # a long extension skipped, not kept
    ],
)
def test_the_framing_errors_and_endings_are_reported(answer: bytes, end: int, why: str | None) -> None:
    reader = native._reader.Reader()  # type: ignore[union-attr]
    with tcp_pair() as (srv, client):
        reader.add(client.fileno(), 7, b"")
        srv.sendall(answer)
        got: list[tuple[int, str | None]] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            select.select([client], [], [], 0.05)
            got = [(r[5], r[7]) for r in reader.poll() if r[5]]
    assert got == [(end, why)]
    assert len(reader) == 0  # an ended stream is out of the reader


def test_a_stream_cut_short_by_the_server_is_a_failure_and_remove_forgets() -> None:
    reader = native._reader.Reader()  # type: ignore[union-attr]
    with tcp_pair() as (srv, client), tcp_pair() as (srv2, client2):
        reader.add(client.fileno(), 1, b'10\r\ndata: {"usage":')
        reader.add(client2.fileno(), 2, b"")
        assert len(reader) == 2
        srv.close()
        srv2.sendall(chunked(b'data: {"completion_tokens":3}\n\n', [])[:-5])
        deadline = time.monotonic() + 10
        results: dict[int, Any] = {}
        while 1 not in results and time.monotonic() < deadline:
            select.select([client], [], [], 0.05)
            results.update({r[0]: r for r in reader.poll()})
        assert results[1][5] == -2 and results[1][7] == "connection closed by the server"
        assert results[2][1:3] == (3, 1)  # the other stream read alike: 3 tokens, one event
        assert reader.remove(client2.fileno()) is True and reader.remove(client2.fileno()) is False
        assert len(reader) == 0


def test_a_read_that_waits_for_the_poll_keeps_the_kernels_stamp() -> None:
    reader = native._reader.Reader()  # type: ignore[union-attr]
    with tcp_pair() as (srv, client):
        reader.add(client.fileno(), 1, b"")
        # The kernel turns receive stamps on a moment after a socket first asks (a deferred switch):
        # reads until then are stamped when read, and counted.
        deadline = time.monotonic() + 10
        total = 0
        while True:
            total += 2
            before = time.monotonic()
            srv.sendall(chunked(b'data: {"completion_tokens":%d}\n\n' % total, [])[:-5])
            after = time.monotonic()
            time.sleep(0.05)
            polled = time.monotonic()
            unstamped = reader.unstamped
            [(_, tokens, events, first, last, end, _, _, seen)] = reader.poll()
            if reader.unstamped == unstamped or time.monotonic() > deadline:
                break
            assert first >= polled  # stamped when read
    assert reader.unstamped == unstamped, "the kernel never stamped a read"
    assert (tokens, events, end, seen) == (2, 1, 0, total)
    assert first == last
    # Received (stamped by the kernel) while the bytes were written: before the write returned, 50 ms or
    # more before the poll that read them.
    assert before - 0.001 <= first <= after + 0.001
    assert polled - first >= 0.04


@pytest.mark.parametrize(
    ("events", "tokens", "deltas"),
    [
        # A count only the parse reads (a space before the colon), then ones the reader reads: the
        # running count is Python's, so nothing is counted twice.
        ([b'data: {"usage": {"completion_tokens" : 2}}', b'data: {"usage":{"completion_tokens":4}}'], 4, 2),
        # One event's data split over two lines, a count in a comment line: read by the parse alone.
        (
            [b'data: {"usage":\ndata: {"completion_tokens":3}}', b': "completion_tokens":99\ndata: {"x":1}'],
            3,
            1,
        ),
        # Whole events before a framing error are read, as on the Python path.
        ([b'data: {"usage":{"completion_tokens":2}}', b"BROKEN"], 2, 1),
    ],
)
def test_what_the_reader_cannot_read_alone_is_counted_by_the_parse_once(
    events: list[bytes], tokens: int, deltas: int
) -> None:
    payload = b"".join(e + b"\n\n" for e in events if e != b"BROKEN")
    answer = chunked(payload, [])
    if events[-1] == b"BROKEN":
        answer = answer[:-5] + b"zz\r\n"  # a chunk size that is not one
    got, frames, end, _ = native_path(answer, [answer], spec=False)
    want, want_frames = python_path(payload, [payload], spec=False)
    count = sum(f.get("n", 0) for f in frames.frames) + got.pending
    assert count == tokens == sum(f.get("n", 0) for f in want_frames.frames) + want.pending
    assert got.stamps.deltas + 1 == deltas
    assert end == (-1 if events[-1] == b"BROKEN" else 1)


def test_an_error_event_with_a_count_fails_the_request_and_counts_nothing() -> None:
    payload = (
        b'data: {"usage":{"completion_tokens":1}}\n\n'
        b'data: {"error":{"message":"boom"},"usage":{"completion_tokens":9}}\n\n'
    )
    got, frames, end, why = native_path(chunked(payload, []), [chunked(payload, [])], spec=False)
    assert isinstance(got.done.exception(), RequestError) and (end, why) == (0, "aborted")
    assert sum(f.get("n", 0) for f in frames.frames) + got.pending == 1


def test_an_event_the_parse_cannot_take_fails_its_stream_alone() -> None:
    """An exception from one stream's news (here the parse's RecursionError) fails that stream; the poll
    goes on for the others and is scheduled again."""

    async def run() -> tuple[_Stream, _Stream, _Conn, _Conn, bool]:
        streams = native.NativeStreams()
        sinks, conns = [], []
        with tcp_pair() as (srv1, c1), tcp_pair() as (srv2, c2):
            for client in (c1, c2):
                stream = _Stream(_Parent(), 1, Stamps(sent=time.monotonic()), None, None)  # type: ignore[arg-type]
                stream.on_head(200, {})
                conn = _Conn(stream)
                stream.conn = conn  # type: ignore[assignment]
                streams.add(conn, stream, client.fileno(), b"")
                sinks.append(stream)
                conns.append(conn)
            # Not ended: the failing stream is still the reader's when its news fails.
            srv1.sendall(chunked(b"data: " + b"[" * 100_000 + b"\n\n", [])[:-5])
            srv2.sendall(chunked(b'data: {"usage":{"completion_tokens":2}}\n\n', []))
            deadline = time.monotonic() + 10
            while not all(c.end for c in conns) and time.monotonic() < deadline:
                select.select([c1, c2], [], [], 0.05)
                streams.poll()
            # Out of the reader and its driver, so no poll is left scheduled for it.
            again = (len(streams), len(streams._reader), streams._timer is None)
            streams.close()
        return sinks[0], sinks[1], conns[0], conns[1], again

    bad, good, bad_conn, good_conn, again = asyncio.run(run())
    assert (
        isinstance(bad.done.exception(), RequestError) and bad_conn.end is not None and bad_conn.end[0] == -1
    )
    assert good.done.exception() is None and good_conn.end == (1, None)
    assert good.stamps.first is not None and good._seen == 2
    assert again == (0, 0, True)


def test_tokens_are_summed_between_reports_and_handed_out_when_due() -> None:
    """With `report_s`, a stream's first tokens are handed out at once, later ones summed in the reader
    (their number and first and last stamps kept) until a report is due, also with no read since, and
    whatever is left at the end."""
    reader = native._reader.Reader(report_s=0.2)  # type: ignore[union-attr]

    def event(total: int) -> bytes:
        return chunked(b'data: {"completion_tokens":%d}\n\n' % total, [])[:-5]

    def news(wait: float = 0.0) -> list[Any]:
        select.select([], [], [], wait)
        return reader.poll()

    with tcp_pair() as (srv, client):
        reader.add(client.fileno(), 1, b"")
        srv.sendall(event(1))
        [first] = news(0.02)
        assert first[1:3] == (1, 1)
        reported = time.monotonic()
        srv.sendall(event(3))
        srv.sendall(event(6))
        sent = time.monotonic()
        select.select([client], [], [], 0.02)
        quiet = reader.poll()
        quiet_in_time = time.monotonic() - reported < 0.15  # polled well within the interval
        time.sleep(max(0.0, reported + 0.25 - time.monotonic()))
        due = news()
        srv.sendall(b"0\r\n\r\n")
        [end] = news(0.05)
    # Two deltas summed into one report, stamped when they arrived, not when it came due.
    reports = quiet + due
    assert [r[1:3] for r in reports] == [(5, 2)] and reports[0][3] <= reports[0][4] <= sent
    if quiet_in_time:  # held back while within the interval, handed out by the sweep with no read since
        assert quiet == [] and due[0][5] == 0
    assert end[1:3] == (0, 0) and end[5] == 1


def test_a_call_while_polling_or_on_a_bad_fd_is_refused() -> None:
    reader = native._reader.Reader()  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="bad or busy fd"):
        reader.add(-1, 1, b"")
    with tcp_pair() as (_, client):
        reader.add(client.fileno(), 1, b"")
        with pytest.raises(ValueError, match="busy"):
            reader.add(client.fileno(), 2, b"")
        reader.remove(client.fileno())
    with pytest.raises(RuntimeError, match="already initialised"):
        reader.__init__()


# ---------------------------------------------------------------- the sender process, end to end


def _answer(events: list[bytes]) -> bytes:
    return HEAD + chunked(b"".join(events), [64])


@pytest.mark.parametrize("reader", ["native", "python"])
async def test_the_sender_reads_alike_through_either_reader(
    server: tuple[Script, str],  # noqa: F811
    reader: str,
) -> None:
    script, url = server
    counts = [_event("count", t, "x", False) for t in (1, 3, 4)]
    final = _event("spec", 5, "", False)
    answers = {
        1: _answer([*counts, final, _event("done", 0, "", False)]),
        2: _answer([counts[0], _event("error", 0, "", False), counts[1]]),
    }
    script.answer = lambda c, r: [answers[1] if r != 3 else answers[2]]
    sender = SenderProcess(url, {}, 0, reader=reader)
    await sender.start()
    try:
        assert sender.reader == reader and sender.reader_note == ""
        ok = await send_via(sender, "a", spec=True)
        failed = await send_via(sender, "b")
        again = await send_via(sender, "c")
    finally:
        await sender.stop()
    n, request, error = ok
    assert (n, error) == (5, None)
    assert request.spec is not None and request.spec.accepted == [1, 2] and request.spec.drafted == [3, 3]
    assert request.stamps is not None and request.stamps.deltas == 3  # four deltas: the first and three gaps
    assert isinstance(failed[2], dict) and failed[2]["kind"] == "request" and "boom" in failed[2]["message"]
    # The error's connection was dropped, not reused: the next request opened one.
    assert again[0] == 5 and again[1].stamps is not None and again[1].stamps.new_connection
    assert script.connections == 2


async def test_asked_for_where_it_cannot_read_the_native_reader_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from soakd.config import load
    from soakd.errors import ConfigError
    from soakd.wiring import resolve_model

    monkeypatch.setattr(native, "UNAVAILABLE", "not built (no C compiler)")
    asked = {"engine.kind": "openai", "engine.url": "http://127.0.0.1:9", "engine.served_model": "m"}
    with pytest.raises(ConfigError) as info:
        resolve_model(load(None, {**asked, "engine.sender_reader": "native"}))
    assert str(info.value) == (
        '<defaults>: engine.sender_reader: the native stream reader is not built (no C compiler): set "auto" '
        'or "python"'
    )
    assert resolve_model(load(None, asked)) == "m"  # "auto": read in Python there


async def test_through_tls_auto_reads_in_python() -> None:
    from soakd.engine.h1 import Target
    from soakd.engine.sender_child import _reader_choice

    assert _reader_choice("auto", Target("https://h:1")) == ("python", "TLS: read through the TLS layer")
    assert _reader_choice("auto", Target("http://h:1")) == ("native", "")
    assert _reader_choice("python", Target("http://h:1")) == ("python", "")
