"""Models loaded by demand through `kvserve serve` with the real `openai` client: three tiny models with
`load = "on_demand"` and model memory for two. Requests to each in turn are all answered (the least recently used
idle model unloaded to make room); a model with a call open is never unloaded under it; requests to all three at
once are all answered; with no wait, a cold model's first request is a 503 model_warming with Retry-After, and it is
served once loaded; an admin pins, unloads and loads; an admin puts a model to sleep and the next request wakes it
with the same tokens."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.store.tenants import mint_token
from tests.live_server import LiveServer

pytestmark = pytest.mark.timeout(600)
KV = 4 << 20
PROMPT = [17, 2054, 931, 4011, 88, 7, 12500, 301]


def _toml(path, names, wait: float) -> tuple[str, str]:
    room = int(2.5 * (path.stat().st_size + KV))  # two models' files and KV pools, not three
    models = "".join(f'[[models]]\nid = "{n}"\nsource = "{path}"\ndtype = "float32"\nmax_model_len = 256\n'
                     f'kv_cache_memory = {KV}\nload = "on_demand"\n' for n in names)
    return models, f"model_memory = {room}\nload_wait_s = {wait}\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_gguf_path):
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    path = tmp_path_factory.mktemp("demand") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(quant="F32"), str(smollm2_gguf_path))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny):
    models, server = _toml(tiny, ["a", "b", "c"], wait=60)
    srv = LiveServer(tmp_path_factory.mktemp("demand-home"), models, server_toml=server,
                     admin_minted=mint_token()).start()
    yield srv
    srv.stop()


def _states(srv) -> dict[str, str]:
    return {m.id: m.model_extra["status"] for m in srv.openai().models.list().data}


def _ask(srv, model: str, tokens: int = 4) -> str:
    out = srv.openai().completions.create(model=model, prompt=PROMPT, max_tokens=tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == tokens
    return out.choices[0].text


def test_each_model_in_turn_is_answered_and_the_least_recently_used_makes_room(served):
    assert _states(served) == {"a": "unloaded", "b": "unloaded", "c": "unloaded"}
    assert httpx.get(f"{served.base}/ready").status_code == 200  # unloaded by demand is not unready
    text = _ask(served, "a")
    _ask(served, "b")
    assert _states(served) == {"a": "ready", "b": "ready", "c": "unloaded"}
    _ask(served, "c")
    assert _states(served) == {"a": "unloaded", "b": "ready", "c": "ready"}
    assert _ask(served, "a") == text  # loaded again, the same weights' tokens
    assert _states(served) == {"a": "ready", "b": "unloaded", "c": "ready"}
    card = next(m for m in served.openai().models.list().data if m.id == "a")
    assert card.model_extra["load"] == "on_demand" and card.model_extra["load_seconds"] > 0


def test_a_model_with_a_call_open_is_not_unloaded_under_it(served):
    client = served.openai()
    stream = client.completions.create(model="a", prompt=PROMPT, max_tokens=120, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)  # a's call is open, and a is now the least recently used as c and b come
    _ask(served, "c")
    _ask(served, "b")  # room is made from c, idle, not from a
    assert _states(served) == {"a": "ready", "b": "ready", "c": "unloaded"}
    rest = list(chunks)
    assert rest and rest[-1].choices[0].finish_reason == "length"


def test_requests_to_every_model_at_once_are_all_answered(served):
    with ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(lambda m: _ask(served, m, 8), ["a", "b", "c", "c", "a", "b", "c", "a", "b"]))
    assert len(texts) == 9 and all(texts)


def test_an_admin_pins_unloads_and_loads(served):
    admin = served.headers(served.admin_token)
    base = f"{served.base}/v1/admin/models"
    _ask(served, "a")
    _ask(served, "b")
    assert httpx.post(f"{base}/a/pin", json={"pinned": True}, headers=admin).json()["pinned"] is True
    _ask(served, "b")
    _ask(served, "c")  # a is the least recently used, but pinned: b goes
    assert _states(served) == {"a": "ready", "b": "unloaded", "c": "ready"}
    assert httpx.post(f"{base}/a/pin", json={"pinned": False}, headers=admin).status_code == 200
    r = httpx.post(f"{base}/c/unload", headers=admin, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "unloaded", r.text
    r = httpx.post(f"{base}/b/load", headers=admin, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text
    assert httpx.post(f"{base}/b/unload", headers=served.headers()).status_code == 403
    assert httpx.post(f"{base}/nope/load", headers=admin).status_code == 404


def test_an_admin_puts_a_model_to_sleep_and_a_request_wakes_it(served):
    admin = served.headers(served.admin_token)
    base = f"{served.base}/v1/admin/models"
    text = _ask(served, "a")
    r = httpx.post(f"{base}/a/sleep", headers=admin, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "sleeping" and r.json()["freed_kv_bytes"] > 0, r.text
    assert _states(served)["a"] == "sleeping" and httpx.get(f"{served.base}/ready").status_code == 200
    assert _ask(served, "a") == text  # woken by the request: the same weights' tokens
    assert _states(served)["a"] == "ready"
    httpx.post(f"{base}/a/sleep", headers=admin, timeout=60).raise_for_status()
    r = httpx.post(f"{base}/a/wake", headers=admin, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text
    stream = iter(served.openai().completions.create(model="a", prompt=PROMPT, max_tokens=60, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True}))
    next(stream)
    r = httpx.post(f"{base}/a/sleep", headers=admin, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_busy", r.text
    assert len("".join(c.choices[0].text for c in stream)) > 0
    assert httpx.post(f"{base}/a/sleep", headers=served.headers()).status_code == 403


def test_without_a_wait_a_cold_model_answers_503_warming_then_serves(tmp_path_factory, tiny):
    models, server = _toml(tiny, ["x"], wait=0)
    srv = LiveServer(tmp_path_factory.mktemp("demand-cold"), models, server_toml=server).start()
    try:
        body = {"model": "x", "prompt": PROMPT, "max_tokens": 2}
        r = httpx.post(f"{srv.base}/v1/completions", json=body, headers=srv.headers(), timeout=60)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_warming", r.text
        assert int(r.headers["retry-after"]) >= 1
        deadline = time.monotonic() + 60
        while (r := httpx.post(f"{srv.base}/v1/completions", json=body, headers=srv.headers(),
                               timeout=60)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
