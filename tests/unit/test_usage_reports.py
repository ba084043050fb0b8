"""Usage reports (GET /v1/usage in OpenAI's usage-API shape, CSV, `kvserve usage`) and the admin API for
budgets and limits: who sees what, bad input named by field, and a budget set through the API refusing
a request with 429 insufficient_quota."""
from __future__ import annotations

import asyncio
import csv
import io

import httpx
import pytest

from kvserve.config import ServedModel, ServerConfig
from kvserve.metering import reports
from kvserve.store import Store, UsageRecord

DAY = 86400.0
T0 = 1_780_000_000.0 - (1_780_000_000.0 % DAY)  # a UTC midnight


def rec(rid, tenant, model, tier, t, prompt=10, out=5, price=0.001, cost=0.0002, engine=0.5, adapter=None):
    return UsageRecord(request_id=rid, tenant=tenant, model=model, tier=tier, prompt_tokens=prompt,
                       cached_prompt_tokens=2, disk_cached_prompt_tokens=1, host_cached_prompt_tokens=1,
                       completion_tokens=out, created_at=t,
                       price=price, cost=cost, engine_s=engine, adapter=adapter)


def test_buckets_group_and_page(store_target):
    with Store(store_target, scrypt_n=2**10) as store:
        store.record_usage_many([rec("a", "acme", "m1", "interactive", T0 + 10),
                                 rec("b", "acme", "m2", "batch", T0 + 20),
                                 rec("c", "beta", "m1", "interactive", T0 + DAY + 5),
                                 rec("d", "acme", "m1", "interactive", T0 + 2 * DAY + 1, out=7)])
        rows = store.usage.buckets(T0, T0 + 3 * DAY, DAY, ["tenant", "model"])
        p = reports.page(rows, T0, T0 + 3 * DAY, "1d", ["tenant", "model"], 7)
        assert [len(b["results"]) for b in p["data"]] == [2, 1, 1] and not p["has_more"]
        first = p["data"][0]
        assert (first["start_time"], first["end_time"]) == (int(T0), int(T0 + DAY))
        r = first["results"][0]
        assert (r["tenant"], r["model"], r["tier"], r["num_model_requests"], r["input_tokens"],
                r["input_cached_tokens"], r["input_disk_cached_tokens"], r["input_host_cached_tokens"],
                r["output_tokens"]) == ("acme", "m1", None, 1, 10, 2, 1, 1, 5)
        assert r["amount"] == {"value": 0.001, "currency": "usd"} and r["engine_seconds"] == 0.5
        only = reports.page(store.usage.buckets(T0, T0 + 3 * DAY, DAY, [], "acme"), T0, T0 + 3 * DAY, "1d", [], 2)
        assert [b["results"][0]["num_model_requests"] if b["results"] else 0 for b in only["data"]] == [2, 0]
        assert only["has_more"] and only["next_page"] == str(int(T0 + 2 * DAY))
        # the hourly roll-up (aligned ranges) and the rows themselves (any other range) agree
        raw = store.usage.buckets(T0 - 1800, T0 + 3 * DAY, DAY, ["tenant"])
        rolled = store.usage.buckets(T0, T0 + 3 * DAY, DAY, ["tenant"])
        for key in ("requests", "input_tokens", "input_disk_cached_tokens", "output_tokens", "amount",
                    "engine_seconds"):
            assert sum(r[key] for r in raw) == pytest.approx(sum(r[key] for r in rolled))
        lines = list(csv.reader(io.StringIO(reports.to_csv(p))))
        assert tuple(lines[0]) == reports.COLUMNS and len(lines) == 5
        with pytest.raises(ValueError, match="group_by"):
            store.usage.buckets(T0, T0 + DAY, DAY, ["color"])


def test_buckets_group_by_adapter(store_target):
    """A LoRA adapter's requests are its base model's (model, budgets) and a group of their own by adapter: in
    the ledger and both roll-ups alike, the base model's as adapter None, on SQLite and PostgreSQL."""
    with Store(store_target, scrypt_n=2**10) as store:
        store.record_usage_many([rec("a", "acme", "tiny", "interactive", T0 + 10),
                                 rec("b", "acme", "tiny", "interactive", T0 + 20, out=7, adapter="sql"),
                                 rec("c", "acme", "tiny", "interactive", T0 + 30, out=9, adapter="sql"),
                                 rec("d", "beta", "tiny", "batch", T0 + DAY + 5, adapter="chat"),
                                 rec("e", "acme", "other", "interactive", T0 + DAY + 6)])
        assert store.usage.get("acme", "b").adapter == "sql" and store.usage.get("acme", "a").adapter is None
        rolled = store.usage.buckets(T0, T0 + 2 * DAY, DAY, ["model", "adapter"])  # the daily roll-up
        raw = store.usage.buckets(T0 + 1, T0 + 2 * DAY, DAY, ["model", "adapter"])  # the rows themselves
        hourly = store.usage.buckets(T0, T0 + 2 * DAY, 3600, ["model", "adapter"])
        for rows in (rolled, raw):
            assert [(r["bucket"], r["model"], r["adapter"], r["requests"], r["output_tokens"]) for r in rows] == [
                (0, "tiny", None, 1, 5), (0, "tiny", "sql", 2, 16), (1, "other", None, 1, 5), (1, "tiny", "chat", 1, 5)]
        assert [(r["bucket"], r["model"], r["adapter"], r["requests"]) for r in hourly] == [
            (0, "tiny", None, 1), (0, "tiny", "sql", 2), (24, "other", None, 1), (24, "tiny", "chat", 1)]
        # grouped by model alone, an adapter's requests are its base model's
        by_model = store.usage.buckets(T0, T0 + 2 * DAY, 2 * DAY, ["model"])
        assert {r["model"]: r["requests"] for r in by_model} == {"tiny": 4, "other": 1}
        p = reports.page(rolled, T0, T0 + 2 * DAY, "1d", ["model", "adapter"], 7)
        first = [(r["model"], r["adapter"], r["tenant"], r["num_model_requests"]) for r in p["data"][0]["results"]]
        assert first == [("tiny", None, None, 1), ("tiny", "sql", None, 2)]
        untouched = reports.page(store.usage.buckets(T0, T0 + 2 * DAY, DAY, ["model"]), T0, T0 + 2 * DAY, "1d",
                                 ["model"], 7)
        assert all(r["adapter"] is None for b in untouched["data"] for r in b["results"])
        # two regions' pages merge per adapter too
        merged = reports.merge([p, p])
        assert [(r["adapter"], r["num_model_requests"]) for r in merged["data"][0]["results"]] == [
            (None, 2), ("sql", 4)]
        lines = list(csv.reader(io.StringIO(reports.to_csv(p))))
        assert lines[0][5] == "adapter" and [ln[5] for ln in lines[1:]] == ["", "sql", "", "chat"]
        # the per-tenant totals group by adapter as well
        assert [(r["adapter"], r["requests"]) for r in store.usage_totals("acme", group_by="adapter")] == [
            (None, 2), ("sql", 2)]


def test_the_usage_and_admin_api(tiny_llama_gguf, tmp_path):
    from kvserve.server.app import create_app

    model = ServedModel(id="tiny", source=str(tiny_llama_gguf), role="fast",
                        engine_args=dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=128))
    app = create_app(ServerConfig(models=[model], home=str(tmp_path), auth_cache_ttl_s=0))
    state = app.state.kv

    async def scenario():
        await state.startup()
        try:
            _, acme = await state.store.acreate_tenant("acme")
            _, beta = await state.store.acreate_tenant("beta")
            _, root = await state.store.acreate_tenant("root", admin=True)
            assert await asyncio.to_thread(state.models["tiny"].client.wait_ready, 60)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                def call(token, method, path, **kw):
                    return client.request(method, path, headers={"Authorization": f"Bearer {token}"}, **kw)

                body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3}
                for token in (acme, acme, beta):
                    assert (await call(token, "POST", "/v1/completions", json=body)).status_code == 200
                out = {}
                out["own"] = await call(acme, "GET", "/v1/usage", params={"group_by": "tenant,model"})
                await state.store.arecord_usage(UsageRecord(request_id="lora-1", tenant="acme", model="tiny",
                                                            prompt_tokens=4, completion_tokens=2, adapter="sql"))
                out["adapter"] = await call(acme, "GET", "/v1/usage", params={"group_by": "model,adapter"})
                out["all"] = await call(root, "GET", "/v1/usage", params=[("group_by", "tenant"), ("group_by", "tier")])
                out["csv"] = await call(root, "GET", "/v1/usage", params={"group_by": "tenant", "format": "csv"})
                out["peek"] = await call(acme, "GET", "/v1/usage", params={"tenant": "beta"})
                out["bad_width"] = await call(acme, "GET", "/v1/usage", params={"bucket_width": "1w"})
                out["bad_group"] = await call(acme, "GET", "/v1/usage", params={"group_by": "color"})
                out["not_admin"] = await call(acme, "PUT", "/v1/admin/tenants/acme/budget", json={"amount": 1})
                out["unknown"] = await call(root, "PUT", "/v1/admin/tenants/nobody/budget", json={"amount": 1})
                out["negative"] = await call(root, "PUT", "/v1/admin/tenants/acme/budget", json={"amount": -1})
                out["period"] = await call(root, "PUT", "/v1/admin/tenants/acme/budget",
                                           json={"amount": 1, "period": "week"})
                out["set"] = await call(root, "PUT", "/v1/admin/tenants/acme/budget",
                                        json={"amount": 1e-7, "period": "day"})
                out["refused"] = await call(acme, "POST", "/v1/completions", json=body)
                out["budgets"] = await call(root, "GET", "/v1/admin/budgets")
                out["limits"] = await call(root, "PUT", "/v1/admin/tenants/beta/limits", json={"rpm": 0})
            return out
        finally:
            await state.shutdown()

    out = asyncio.run(scenario())
    own = out["own"].json()
    assert own["object"] == "page" and own["data"][-1]["object"] == "bucket"
    (mine,) = [r for b in own["data"] for r in b["results"]]
    assert mine["tenant"] == "acme" and mine["num_model_requests"] == 2 and mine["output_tokens"] == 6
    assert mine["amount"]["value"] > 0 and mine["engine_seconds"] > 0
    assert out["adapter"].status_code == 200, out["adapter"].text
    by_adapter = {r["adapter"]: r for b in out["adapter"].json()["data"] for r in b["results"]}
    assert set(by_adapter) == {None, "sql"} and by_adapter[None]["num_model_requests"] == 2
    assert by_adapter["sql"]["num_model_requests"] == 1 and by_adapter["sql"]["model"] == "tiny"
    assert by_adapter["sql"]["output_tokens"] == 2 and by_adapter["sql"]["tenant"] is None
    every = {r["tenant"]: r for b in out["all"].json()["data"] for r in b["results"]}
    assert set(every) == {"acme", "beta"} and every["beta"]["tier"] == "interactive"
    assert out["csv"].headers["content-type"].startswith("text/csv") and "acme" in out["csv"].text
    for key, status, param in [("peek", 403, "tenant"), ("bad_width", 400, "bucket_width"),
                               ("bad_group", 400, "group_by"), ("not_admin", 403, None), ("unknown", 404, "tenant"),
                               ("negative", 400, "amount"), ("period", 400, "period"), ("limits", 400, "rpm")]:
        r = out[key]
        assert r.status_code == status, (key, r.text)
        assert r.json()["error"]["param"] == param, (key, r.text)
    assert out["set"].status_code == 200 and out["set"].json()["remaining"] == pytest.approx(1e-7)
    refused = out["refused"]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
    message = refused.json()["error"]["message"]
    assert "budget of tenant acme" in message
    assert "has $0.0000001 left of $0.0000001" in message, message  # not "$0.000000 left"
    assert [b["tenant"] for b in out["budgets"].json()["data"]] == ["acme"]
