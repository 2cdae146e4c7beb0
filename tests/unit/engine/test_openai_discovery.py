"""What an attached server says about itself is checked against physical bounds: a vocabulary or a
context window no model has is not believed (it would size prompts and tables), the real vocabulary is
found by probing instead. The server here is a fake on loopback that lies where a broken proxy might."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from soakd.config import EngineConfig
from soakd.engine.openai_http import OpenAIEngine
from soakd.testing import serving

REAL_VOCAB = 3000


@pytest.fixture
async def lying_server() -> AsyncIterator[str]:
    async def health(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 10**15}]})

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def tokenizer_info(_: web.Request) -> web.Response:
        return web.json_response({"vocab_size": 10**12, "added_tokens_decoder": {"0": {}}})

    async def completions(request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        if max(body["prompt"]) >= REAL_VOCAB:
            return web.Response(status=400, text="Token id is out of vocabulary")
        return web.json_response({"choices": [{"text": "x"}], "usage": {"completion_tokens": 1}})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_post("/v1/completions", completions)
    async with serving(app) as url:
        yield url


async def test_a_vocabulary_and_context_no_model_has_are_not_believed(lying_server: str) -> None:
    engine = OpenAIEngine(
        EngineConfig.model_validate({"kind": "openai", "url": lying_server, "max_model_len": 4096})
    )
    await engine.start()
    try:
        info = engine.info
        assert info.vocab_size == REAL_VOCAB  # bisected, not 10**12
        assert info.details["vocab_source"].startswith("probe")
        assert info.max_model_len == 4096  # the config's, not 10**15
        assert info.details["max_model_len_source"].startswith("engine.max_model_len")
        assert info.reserved_ids == (0,)
    finally:
        await engine.stop()
