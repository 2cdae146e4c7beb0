"""The pure parts of the OpenAI adapter and the trace recorder: event splitting, prefix block ids, the
arrival-order writer, what is kept of a request and of a server's error message."""

from __future__ import annotations

import io
import json

import pytest

from soakd.engine.completions import RequestError, error_message, new_tokens
from soakd.engine.openai_http import base_url
from soakd.errors import UsageError
from soakd.redact import redact_url
from soakd.sse import EventSplitter
from soakd.traces.record import (
    OrderedRecordWriter,
    PrefixHasher,
    RecorderStats,
    check_listen,
    sampling_of,
)


def test_events_are_split_whatever_the_chunking() -> None:
    body = b'data: {"a":1}\n\n: keep-alive\n\ndata: {"b":2}\r\n\r\ndata: [DONE]\n\n'
    for size in (1, 3, 7, len(body)):
        splitter = EventSplitter()
        events = [e for i in range(0, len(body), size) for e in splitter.feed(body[i : i + size])]
        events += splitter.close()
        assert [e.data for e in events] == [b'{"a":1}', None, b'{"b":2}', b"[DONE]"]
        assert b"".join(e.raw for e in events) == body


def test_unterminated_last_event_is_kept() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b"data: x") == []
    assert [e.data for e in splitter.close()] == [b"x"]


def test_equal_prefixes_get_equal_block_ids() -> None:
    hasher = PrefixHasher(block_size=4)
    a = hasher.ids([1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = hasher.ids([1, 2, 3, 4, 5, 6, 7, 8, 10, 11])
    c = hasher.ids([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[:2] == b[:2] and a[2] != b[2]
    # A block's id covers everything before it: same tokens after a different start differ.
    assert c[1] != a[1]
    assert len(a) == 3 and len(b) == 3


def test_forgotten_prefixes_get_new_ids() -> None:
    hasher = PrefixHasher(block_size=2, max_blocks=2)
    first = hasher.ids([1, 2])
    hasher.ids([3, 4])
    hasher.ids([5, 6])  # evicts [1, 2]
    assert hasher.ids([1, 2]) != first


def test_records_are_written_in_arrival_order() -> None:
    out = io.StringIO()
    stats = RecorderStats()
    writer = OrderedRecordWriter(out, stats)
    seqs = [writer.reserve() for _ in range(4)]
    writer.finish(seqs[2], {"t": 2})
    writer.finish(seqs[1], None)  # failed: nothing written, nothing held up
    assert out.getvalue() == ""
    writer.finish(seqs[0], {"t": 0})
    assert [json.loads(x)["t"] for x in out.getvalue().splitlines()] == [0, 2]
    writer.finish(seqs[3], {"t": 3})
    assert [json.loads(x)["t"] for x in out.getvalue().splitlines()] == [0, 2, 3]
    assert stats.recorded == 3 and writer.waiting == 0


def test_a_request_that_never_ends_is_given_up_past_the_limit() -> None:
    out = io.StringIO()
    stats = RecorderStats()
    writer = OrderedRecordWriter(out, stats, max_waiting=2)
    stuck = writer.reserve()
    later = [writer.reserve() for _ in range(3)]
    for i, seq in enumerate(later):
        writer.finish(seq, {"t": i + 1})
    assert [json.loads(x)["t"] for x in out.getvalue().splitlines()] == [1, 2, 3]
    writer.finish(stuck, {"t": 0})  # too late: the file is already past it
    assert stats.dropped_late == 1 and stats.recorded == 3


def test_sampling_keeps_numbers_and_booleans_only() -> None:
    body = {"temperature": 0.7, "top_p": None, "seed": 3, "ignore_eos": True, "stop": ["x"], "n": "2"}
    assert sampling_of(body) == {"temperature": 0.7, "seed": 3, "ignore_eos": True}


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "localhost", "127.0.0.2"])
def test_loopback_is_allowed(host: str) -> None:
    check_listen(host, allow_remote=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.5", "example.com", "::"])
def test_beyond_loopback_needs_allow_remote(host: str) -> None:
    with pytest.raises(UsageError, match="allow-remote"):
        check_listen(host, allow_remote=False)
    check_listen(host, allow_remote=True)


def test_error_messages_are_short_and_never_echo_the_input() -> None:
    body = json.dumps({"error": {"message": "bad prompt, input_value=[1, 2, 3, 4]", "code": 400}})
    assert error_message(400, body) == "HTTP 400: bad prompt,"
    assert len(error_message(500, "x" * 10_000)) < 200
    assert error_message(502, "") == "HTTP 502"


def test_urls() -> None:
    assert base_url("http://h:8000/v1/") == "http://h:8000"
    assert redact_url("http://user:secret@h:8000/v1?key=abc") == "http://<redacted>@h:8000/v1?key=<redacted>"


def test_tokens_from_continuous_usage_or_one_per_chunk() -> None:
    ids: list[int] = []
    chunk = {"choices": [{"text": "a", "token_ids": [5, 6]}], "usage": {"completion_tokens": 2}}
    assert new_tokens(json.dumps(chunk).encode(), 0, ids) == (2, 2)
    assert ids == [5, 6]
    assert new_tokens(b'{"choices": [], "usage": {"completion_tokens": 2}}', 2, None) == (0, 2)
    assert new_tokens(b'{"choices": [{"text": ""}]}', 0, None) == (1, 0)
    with pytest.raises(RequestError, match="stream HTTP 500: boom"):
        new_tokens(b'{"error": {"message": "boom", "code": 500}}', 0, None)
