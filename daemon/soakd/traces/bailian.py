"""Read the Qwen Bailian usage traces (ATC'25, alibaba-edu/qwen-bailian-usagetraces-anon).

Format: JSONL, one request per line, in arrival order:

    {"chat_id": 159, "parent_chat_id": -1, "timestamp": 61.114, "input_length": 521,
     "output_length": 132, "type": "text", "turn": 1, "hash_ids": [1089, 1090, ...]}

- `timestamp` (number, seconds; never decreasing).
- `input_length`, `output_length` (integers >= 1).
- `hash_ids`: one id per 16-token block of the prompt (length ceil(input_length / 16)); a later turn's
  prompt repeats the blocks of the conversation so far, so prefix reuse is in the ids already.
- `chat_id` / `parent_chat_id` (-1 for the first turn): a follow-up turn names the request it follows;
  soakd makes the conversation's first chat id the session id, so the turns replay as one session.
- `turn`: the turn number as recorded. `type` and other keys are ignored.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any

from soakd.errors import TraceError
from soakd.traces.model import Row, RowReader, Skip

NAME = "bailian"
BLOCK_SIZE = 16
TIME_KEY = "timestamp"
_FIELDS = ("chat_id", "parent_chat_id", "timestamp", "input_length", "output_length")
# Chat id -> conversation root. Bounded: a follow-up whose parent fell out starts a session of its own
# named after the parent, which keeps later turns of that conversation together.
_MAX_CHATS = 1_000_000


def looks_like(row: dict[str, Any]) -> bool:
    """Whether a first JSON row has the Bailian fields (auto-detection)."""
    return all(key in row for key in _FIELDS)


def _chat_id(r: RowReader, key: str) -> str:
    value = r.row.get(key)
    if value is None:
        raise r.error("missing field", key)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise r.error("expected an integer or a string", key)
    return str(value)


def read(rows: Iterable[tuple[int, dict[str, Any]]], file: str) -> Iterator[Row | TraceError | Skip]:
    """A Row per (line, object) of a Bailian file, or the TraceError of a bad row."""
    roots: OrderedDict[str, str] = OrderedDict()
    for line, obj in rows:
        r = RowReader(obj, file, line)
        try:
            chat = _chat_id(r, "chat_id")
            parent = _chat_id(r, "parent_chat_id")
            t = r.number("timestamp", minimum=0)
            input_tokens = r.tokens("input_length")
            output_tokens = r.tokens("output_length")
            turn = r.integer("turn", minimum=0, default=0)
            hash_ids = r.hash_ids(
                "hash_ids", input_tokens=input_tokens, input_key="input_length", block_size=BLOCK_SIZE
            )
        except TraceError as err:
            yield err
            continue
        root = chat if parent == "-1" else roots.get(parent, parent)
        roots[chat] = root
        if len(roots) > _MAX_CHATS:
            roots.popitem(last=False)
        yield Row(line, t, input_tokens, output_tokens, BLOCK_SIZE, hash_ids, session=root, turn=turn)
