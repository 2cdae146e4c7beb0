"""Read BurstGPT traces (HPMLL/BurstGPT): all three column layouts of its releases.

Format: CSV with a header row; columns are found by name:

    Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type            (v1)
    ... plus Session ID                                                              (conversation logs)
    ... plus Elapsed time                                                            (with response time)

- `Timestamp` (seconds from the start of the collection day; never decreasing).
- `Request tokens` (>= 1): prompt tokens; `Response tokens`: output tokens. BurstGPT logs failed requests
  with 0 response tokens: those are counted and left out (they were never served).
- `Session ID` (optional): requests with the same id are the turns of one conversation, in file order.
- `Model`, `Total tokens`, `Log Type`, `Elapsed time` are not needed for replay and are ignored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from typing import IO

from soakd.errors import TraceError
from soakd.traces.model import Row, Skip, csv_rows

NAME = "burstgpt"
TIME_KEY = "Timestamp"
_REQUIRED = ("Timestamp", "Request tokens", "Response tokens")
_MAX_SESSIONS = 1_000_000  # session id -> turns so far (bounded; an evicted session restarts at turn 0)


def looks_like(header: list[str]) -> bool:
    """Whether a CSV header row is a BurstGPT trace's (auto-detection)."""
    names = {h.strip() for h in header}
    return all(name in names for name in _REQUIRED)


def read(text: IO[str], file: str) -> Iterator[Row | TraceError | Skip]:
    """A Row per data row of a BurstGPT CSV, or the TraceError of a bad row; a bad header is raised."""
    _, rows = csv_rows(
        text,
        file,
        _REQUIRED,
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type[,Session ID][,Elapsed time]",
    )
    turns: OrderedDict[str, int] = OrderedDict()
    for line, r in rows:
        try:
            t = r.number("Timestamp", minimum=0)
            input_tokens = r.tokens("Request tokens")
            output_tokens = r.tokens("Response tokens", minimum=0)
            session = r.optional("Session ID")
        except TraceError as err:
            yield err
            continue
        if output_tokens == 0:
            yield Skip(line, "failed request (0 response tokens)")
            continue
        turn = 0
        if session:
            turn = turns.get(session, -1) + 1
            turns[session] = turn
            turns.move_to_end(session)
            if len(turns) > _MAX_SESSIONS:
                turns.popitem(last=False)
        yield Row(line, t, input_tokens, output_tokens, 0, session=session, turn=turn)
