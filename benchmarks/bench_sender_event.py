"""The sender process's Python cost per stream event, alone: no socket, no event loop wake-up, no kernel.

Run by hand:  .venv/bin/python benchmarks/bench_sender_event.py [--events 20000] [--reps 5]

One `_Stream` (engine/sender_child.py) on one `Connection` (engine/h1.py) is fed a response head and then
`--events` chunks as the stand-in server streams them (one chunked SSE event each: 2 tokens, the running
usage), straight into `Connection.data_received`: the chunk de-framed, the event split, the token count
read without a JSON parse, the delta stamped. Prints the median microseconds per event over `--reps`.
What a real read costs beyond this (the loop's wake-up, the recv, the kernel's TCP work) is what
`perf record -g -p <sender pid>` during benchmarks/bench_capacity.py shows (benchmarks/RESULTS.md,
"Where the sender's time per delta goes").
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from soakd.engine import sender_child
from soakd.engine.base import SpecSteps, Stamps
from soakd.engine.h1 import Connection

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


class _Child:
    """What a stream reports to: the progress frames are counted, not written."""

    def __init__(self) -> None:
        self.frames = 0

    def write(self, header: dict[str, Any]) -> None:
        self.frames += 1


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass


def _event(k: int) -> bytes:
    payload = (
        b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1733400000,'
        b'"model":"standin","choices":[{"index":0,"text":" tok tok","logprobs":null,"finish_reason":null,'
        b'"stop_reason":null}],"usage":{"prompt_tokens":1100,"total_tokens":%d,"completion_tokens":%d}}\n\n'
        % (1100 + 2 * k + 2, 2 * k + 2)
    )
    return b"%x\r\n%s\r\n" % (len(payload), payload)


async def one(events: list[bytes]) -> float:
    conn = Connection(None)
    conn.transport = _Transport()  # type: ignore[assignment]
    stream = sender_child._Stream(_Child(), 1, Stamps(sent=time.monotonic()), None, SpecSteps())  # type: ignore[arg-type]
    conn.send(b"", b"", stream)
    conn.data_received(HEAD)
    start = time.perf_counter()
    for chunk in events:
        conn.data_received(chunk)
    return (time.perf_counter() - start) / len(events) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    events = [_event(k) for k in range(args.events)]
    runs = [asyncio.run(one(events)) for _ in range(args.reps)]
    print(f"per event: median {statistics.median(runs):.2f} us ({', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
