"""The trace recorder as a proxy in front of a real vLLM api_server (CPU build, tiny model): clients get
what the server would have sent them, and the trace holds one native record per served request, with
the server's token counts and prefix block ids that match where prompts share a prefix."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from servers import Server

from soakd.config import TraceConfig
from soakd.errors import UsageError
from soakd.traces.loader import open_trace
from soakd.traces.model import RequestSpec
from soakd.traces.record import RecorderStats, serve_recorder

pytestmark = pytest.mark.integration

BLOCK = 16
VOLATILE = {"id", "created"}


@dataclass
class Proxy:
    url: str
    out: Path
    stop: asyncio.Event
    task: asyncio.Task[RecorderStats]

    async def finish(self) -> RecorderStats:
        self.stop.set()
        return await self.task


@pytest.fixture
async def proxy(vllm_server: Server, tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Proxy]:
    record_prompts = bool(getattr(request, "param", False))
    out = tmp_path / "recorded.jsonl"
    stop = asyncio.Event()
    port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        serve_recorder(
            "127.0.0.1",
            0,
            vllm_server.url,
            out,
            block_size=BLOCK,
            record_prompts=record_prompts,
            stop=stop,
            ready=port.set_result,
        )
    )
    either: list[asyncio.Future[Any]] = [task, port]
    await asyncio.wait(either, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        task.result()  # raises why it did not start
    p = Proxy(f"http://127.0.0.1:{port.result()}", out, stop, task)
    yield p
    if not task.done():
        await p.finish()


def scrub(doc: Any) -> Any:
    """A response without the fields that differ between any two calls (ids, creation times)."""
    if isinstance(doc, dict):
        return {k: scrub(v) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [scrub(v) for v in doc]
    return doc


def events(body: bytes) -> list[Any]:
    """The data payloads of an event stream, JSON-decoded where they are JSON."""
    out: list[Any] = []
    for block in body.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        out.append(data if data == "[DONE]" else scrub(json.loads(data)))
    return out


def stream_summary(body: bytes) -> dict[str, Any]:
    """What a client makes of a stream, whatever the chunking (the server may merge tokens into one chunk
    when its output gets ahead): the text, how each choice finished, usage, fingerprint, the end."""
    evs = events(body)
    text: dict[int, str] = {}
    finish: dict[int, str] = {}
    for e in evs:
        if not isinstance(e, dict):
            continue
        for c in e["choices"]:
            piece = c["text"] if "text" in c else c["delta"].get("content") or ""
            text[c["index"]] = text.get(c["index"], "") + piece
            if c.get("finish_reason") is not None:
                finish[c["index"]] = c["finish_reason"]
    dicts = [e for e in evs if isinstance(e, dict)]
    return {
        "text": text,
        "finish": finish,
        "usage": [e["usage"] for e in dicts if "usage" in e],
        "usage_only_chunks": sum(1 for e in dicts if e["choices"] == []),
        "fingerprints": [e["system_fingerprint"] for e in dicts if "system_fingerprint" in e],
        "objects": {(e["object"], e["model"]) for e in dicts},
        "done_last": evs[-1] == "[DONE]" and evs.count("[DONE]") == 1,
    }


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], **headers: str
) -> tuple[int, bytes]:
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.read()


def read_back(path: Path) -> tuple[list[dict[str, Any]], list[RequestSpec]]:
    """The raw records, and the specs soakd's own trace loader makes of the file."""
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert rows[0] == {"format": "soakd-trace", "version": 1, "block_size": BLOCK}
    trace = open_trace(TraceConfig.model_validate({"path": str(path), "format": "native"}), Path, seed=0)
    return rows[1:], list(trace)


def completion(prompt: object, **kw: object) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "seed": 3, **kw}


def chat(text: str, **kw: object) -> dict[str, Any]:
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": text}]
    return {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0.0, **kw}


async def test_proxy_passes_answers_through_and_records_them(proxy: Proxy, vllm_server: Server) -> None:
    shared = "The quick brown fox jumps over the lazy dog near the river bank. " * 8
    cases: list[tuple[str, dict[str, Any], dict[str, str]]] = [
        ("/v1/completions", completion("Once upon a time", stream=True), {}),
        ("/v1/completions", completion("Once upon a time"), {"X-Session-Id": "s1"}),
        ("/v1/chat/completions", chat("Name three colours.", stream=True), {"X-Session-Id": "s1"}),
        ("/v1/chat/completions", chat("Name three colours."), {}),
        # The client asked for usage itself: it keeps it.
        (
            "/v1/completions",
            completion("Twice upon a time", stream=True, stream_options={"include_usage": True}),
            {},
        ),
        ("/v1/completions", completion(shared + "What follows?", top_p=0.9, ignore_eos=True), {}),
        ("/v1/completions", completion(shared + "And then what happened?", min_tokens=12), {}),
    ]
    usages: list[dict[str, int]] = []
    async with aiohttp.ClientSession() as session:
        for path, body, headers in cases:
            status_direct, direct = await post(session, vllm_server.url + path, body)
            status_proxied, proxied = await post(session, proxy.url + path, body, **headers)
            assert status_direct == status_proxied == 200
            if body.get("stream"):
                assert stream_summary(proxied) == stream_summary(direct), path
                usage_source = [e for e in events(direct) if isinstance(e, dict) and e.get("usage")]
            else:
                assert scrub(json.loads(proxied)) == scrub(json.loads(direct)), path
                usage_source = [json.loads(direct)]
            if usage_source:
                usages.append(usage_source[-1]["usage"])
            else:
                # Streams without usage: the server's count from the same request, non-streaming.
                _, again = await post(session, vllm_server.url + path, {**body, "stream": False})
                usages.append(json.loads(again)["usage"])
        # Everything else passes through unchanged.
        async with session.get(proxy.url + "/v1/models") as resp:
            assert resp.status == 200
            assert [m["id"] for m in (await resp.json())["data"]] == ["tiny"]
        async with session.get(proxy.url + "/health") as resp:
            assert resp.status == 200
        tokenized = []
        for text in (shared + "What follows?", shared + "And then what happened?"):
            async with session.post(vllm_server.url + "/tokenize", json={"prompt": text}) as resp:
                tokenized.append((await resp.json())["tokens"])
    stats = await proxy.finish()
    assert stats.requests == stats.recorded == len(cases)
    assert stats.failed == stats.untokenized == stats.write_errors == 0
    assert stats.passthrough == 2

    records, specs = read_back(proxy.out)
    assert len(records) == len(specs) == len(cases)
    assert [r["t"] for r in records] == sorted(r["t"] for r in records)
    for record, usage, (path, body, _) in zip(records, usages, cases, strict=True):
        assert record["input_tokens"] == usage["prompt_tokens"]
        assert record["output_tokens"] == usage["completion_tokens"]
        assert len(record["hash_ids"]) == -(-record["input_tokens"] // BLOCK)
        assert record["api"] == ("chat" if "chat" in path else "completions")
        assert record["sampling"]["max_tokens"] == body["max_tokens"]
        assert record["sampling"]["temperature"] == 0.0
        assert "prompt" not in record
    assert records[5]["sampling"] == {
        "temperature": 0.0,
        "top_p": 0.9,
        "max_tokens": 12,
        "seed": 3,
        "ignore_eos": True,
    }
    assert [(r.get("session"), r.get("turn")) for r in records[:3]] == [(None, None), ("s1", 0), ("s1", 1)]

    # The two prompts with a shared opening: equal leading blocks for exactly the tokens they share.
    a, b = tokenized
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    shared_blocks = common // BLOCK
    assert shared_blocks >= 4
    ids_a, ids_b = records[5]["hash_ids"], records[6]["hash_ids"]
    assert ids_a[:shared_blocks] == ids_b[:shared_blocks]
    assert ids_a[shared_blocks] != ids_b[shared_blocks]
    # Unrelated prompts share nothing.
    assert not set(records[0]["hash_ids"]) & set(ids_a)
    # soakd's reader takes them as written.
    assert specs[5].hash_ids == tuple(ids_a)
    assert dict(specs[5].sampling)["top_p"] == 0.9
    assert specs[2].session == "s1" and specs[2].turn == 1


@pytest.mark.parametrize("proxy", [True], indirect=True)
async def test_prompts_are_recorded_only_when_asked(proxy: Proxy) -> None:
    async with aiohttp.ClientSession() as session:
        status, _ = await post(session, proxy.url + "/v1/completions", completion([5, 6, 7, 8, 9]))
        assert status == 200
        status, _ = await post(session, proxy.url + "/v1/chat/completions", chat("Hello.", stream=True))
        assert status == 200
    await proxy.finish()
    records, _ = read_back(proxy.out)
    assert records[0]["prompt"] == [5, 6, 7, 8, 9]
    assert records[0]["input_tokens"] == 5 and len(records[0]["hash_ids"]) == 1
    assert records[1]["prompt"] == chat("Hello.")["messages"]


async def test_refused_requests_pass_through_and_are_not_recorded(proxy: Proxy, vllm_server: Server) -> None:
    bad = [completion("x", model="nope"), completion([7] * 2100, stream=True)]
    async with aiohttp.ClientSession() as session:
        for body in bad:
            direct = await post(session, vllm_server.url + "/v1/completions", body)
            proxied = await post(session, proxy.url + "/v1/completions", body)
            assert proxied[0] == direct[0] and proxied[0] >= 400
            assert scrub(json.loads(proxied[1])) == scrub(json.loads(direct[1]))
        assert (await post(session, proxy.url + "/v1/completions", completion("fine")))[0] == 200
    stats = await proxy.finish()
    assert stats.failed == 2 and stats.recorded == 1
    records, _ = read_back(proxy.out)
    assert len(records) == 1


@pytest.mark.xfail(
    strict=False,
    reason="known intermittent bug, open: in full-suite runs on two loaded cores the proxy noticed the "
    "client gone ~6 s late and the server still generated all 1,900 tokens (2 of 3 recent runs; passes "
    "alone); closing instead of releasing the upstream response did not cure it",
)
async def test_client_leaving_mid_stream_aborts_upstream(proxy: Proxy, vllm_server: Server) -> None:
    def metric(name: str) -> float:
        text = httpx.get(vllm_server.url + "/metrics", timeout=10).text
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name + "{"))

    asked = 1900
    generated_before = metric("vllm:generation_tokens_total")
    body = completion([3] * 10, max_tokens=asked, stream=True, ignore_eos=True)
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/v1/completions", json=body) as resp,
    ):
        await resp.content.readany()
        resp.close()  # the client goes away
    # Scraping /metrics while the server streams can hold its event loop up (seen on two cores), so the
    # first scrape waits a moment; the request would run for seconds more if not aborted.
    await asyncio.sleep(1.0)
    deadline = asyncio.get_running_loop().time() + 60  # a hang guard: the token count below is the proof
    while metric("vllm:num_requests_running") != 0:
        assert asyncio.get_running_loop().time() < deadline, "the server kept generating for nobody"
        await asyncio.sleep(0.1)
    assert metric("vllm:generation_tokens_total") - generated_before < asked
    stats = await proxy.finish()
    assert stats.client_gone == 1 and stats.recorded == 0


async def test_refuses_non_loopback_listen(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="allow-remote"):
        await serve_recorder("0.0.0.0", 0, "http://127.0.0.1:1", tmp_path / "x.jsonl")
    assert not (tmp_path / "x.jsonl").exists()
