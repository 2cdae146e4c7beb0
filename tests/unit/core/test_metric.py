"""Line-protocol encoding of Samples and its inverse."""

from __future__ import annotations

import math

import pytest

from soakd.metric import Sample, parse_line


def test_encoding_types_and_order() -> None:
    s = Sample("gpu", {"b": 1.5, "a": 3, "c": True, "d": "x"}, 123, tags={"gpu": "0", "run_id": "r"})
    assert s.to_line() == 'gpu,gpu=0,run_id=r a=3i,b=1.5,c=true,d="x" 123'


def test_escaping_round_trips() -> None:
    s = Sample(
        "my meas,x",
        {"msg": 'he said "hi", then\\left\nnext', "v=1": 2.0},
        7,
        tags={"host name": "a b,c=d", "empty": ""},
    )
    line = s.to_line()
    assert line is not None
    assert "\n" not in line
    back = parse_line(line)
    assert back.measurement == "my meas,x"
    assert back.tags == {"host name": "a b,c=d"}  # empty tags are not written
    assert back.fields == {"msg": 'he said "hi", then\\left\nnext', "v=1": 2.0}
    assert back.time_ns == 7


def test_non_finite_floats_are_dropped() -> None:
    assert Sample("m", {"a": math.nan}, 1).to_line() is None
    assert Sample("m", {"a": math.inf, "b": 1}, 1).to_line() == "m b=1i 1"


def test_parse_keeps_int_float_bool_distinct() -> None:
    back = parse_line("m a=1i,b=1,c=false,d=-2.5e-3 99\n")
    assert back.fields == {"a": 1, "b": 1.0, "c": False, "d": -0.0025}
    assert isinstance(back.fields["a"], int)
    assert isinstance(back.fields["b"], float)


@pytest.mark.parametrize("bad", ["m a=1", "m 5", "m a=1i,b 3"])
def test_parse_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_line(bad)


def test_fast_and_escaped_paths_agree() -> None:
    samples = [
        Sample("requests", {"ttft_s": 0.25, "index": i, "ok": True}, 10 + i, tags={"status": "ok"})
        for i in range(50)
    ] + [Sample("events", {"message": "a b, c", "n": 1}, 5, tags={"kind": "x y"})]
    for s in samples:
        line = s.to_line()
        assert line is not None
        back = parse_line(line)
        assert (back.measurement, dict(back.tags), dict(back.fields), back.time_ns) == (
            s.measurement,
            dict(s.tags),
            dict(s.fields),
            s.time_ns,
        )
