"""The one metric type that flows through every stage, and its InfluxDB line-protocol form."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

FieldValue = float | int | bool | str

# A backslash in a name is escaped too, or one before a space, comma or "n" would change the line's
# meaning (InfluxDB reads a doubled backslash as one).
_MEAS_ESC = str.maketrans({",": r"\,", " ": r"\ ", "\n": r"\n", "\\": r"\\"})
_TAG_ESC = str.maketrans({",": r"\,", " ": r"\ ", "=": r"\=", "\n": r"\n", "\\": r"\\"})
_STR_ESC = str.maketrans({'"': r"\"", "\\": r"\\", "\n": r"\n"})


@dataclass(frozen=True, slots=True)
class Sample:
    """One point: a measurement with tags (indexed strings) and fields (values) at a time.

    A field keeps one type forever (InfluxDB rejects a change): integers are counters and sizes,
    floats are rates, ratios and durations. Non-finite floats are dropped at encoding time, since
    line protocol has no NaN.
    """

    measurement: str
    fields: Mapping[str, FieldValue]
    time_ns: int
    tags: Mapping[str, str] = field(default_factory=dict)

    def to_line(self) -> str | None:
        """Line protocol for this sample, or None when no field has a value that can be written."""
        parts: list[str] = []
        for key in sorted(self.fields):
            value = self.fields[key]
            enc = _encode_field(value)
            if enc is not None:
                parts.append(f"{key.translate(_TAG_ESC)}={enc}")
        if not parts:
            return None
        head = self.measurement.translate(_MEAS_ESC)
        for key in sorted(self.tags):
            value = self.tags[key]
            if value != "":
                head += f",{key.translate(_TAG_ESC)}={value.translate(_TAG_ESC)}"
        return f"{head} {','.join(parts)} {self.time_ns}"


def _encode_field(value: FieldValue) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value}i"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else None
    return '"' + value.translate(_STR_ESC) + '"'


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)


def _split_unescaped(text: str, sep: str, *, strings: bool = True) -> list[str]:
    """`text` split at each unescaped `sep`, and with `strings` not inside a string field value.

    A double quote opens a string only right after a field's `=`: in a measurement, tag or field key
    it is an ordinary character.
    """
    out: list[str] = []
    cur: list[str] = []
    i = 0
    in_str = False
    prev = ""
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text):
            cur.append(text[i : i + 2])
            i += 2
            prev = ""
            continue
        if ch == '"' and strings and (in_str or prev == "="):
            in_str = not in_str
        prev = ch
        if ch == sep and not in_str:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
        i += 1
    out.append("".join(cur))
    return out


def _decode_field(text: str) -> FieldValue:
    if text.startswith('"'):
        return _unescape(text[1:-1])
    if text in ("true", "t", "T", "True", "TRUE"):
        return True
    if text in ("false", "f", "F", "False", "FALSE"):
        return False
    if text.endswith("i"):
        return int(text[:-1])
    return float(text)


def _parse_plain(line: str) -> Sample:
    """Fast path for lines with no escapes and no string fields (most of a spool): plain splits."""
    sections = line.split(" ")
    if len(sections) != 3:
        raise ValueError(f"expected 'measurement,tags fields time', got {len(sections)} parts")
    head, body, ts = sections
    head_parts = head.split(",")
    tags: dict[str, str] = {}
    for item in head_parts[1:]:
        key, _, value = item.partition("=")
        tags[key] = value
    fields: dict[str, FieldValue] = {}
    for item in body.split(","):
        key, sep, value = item.partition("=")
        if not sep or "=" in value:
            raise ValueError(f"bad field {item!r}")
        fields[key] = _decode_field(value)
    return Sample(measurement=head_parts[0], fields=fields, time_ns=int(ts), tags=tags)


def parse_line(line: str) -> Sample:
    """Parse one line-protocol line written by `Sample.to_line` (used to read the spool back).

    Raises ValueError on a malformed line.
    """
    line = line.rstrip("\n")
    if "\\" not in line and '"' not in line:
        return _parse_plain(line)
    # Measurement and tags end at the first unescaped space; quotes there are ordinary characters.
    head = _split_unescaped(line, " ", strings=False)[0]
    sections = _split_unescaped(line[len(head) + 1 :], " ")
    if line[len(head) : len(head) + 1] != " " or len(sections) != 2:
        raise ValueError("expected 'measurement,tags fields time'")
    body, ts = sections
    head_parts = _split_unescaped(head, ",", strings=False)
    tags: dict[str, str] = {}
    for item in head_parts[1:]:
        kv = _split_unescaped(item, "=", strings=False)
        if len(kv) != 2:
            raise ValueError(f"bad tag {item!r}")
        tags[_unescape(kv[0])] = _unescape(kv[1])
    fields: dict[str, FieldValue] = {}
    for item in _split_unescaped(body, ","):
        kv = _split_unescaped(item, "=")
        if len(kv) != 2:
            raise ValueError(f"bad field {item!r}")
        fields[_unescape(kv[0])] = _decode_field(kv[1])
    return Sample(measurement=_unescape(head_parts[0]), fields=fields, time_ns=int(ts), tags=tags)


def counter_growth(prev: int, cur: int) -> tuple[int, bool]:
    """Growth of a monotonic counter between two reads, and whether it restarted in between.

    A counter lower than before restarted from zero (a driver reload, a CPU brought back online), so
    its growth since then is its value."""
    if cur < prev:
        return cur, True
    return cur - prev, False
