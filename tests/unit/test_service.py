"""The completion service with no HTTP server in front of it (a tiny random GGUF model in an in-process
engine), and the HTTP adapter's handling of an internal error (a 500 in OpenAI's schema with a request
id; the server keeps serving)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from kvserve.config import ServedModel, ServerConfig
from kvserve.engine.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound
from kvserve.service import protocol as p
from kvserve.service.completion import CompletionService
from kvserve.store import AsyncStore


def config(tiny_llama_gguf, tmp_path) -> ServerConfig:
    model = ServedModel(id="tiny", source=str(tiny_llama_gguf), role="fast",
                        engine_args=dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=256))
    return ServerConfig(models=[model], home=str(tmp_path))


async def ready(service: CompletionService) -> None:
    for handle in service.models.values():
        handle.client.start()
        assert await asyncio.to_thread(handle.client.wait_ready, 60)


def test_the_service_completes_streams_refuses_and_writes_usage(tiny_llama_gguf, tmp_path):
    service = CompletionService(config(tiny_llama_gguf, tmp_path))

    async def scenario():
        store = await AsyncStore.aopen(tmp_path / "kv.db")
        service.ledger.open(store, asyncio.get_running_loop())
        await ready(service)
        try:
            req = p.CompletionRequest(model="tiny", prompt=[[1000, 2000, 3000], [5, 6, 7, 8]], max_tokens=6,
                                      temperature=0, n=2)
            c = service.open("completion", req, tenant="acme")
            await service.start(c)
            finals = await c.finals()
            body = c.response(finals)
            assert [ch.index for ch in body.choices] == [0, 1, 2, 3]
            assert all(ch.finish_reason == "length" for ch in body.choices)
            assert body.usage.completion_tokens == 4 * 6 and body.usage.prompt_tokens == 3 + 4
            assert body.choices[0].text == body.choices[1].text  # greedy forks agree

            chat = p.ChatCompletionRequest(model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           priority="batch")
            c2 = service.open("chat", chat, tenant="acme")
            assert c2.handle.id == "tiny" and c2.tier == "batch"
            await service.start(c2)
            chunks = c2.chunks()
            events = list(chunks.opening())
            async for i, out in c2.outputs():
                events += chunks.of(i, out)
            events += chunks.closing()
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
            assert events[0]["choices"][0]["delta"]["role"] == "assistant"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert events[-1]["usage"]["completion_tokens"] == 5
            whole = service.open("chat", chat.model_copy(update={"stream": False}), tenant="acme")
            await service.start(whole)
            assert whole.response(await whole.finals()).choices[0].message.content == text  # greedy: the same

            with pytest.raises(ModelNotFound):
                service.open("completion", p.CompletionRequest(model="nope", prompt="x"), tenant="acme")
            with pytest.raises(ContextLengthExceeded, match="maximum context length is 256"):
                await service.start(service.open("completion", p.CompletionRequest(model="tiny", prompt=[7] * 300),
                                                 tenant="acme"))
            with pytest.raises(InvalidRequest) as bad:
                await service.start(service.open("completion", p.CompletionRequest(model="tiny", prompt=[10 ** 9]),
                                                 tenant="acme"))
            assert bad.value.param == "prompt"

            await service.ledger.flush()
            totals = await store.ausage_totals("acme")
            assert totals[0]["requests"] == 4 and totals[0]["completion_tokens"] == 2 * 2 * 6 + 5 + 5
            from kvserve.metering.prices import request_cost, request_price

            price = service.models["tiny"].spec.price
            for call, tier in ((c, "interactive"), (c2, "batch")):
                row = await asyncio.to_thread(store.store.usage.get, "acme", call.request_ids[0])
                assert row.engine_s > 0 and row.cost == pytest.approx(request_cost(price, row.engine_s))
                assert row.price == pytest.approx(request_price(price, tier, row.prompt_tokens,
                                                                row.cached_prompt_tokens, row.completion_tokens))
        finally:
            for handle in service.models.values():
                await asyncio.to_thread(handle.client.stop)
            await store.aclose()

    asyncio.run(scenario())


def test_an_internal_error_is_a_500_with_a_request_id_and_the_server_keeps_serving(tiny_llama_gguf, tmp_path):
    from kvserve.server.app import create_app

    app = create_app(config(tiny_llama_gguf, tmp_path))
    state = app.state.kv

    async def scenario():
        await state.startup()
        try:
            _, token = await state.store.acreate_tenant("acme")
            handle = state.models["tiny"]
            assert await asyncio.to_thread(handle.client.wait_ready, 60)
            real_submit = handle.client.submit

            async def broken_submit(request):
                if request.prompt_token_ids[:1] == (13,):
                    raise RuntimeError("a bug in the engine client")
                return await real_submit(request)

            handle.client.submit = broken_submit
            auth = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                r = await client.post("/v1/completions", headers=auth,
                                      json={"model": "tiny", "prompt": [13, 14], "max_tokens": 3})
                assert r.status_code == 500
                error = r.json()["error"]
                assert error["type"] == "server_error" and error["code"] == "internal_error"
                assert r.headers["x-request-id"] in error["message"] and "a bug" not in error["message"]
                ok = await client.post("/v1/completions", headers=auth,
                                       json={"model": "tiny", "prompt": [20, 21], "max_tokens": 3, "temperature": 0})
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        finally:
            state.draining = True
            await state.shutdown()

    asyncio.run(scenario())
