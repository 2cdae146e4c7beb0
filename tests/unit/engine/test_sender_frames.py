"""The sender's pipe frames: what one side writes the other reads whole, a cut or oversized frame is an
error before anything is allocated for it, and a clean end of input is not an error."""

from __future__ import annotations

import asyncio
import struct

import pytest

from soakd.engine.sender import MAX_BODY, FrameError, frame, read_frame


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
