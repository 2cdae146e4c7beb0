"""The sender's pipe frames: what one side writes the other reads whole, a cut or oversized frame is an
error before anything is allocated for it, and a clean end of input is not an error."""

from __future__ import annotations

import asyncio
import struct

import pytest

from soakd.engine.sender import (
    MAX_BODY,
    FrameError,
    FrameSplitter,
    Mailbox,
    frame,
    progress_frame,
    read_frame,
)


def reader_of(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


async def test_frames_round_trip_in_order_then_a_clean_end() -> None:
    body = b'{"prompt":[1,2,3]}'
    reader = reader_of(frame({"op": "send", "key": 1, "at": 12.5}, body) + frame({"op": "cancel", "key": 1}))
    assert await read_frame(reader) == ({"op": "send", "key": 1, "at": 12.5}, body)
    assert await read_frame(reader) == ({"op": "cancel", "key": 1}, b"")
    assert await read_frame(reader) is None


async def test_a_frame_cut_short_is_an_error() -> None:
    whole = frame({"op": "send", "key": 2}, b"x" * 100)
    with pytest.raises(FrameError):
        await read_frame(reader_of(whole[:3]))  # inside the length prefix
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(reader_of(whole[:-1]))  # inside the body


async def test_an_oversized_announcement_is_refused_before_reading() -> None:
    reader = reader_of(struct.pack(">II", 2, MAX_BODY + 1) + b"{}")
    with pytest.raises(FrameError, match="above the bounds"):
        await read_frame(reader)


async def test_a_header_that_is_not_an_object_is_an_error() -> None:
    with pytest.raises(FrameError, match="not a JSON object"):
        await read_frame(reader_of(struct.pack(">II", 2, 0) + b"[]"))


def test_the_splitter_reads_the_same_frames_however_the_bytes_are_cut() -> None:
    frames = [
        ({"op": "send", "key": 1, "at": 12.5}, b'{"prompt":[1,2,3]}'),
        ({"p": [1, 3, 7, 2]}, b""),
        ({"key": 1, "final": True}, b""),
    ]
    whole = b"".join(frame(h, b) for h, b in frames)
    for size in (1, 2, 7, 8, 9, len(whole)):
        splitter = FrameSplitter()
        got = []
        for at in range(0, len(whole), size):
            got += splitter.feed(whole[at : at + size])
        splitter.end()
        assert got == frames, size


def test_the_splitter_refuses_what_read_frame_refuses() -> None:
    with pytest.raises(FrameError, match="above the bounds"):
        FrameSplitter().feed(struct.pack(">II", 2, MAX_BODY + 1))
    with pytest.raises(FrameError, match="not a JSON object"):
        FrameSplitter().feed(struct.pack(">II", 2, 0) + b"[]")
    splitter = FrameSplitter()
    assert splitter.feed(frame({"key": 1}, b"xyz")[:-1]) == []
    with pytest.raises(FrameError, match="inside a frame"):
        splitter.end()


def test_frames_before_a_bad_one_are_handed_out_and_the_error_told_after() -> None:
    good = frame({"key": 1, "final": True}) + frame({"key": 2, "final": True})
    splitter = FrameSplitter()
    got = splitter.feed(good + struct.pack(">II", 2, 0) + b"[]")
    assert [h["key"] for h, _ in got] == [1, 2]  # their requests keep their answers
    with pytest.raises(FrameError, match="not a JSON object"):
        splitter.check()  # at once, not at the next read
    with pytest.raises(FrameError, match="not a JSON object"):
        splitter.end()
    splitter = FrameSplitter()
    assert len(splitter.feed(good + struct.pack(">II", 3, 0) + b"{x}")) == 2
    with pytest.raises(ValueError):
        splitter.feed(b"")  # a bad header's JSON: told on the next feed


def test_a_lone_surrogate_in_a_message_does_not_stop_the_frame() -> None:
    # A server's error text cut inside an emoji pair, as json.loads reads it: no UTF-8 for it.
    final = {"key": 3, "final": True, "error": {"kind": "request", "message": "bad \ud83d end"}}
    ((header, _),) = FrameSplitter().feed(frame(final))
    assert header["key"] == 3 and header["error"]["message"] == "bad ? end"


def test_progress_frames_carry_key_and_tokens_pairs() -> None:
    ((header, body),) = FrameSplitter().feed(progress_frame({4: 2, 9: 1}))
    assert header == {"p": [4, 2, 9, 1]} and body == b""


async def test_the_mailbox_hands_items_in_order_to_a_waiting_consumer() -> None:
    box = Mailbox()
    box.put_nowait({"n": 1})
    waiting = asyncio.ensure_future(box.get())
    assert await waiting == {"n": 1}
    waiting = asyncio.ensure_future(box.get())
    await asyncio.sleep(0)
    assert not waiting.done()  # nothing yet: it waits
    box.put_nowait({"n": 2})
    box.put_nowait({"final": True})
    assert await waiting == {"n": 2}
    assert await box.get() == {"final": True}
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(box.get(), 0.01)  # a consumer that gave up leaves no waiter behind
    box.put_nowait({"n": 3})
    assert await box.get() == {"n": 3}


class _Out:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


async def test_the_child_sends_a_requests_progress_before_its_final_frame_and_sums_a_flushs_reports() -> None:
    from soakd.engine.sender_child import _Child

    out = _Out()
    child = _Child({"url": "http://127.0.0.1:9", "reader": "python"}, out)  # type: ignore[arg-type]
    child.progress(1, 3)
    child.progress(2, 1)
    child.progress(1, 2)
    child.write({"key": 1, "final": True})
    child.progress(2, 4)
    assert out.data == b""  # nothing leaves before the flush
    await asyncio.sleep(0.05)  # the flush timer
    got = [h for h, _ in FrameSplitter().feed(out.data)]
    assert got == [{"p": [1, 5, 2, 1]}, {"key": 1, "final": True}, {"p": [2, 4]}]
    await child.close()
