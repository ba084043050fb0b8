"""Tenant isolation against a real server (the tiny model): a tenant cannot see another's files, batches,
usage or idempotent responses (404 for ids, so existence does not leak), the prefix cache never reports
another tenant's prompt as cached, admin endpoints refuse tenant tokens, and tokens are stored only as hashes."""
from __future__ import annotations

import httpx
import pytest

from tests.integration.test_batch import Server, jsonl, wait

pytestmark = pytest.mark.slow


@pytest.fixture
def two(tiny_llama_gguf, tmp_path):
    s = Server(tmp_path, tiny_llama_gguf)
    from kvserve.store import Store

    with Store(tmp_path / "kvserve.db") as store:
        other = store.create_tenant("globex")[1]
    s.start()
    yield s, other
    s.stop()


def _h(token: str, **extra) -> dict:
    return {"Authorization": f"Bearer {token}", **extra}


def _not_found(r: httpx.Response) -> None:
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}


def test_files_and_batches_of_another_tenant_are_not_found(two, figures):
    server, other = two
    client = server.openai()
    f = client.files.create(file=("in.jsonl", jsonl(2)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    base = server.base + "/v1"
    for method, path in (("GET", f"/files/{f.id}"), ("GET", f"/files/{f.id}/content"), ("DELETE", f"/files/{f.id}"),
                         ("GET", f"/batches/{b.id}"), ("POST", f"/batches/{b.id}/cancel")):
        theirs = httpx.request(method, base + path, headers=_h(other))
        missing = httpx.request(method, base + path.replace(f.id, "file-0").replace(b.id, "batch_0"),
                                headers=_h(other))
        _not_found(theirs)
        _not_found(missing)
        assert theirs.json()["error"]["code"] == missing.json()["error"]["code"]  # the same answer: no leak
    # another tenant may not start a batch on this tenant's file either: the answer is a missing file's
    create = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}
    theirs = httpx.post(base + "/batches", headers=_h(other), json={**create, "input_file_id": f.id})
    missing = httpx.post(base + "/batches", headers=_h(other), json={**create, "input_file_id": "file-0"})
    assert theirs.status_code == missing.status_code == 400
    assert theirs.json()["error"]["code"] == missing.json()["error"]["code"] == "file_not_found"
    assert f.id not in [x["id"] for x in httpx.get(base + "/files", headers=_h(other)).json()["data"]]
    assert b.id not in [x["id"] for x in httpx.get(base + "/batches", headers=_h(other)).json()["data"]]
    assert wait(client, b.id, ("completed",)).request_counts.completed == 2  # and it ran untouched
    figures.record("isolation", "another tenant's files and batches (read, content, delete, cancel, start a "
                   "batch on them)", "answered as missing ones", "404, the same code as a missing id", True,
                   "nor listed to it")


def test_usage_cache_idempotency_and_admin_are_per_tenant(two, figures):
    server, other = two
    base = server.base + "/v1"
    prompt = "The tenant isolation test prompt, long enough to fill several KV blocks of sixteen tokens each. " * 3
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}

    def cached(token: str) -> int:
        r = httpx.post(base + "/completions", headers=_h(token), json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(server.token) == 0
    assert cached(server.token) > 0  # the same tenant hits its own prefix
    assert cached(other) == 0  # another tenant's identical prompt is not reported as cached
    # idempotency keys are the tenant's own: the same key from another tenant runs its own request
    key = {"Idempotency-Key": "isolation-key-1"}
    mine = httpx.post(base + "/completions", headers=_h(server.token, **key), json=body, timeout=60)
    theirs = httpx.post(base + "/completions", headers=_h(other, **key), json=body, timeout=60)
    assert mine.status_code == theirs.status_code == 200 and mine.json()["id"] != theirs.json()["id"]
    # usage: each tenant sees only its own; asking for another's is refused whether or not it exists
    rows = httpx.get(base + "/usage", headers=_h(other), params={"group_by": "tenant"}).json()["data"]
    tenants = {r["tenant"] for bucket in rows for r in bucket["results"] if r.get("tenant")}
    assert tenants == {"globex"}
    for name in ("acme", "nobody"):
        r = httpx.get(base + "/usage", headers=_h(other), params={"tenant": name})
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    # admin endpoints refuse tenant tokens
    for method, path in (("GET", "/admin/budgets"), ("PUT", "/admin/tenants/acme/budget"),
                         ("PUT", "/admin/tenants/acme/limits")):
        r = httpx.request(method, base + path, headers=_h(other), json={"amount": 1, "period": "day"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", (path, r.text)
    for name, value in (("cached_tokens for a prompt another tenant sent", "0 (the tenant's own repeat: > 0)"),
                        ("the same Idempotency-Key from another tenant", "runs its own request"),
                        ("usage listed to a tenant", "its own only"),
                        ("another tenant's usage, existing or not", "403, the same answer"),
                        ("admin endpoints with a tenant token", "403 permission_error")):
        figures.record("isolation", name, value, "", True)


def test_tokens_are_stored_only_as_hashes(two, figures):
    server, other = two
    data = b"".join(p.read_bytes() for p in server.home.glob("kvserve.db*"))
    assert server.token.encode() not in data and other.encode() not in data
    figures.record("isolation", "tokens in the store's files", "none (hashes only)", "none", True)
