"""A native trace's sampling parameters are bounded as vLLM's SamplingParams takes them: a value vLLM
would refuse is a trace error naming the file, line and key; a value at its bound, or a parameter
soakd does not know, is kept."""

from __future__ import annotations

from typing import Any

import pytest

from soakd.errors import TraceError
from soakd.traces import native

HEADER = {"format": "soakd-trace", "version": 1, "block_size": 16}


def _one(sampling: dict[str, Any]) -> object:
    rows = [(1, HEADER), (2, {"t": 0, "input_tokens": 4, "output_tokens": 2, "sampling": sampling})]
    (out,) = native.read(rows, "t.jsonl")
    return out


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0},
        {"temperature": 2.0},
        {"top_p": 1},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 50},
        {"min_p": 0, "presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.1},
        {"max_tokens": 1, "min_tokens": 0, "seed": -3},
        {"ignore_eos": True, "some_engine_knob": -1e300},  # unknown to vLLM's bounds: metadata
    ],
)
def test_values_vllm_takes_are_kept(sampling: dict[str, Any]) -> None:
    row = _one(sampling)
    assert not isinstance(row, TraceError), row
    assert dict(row.sampling) == {k: float(v) for k, v in sampling.items()}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("sampling", "key", "says"),
    [
        ({"temperature": -5}, "temperature", "-5 is out of range (vLLM takes [0, 2])"),
        ({"temperature": 2.5}, "temperature", "out of range"),
        ({"temperature": True}, "temperature", "expected a number, got True"),
        ({"top_p": 1e308}, "top_p", "1e+308 is out of range (vLLM takes (0, 1])"),
        ({"top_p": 0}, "top_p", "out of range"),
        ({"top_k": -2}, "top_k", "out of range (vLLM takes >= -1)"),
        ({"top_k": 2.5}, "top_k", "expected an integer, got 2.5"),
        ({"min_p": 1.5}, "min_p", "out of range"),
        ({"presence_penalty": -3}, "presence_penalty", "out of range"),
        ({"repetition_penalty": 0}, "repetition_penalty", "out of range (vLLM takes > 0)"),
        ({"max_tokens": 0}, "max_tokens", "out of range"),
        ({"max_tokens": 10**12}, "max_tokens", "out of range"),
        ({"min_tokens": -1}, "min_tokens", "out of range"),
    ],
)
def test_values_vllm_refuses_name_file_line_and_key(sampling: dict[str, Any], key: str, says: str) -> None:
    err = _one(sampling)
    assert isinstance(err, TraceError)
    assert str(err).startswith(f"t.jsonl:2: sampling.{key}: "), str(err)
    assert says in str(err), str(err)
