"""Read ShareGPT-style conversations and vLLM-bench prompt files: traffic with text but no times.

Accepted layouts (the first non-blank byte tells an array from JSON lines):

- A JSON array of conversations, as in ShareGPT_V3 and `vllm bench serve --dataset-name sharegpt`:
  `[{"id": "x", "conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}]`
  (`from`/`value` or `role`/`content`; human|user, gpt|assistant|chatgpt|bard|bing, system). Streamed
  with ijson: the V3 file is ~670 MB and is never held whole. An element nested more than 64 levels
  deep (a conversation is 4) is a bad row.
- JSON lines, one conversation object per line (same keys), or one vLLM-bench custom row per line:
  `{"prompt": "...", "output_tokens": 128}` (`output_tokens` optional: trace.default_output_tokens).

Every assistant reply is a turn: its prompt is the whole conversation before it (so a later turn's prompt
extends the earlier one's, and the loader gives it the earlier prompt's prefix blocks), its output the
reply's length. Token counts come from a Hugging Face tokenizer when `trace.tokenizer` names one, else
they are estimated at 4 characters per token, and the trace summary says which.

Times: conversations start at the arrivals of `[trace.arrivals]` (seeded); a later turn follows the one
before by an exponential think time (mean `trace.arrivals.think_time`). Replay then runs turns closed
loop (a turn is sent after the previous one finishes plus that gap). The rows come out sorted by time.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from soakd.config import ArrivalConfig
from soakd.errors import TraceError
from soakd.traces.arrivals import arrival_stream, think_times
from soakd.traces.model import MAX_TOKENS, Row, Skip, json_lines, too_many_tokens

NAME = "sharegpt"
TIME_KEY = "conversations"
CHARS_PER_TOKEN = 4
_USER = frozenset({"human", "user"})
_ASSISTANT = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing", "model"})
_SYSTEM = frozenset({"system"})
# Levels of nesting an array element may reach, the array itself counted: a message's text is at 4.
# Bounds what the element builder holds, and keeps deep junk out of code that recurses (str(), repr()).
MAX_DEPTH = 64

Counter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class Options:
    arrivals: ArrivalConfig
    seed: int
    default_output_tokens: int
    count: Counter


def estimate_tokens(text: str) -> int:
    """Tokens in `text` at 4 characters per token (what tokenizers average on English prose)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def tokenizer_counter(path: str) -> Counter:
    """A counter using the Hugging Face tokenizer at `path` (transformers comes with vLLM)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TraceError("trace.tokenizer needs the transformers package (installed with vLLM)") from None
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise TraceError(f"cannot load tokenizer {path!r}: {str(err).splitlines()[0][:120]}") from None

    def count(text: str) -> int:
        return max(1, len(tok.encode(text, add_special_tokens=False)))

    return count


def looks_like(first: Any) -> bool:
    """Whether a first item (array element or JSON line) is a conversation or a vLLM-bench prompt row."""
    return isinstance(first, dict) and (
        "conversations" in first or "conversation" in first or "prompt" in first
    )


def first_item(fh: IO[bytes], file: str) -> tuple[bool, Any]:
    """(is an array, its first item or first line's object) for detection; None when there is none.

    An array whose first item is nested too deep is raised as the TraceError the reader would give.
    """
    head = fh.read(1 << 16)
    stripped = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if stripped.startswith(b"["):
        import ijson

        fh.seek(0)
        try:
            first = next(_elements(fh), None)
        except ijson.JSONError:
            return True, None
        if first is _TOO_DEEP:
            raise _too_deep(file, "[0]")
        return True, first
    line = stripped.split(b"\n", 1)[0]
    try:
        return False, json.loads(line)
    except (ValueError, RecursionError):
        return False, None


def read(fh: IO[bytes], file: str, opts: Options) -> Iterator[Row | TraceError | Skip]:
    """Rows (sorted by their generated times) of a conversation file, TraceErrors for bad items."""
    # peek, not read + seek: the loader's digesting reader cannot seek.
    head = fh.peek(1 << 12) if hasattr(fh, "peek") else b""
    is_array = head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")
    items = _array_items(fh, file) if is_array else _line_items(fh, file)
    starts = arrival_stream(opts.arrivals, opts.seed)
    thinks = think_times(opts.arrivals, opts.seed)
    # Turns are generated per conversation but must come out in time order: a heap holds the later
    # turns of conversations still running, released once the next conversation starts after them.
    heap: list[tuple[float, int, Row]] = []
    order = 0
    for n, (line, where, obj) in enumerate(items):
        if isinstance(obj, TraceError):
            yield obj
            continue
        try:
            turns = _turns(obj, file, line, where, opts)
        except TraceError as err:
            yield err
            continue
        if not turns:
            yield Skip(line, "no assistant reply")
            continue
        start = next(starts)
        while heap and heap[0][0] <= start:
            yield heapq.heappop(heap)[2]
        t = start
        session = str(obj.get("id", f"conv-{n}")) if len(turns) > 1 else ""
        for turn, (input_tokens, output_tokens) in enumerate(turns):
            if turn:
                t += next(thinks)
            row = Row(line, t, input_tokens, output_tokens, 0, session=session, turn=turn)
            heapq.heappush(heap, (t, order, row))
            order += 1
    while heap:
        yield heapq.heappop(heap)[2]


_Item = tuple[int, str, "dict[str, Any] | TraceError"]


def _array_items(fh: IO[bytes], file: str) -> Iterator[_Item]:
    import ijson

    try:
        for i, obj in enumerate(_elements(fh)):
            where = f"[{i}]"
            if obj is _TOO_DEEP:
                yield 0, where, _too_deep(file, where)
                continue
            if not isinstance(obj, dict):
                yield 0, where, TraceError("expected a conversation object", file=file, key=where)
                continue
            yield 0, where, obj
    except ijson.JSONError as err:
        # yajl's message draws the spot over more lines; its first line says what is wrong.
        first = (str(err).strip().splitlines() or [""])[0]
        raise TraceError(f"not JSON: {first[:120]}", file=file) from None


class _TooDeep:
    """Stands for an array element nested deeper than MAX_DEPTH (whose events were skipped)."""


_TOO_DEEP = _TooDeep()


def _too_deep(file: str, where: str) -> TraceError:
    return TraceError(f"nested more than {MAX_DEPTH} levels deep (a conversation is 4)", file=file, key=where)


def _put(top: dict[str, Any] | list[Any], key: str, value: Any) -> None:
    """Add a parsed value to the container being built: appended to a list, under `key` in a map."""
    if isinstance(top, list):
        top.append(value)
    else:
        top[key] = value


def _elements(fh: IO[bytes]) -> Iterator[Any]:
    """The elements of the JSON array `fh` holds, streamed; _TOO_DEEP for one nested too deep.

    Built here from ijson's event stream, not by ijson.items: its C backend builds an item recursively
    and keeps a prefix string per level, so deep nesting (a few kB of brackets) overflows the C stack,
    a segfault, or takes memory quadratic in the depth (100000 levels: tens of GB). The event parser
    itself keeps its nesting in a flat stack, so a too-deep element is skipped and reading goes on.
    Raises ijson.JSONError for text that is not JSON.
    """
    import ijson

    events = ijson.basic_parse(fh, use_float=True)
    stack: list[dict[str, Any] | list[Any]] = []  # the containers of the element being built
    key = ""
    depth = 0  # containers open, the top-level array included
    for event, value in events:
        if event == "map_key":
            key = value
        elif event in {"start_map", "start_array"}:
            depth += 1
            if depth == 1:  # the top-level array
                continue
            if depth > MAX_DEPTH:
                _skip_element(events, depth)
                depth = 1
                stack.clear()
                yield _TOO_DEEP
                continue
            container: dict[str, Any] | list[Any] = {} if event == "start_map" else []
            if stack:
                _put(stack[-1], key, container)
            stack.append(container)
        elif event in {"end_map", "end_array"}:
            depth -= 1
            if depth:  # depth 0: the top-level array closed (the parser still checks what follows)
                done = stack.pop()
                if not stack:
                    yield done
        elif stack:
            _put(stack[-1], key, value)
        elif depth == 1:  # a scalar element
            yield value


def _skip_element(events: Iterator[tuple[str, Any]], depth: int) -> None:
    """Consume events until the element open at `depth` (> 1) closes, leaving the array at depth 1."""
    for event, _ in events:
        if event in {"start_map", "start_array"}:
            depth += 1
        elif event in {"end_map", "end_array"}:
            depth -= 1
            if depth == 1:
                return


def _line_items(fh: IO[bytes], file: str) -> Iterator[_Item]:
    for line, obj in json_lines(fh, file):
        yield line, "", obj


def _turns(obj: dict[str, Any], file: str, line: int, where: str, opts: Options) -> list[tuple[int, int]]:
    """(input tokens, output tokens) of each assistant turn of one conversation or prompt row."""

    def error(reason: str, key: str) -> TraceError:
        return TraceError(reason, file=file, line=line or None, key=f"{where}.{key}" if where else key)

    if isinstance(obj.get("id"), list | dict):  # becomes the session name; str() of deep nesting recurses
        raise error("expected a string or a number", "id")
    if "prompt" in obj and "conversations" not in obj and "conversation" not in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise error("expected a non-empty string", "prompt")
        out = obj.get("output_tokens", opts.default_output_tokens)
        if isinstance(out, bool) or not isinstance(out, int) or out < 1:
            raise error("expected an integer >= 1", "output_tokens")
        if out > MAX_TOKENS:
            raise error(too_many_tokens(out), "output_tokens")
        tokens = opts.count(prompt)
        if tokens > MAX_TOKENS:
            raise error(too_many_tokens(f"{tokens} tokens"), "prompt")
        return [(tokens, out)]
    key = "conversations" if "conversations" in obj else "conversation"
    messages = obj.get(key)
    if not isinstance(messages, list):
        raise error("expected an array of messages", key)
    context = 0
    pending_user = False
    turns: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise error("expected a message object", f"{key}[{i}]")
        role = message.get("from", message.get("role"))
        text = message.get("value", message.get("content"))
        if not isinstance(role, str):
            raise error("expected a string (from or role)", f"{key}[{i}].from")
        if not isinstance(text, str):
            raise error("expected a string (value or content)", f"{key}[{i}].value")
        role = role.lower()
        if role in _ASSISTANT:
            tokens = opts.count(text) if text else 0
            if pending_user and tokens:
                turns.append((context, tokens))
            context += tokens
            pending_user = False
        elif role in _USER or role in _SYSTEM:
            context += opts.count(text) if text else 0
            pending_user = pending_user or role in _USER
        else:
            raise error(f"unknown role {role[:20]!r}", f"{key}[{i}].from")
        # Every prompt and reply is at most the conversation so far, so this bounds them all.
        if context > MAX_TOKENS:
            raise error(too_many_tokens(f"{context} tokens up to here"), f"{key}[{i}].value")
    return [(max(1, c), o) for c, o in turns]
