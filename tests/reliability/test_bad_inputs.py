"""A hand-written matrix of bad inputs (issue 21) against a real server (a subprocess serving the tiny model):
each one gets its exact 4xx in OpenAI's error schema, {"error": {message, type, param, code}}, with a code
(and where there is one, a param) that says what was wrong; and the server serves on after all of them.

The real `openai` client sends what a client library can send; raw httpx the bytes no library would (bodies
that are not JSON, not UTF-8, too large). The cases marked "regression" were 500s, or killed the engine (every
later request then got 503 model_failed), before the fixes that came with this suite. Batch files with broken
lines: tests/integration/test_batch.py covers duplicate ids, a wrong url, an unknown model and a line that is
not JSON; here, the other ways a line or a file can be broken.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable

import httpx
import openai
import pytest

from tests.live_server import LiveServer, tiny_model_toml

pytestmark = pytest.mark.slow

MAX_FILE_BYTES = 64 * 1024
OTHER = "beta"  # another tenant
RESULTS: dict[str, bool] = {}  # case id -> passed, for the figure


@pytest.fixture(scope="module")
def server(tiny_llama_gguf, tmp_path_factory):
    home = tmp_path_factory.mktemp("bad-inputs")
    s = LiveServer(home, tiny_model_toml(tiny_llama_gguf),
                   f"default_max_tokens = 4\n[batch]\npoll_s = 0.1\nmax_file_bytes = {MAX_FILE_BYTES}\n")
    with s.store() as store:
        store.create_tenant(OTHER)
        s.admin_token = store.create_tenant("root", admin=True)[1]
        s.limited_token = store.create_tenant("limited")[1]
        store.rate_limits.set_limits("limited", 1, None)  # one request a minute
    s.start()
    yield s
    s.stop()


def chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 2, **kw}


def completion(**kw) -> dict:
    return {"model": "tiny", "prompt": "Say hello.", "max_tokens": 2, **kw}


def raw(path: str, content: bytes, token: str | None = None, **headers: str) -> Callable[[LiveServer], httpx.Response]:
    def send(s: LiveServer) -> httpx.Response:
        h = {"Content-Type": "application/json", **headers}
        if token != "":
            h.update(s.headers(token))
        return httpx.post(s.base + path, content=content, headers=h, timeout=60)
    return send


def post(path: str, body: dict, **headers: str) -> Callable[[LiveServer], httpx.Response]:
    return raw(path, json.dumps(body).encode(), **headers)


def sdk(call: Callable[[openai.OpenAI], object], token: str | None = None) -> Callable[[LiveServer], httpx.Response]:
    """Through the openai client: the HTTP response of the error it raises."""
    def send(s: LiveServer) -> httpx.Response:
        try:
            call(s.openai(token))
        except openai.APIStatusError as e:
            return e.response
        raise AssertionError("the openai client got no error")
    return send


def chat_sdk(**kw) -> Callable[[LiveServer], httpx.Response]:
    body = chat(**kw)
    extra = {k: body.pop(k) for k in list(body) if k not in ("model", "messages", "max_tokens", "n", "stop",
                                                              "logprobs", "top_logprobs", "metadata")}
    return sdk(lambda c: c.chat.completions.create(**body, extra_body=extra or None))


def completion_sdk(**kw) -> Callable[[LiveServer], httpx.Response]:
    body = completion(**kw)
    extra = {k: body.pop(k) for k in list(body) if k not in ("model", "prompt", "max_tokens", "n", "stop", "logprobs")}
    return sdk(lambda c: c.completions.create(**body, extra_body=extra or None))


def with_token(token_of: Callable[[LiveServer], str | None], body: dict) -> Callable[[LiveServer], httpx.Response]:
    def send(s: LiveServer) -> httpx.Response:
        return httpx.post(s.base + "/v1/chat/completions", json=body, headers=s.headers(token_of(s)), timeout=60)
    return send


@dataclass
class Case:
    id: str
    send: Callable[[LiveServer], httpx.Response]
    status: int
    code: str | None
    param: str | None = None  # None: not checked
    type: str = "invalid_request_error"


def past_the_rate_limit(s) -> httpx.Response:
    """The limited tenant (one request a minute) asks three times at once: the windows are whole minutes, so
    two calls may straddle a boundary and both pass, but of three at most one boundary falls between them.
    The first refusal, else the last answer."""
    answers = [with_token(lambda s: s.limited_token, chat())(s) for _ in range(3)]
    return next((r for r in answers if r.status_code == 429), answers[-1])


CASES = [
    # ---- the body: size, bytes, JSON -------------------------------------------------------------------------
    Case("oversized body", post("/v1/chat/completions", chat(messages=[{"role": "user", "content": "x" * (2 << 20)}])),
         413, "request_too_large"),
    Case("invalid JSON", raw("/v1/chat/completions", b'{"model": "tiny", "messages": ['), 400, "invalid_json"),
    Case("invalid UTF-8", raw("/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe caf\xe9"}'), 400,
         "invalid_json"),
    Case("unpaired surrogate (regression: 500)",
         raw("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'), 400, "invalid_json"),
    Case("unpaired surrogate in chat (regression: 500)",
         raw("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'),
         400, "invalid_json"),
    Case("NaN, not JSON", raw("/v1/completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}'), 400,
         "invalid_json"),
    Case("Infinity, not JSON", raw("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": Infinity}'), 400,
         "invalid_json"),
    Case("a number past float's range", raw("/v1/completions", b'{"model": "tiny", "prompt": "x", "top_p": 1e400}'),
         400, "invalid_json"),
    Case("empty body", raw("/v1/completions", b""), 400, "invalid_json"),
    Case("a JSON array", raw("/v1/completions", b"[1, 2]"), 400, "invalid_json"),
    Case("a form, not JSON", raw("/v1/completions", b"model=tiny&prompt=x",
                                 **{"Content-Type": "application/x-www-form-urlencoded"}), 400, "invalid_json"),
    # ---- the model and the token counts -----------------------------------------------------------------------
    Case("unknown model", chat_sdk(model="gpt-9"), 404, "model_not_found", "model"),
    Case("missing model", post("/v1/completions", {"prompt": "x"}), 400, "missing_required_parameter", "model"),
    Case("negative max_tokens", chat_sdk(max_tokens=-1), 400, "invalid_value", "max_tokens"),
    Case("zero max_tokens", completion_sdk(max_tokens=0), 400, "invalid_value", "max_tokens"),
    Case("huge max_tokens", chat_sdk(max_tokens=10**9), 400, "context_length_exceeded"),
    Case("max_tokens past 64 bits", post("/v1/completions", completion(max_tokens=10**30)), 400,
         "context_length_exceeded"),
    Case("min_tokens over max_tokens", completion_sdk(min_tokens=5), 400, "invalid_value", "min_tokens"),
    Case("prompt past the context", completion_sdk(prompt="hello " * 400), 400, "context_length_exceeded"),
    Case("chat past the context", chat_sdk(messages=[{"role": "user", "content": "hello " * 400}]), 400,
         "context_length_exceeded"),
    # ---- sampling parameters out of range ---------------------------------------------------------------------
    Case("n = 0", chat_sdk(n=0), 400, "invalid_value", "n"),
    Case("n = 129", completion_sdk(n=129), 400, "invalid_value", "n"),
    Case("prompts x n over 128", completion_sdk(prompt=["a"] * 65, n=2), 400, "invalid_value"),
    Case("logprobs = 21", completion_sdk(logprobs=21), 400, "invalid_value", "logprobs"),
    Case("logprobs = -1", completion_sdk(logprobs=-1), 400, "invalid_value", "logprobs"),
    Case("top_logprobs = 21", chat_sdk(logprobs=True, top_logprobs=21), 400, "invalid_value", "top_logprobs"),
    Case("top_logprobs without logprobs", chat_sdk(top_logprobs=2), 400, "invalid_value"),
    Case("17 stop strings", chat_sdk(stop=[f"s{i}" for i in range(17)]), 400, "invalid_value", "stop"),
    Case("an empty stop string", completion_sdk(stop=["a", ""]), 400, "invalid_value", "stop"),
    Case("temperature 3", chat_sdk(temperature=3), 400, "invalid_value", "temperature"),
    Case("top_k past int32 (regression: the engine died)", completion_sdk(top_k=10**23), 400, "invalid_value",
         "top_k"),
    Case("repetition_penalty 1e-300 (regression: the engine died)", completion_sdk(repetition_penalty=1e-300), 400,
         "invalid_value", "repetition_penalty"),
    Case("stop_token_ids past 64 bits (regression: the engine died)",
         completion_sdk(min_tokens=1, stop_token_ids=[2**64]), 400, "invalid_value", "stop_token_ids[0]"),
    Case("unsupported echo", completion_sdk(echo=True), 400, "invalid_value", "echo"),
    Case("unknown priority", chat_sdk(priority="urgent"), 400, "invalid_value", "priority"),
    Case("logprobs 0 for a boolean (regression: taken as false)", chat_sdk(logprobs=0), 400, "invalid_value",
         "logprobs"),
    Case("n as a string (regression: taken as 2)", post("/v1/completions", completion(n="2")), 400, "invalid_value",
         "n"),
    Case("echo 0 (regression: taken as false)", post("/v1/completions", completion(echo=0)), 400, "invalid_value",
         "echo"),
    Case("user message without content", post("/v1/chat/completions", chat(messages=[{"role": "user"}])), 400,
         "invalid_value", "messages[0]"),
    # ---- token ids --------------------------------------------------------------------------------------------
    Case("token id = vocabulary size", completion_sdk(prompt=[1, 49152]), 400, "invalid_prompt", "prompt"),
    Case("token id 10**6", completion_sdk(prompt=[[5], [10**6]]), 400, "invalid_prompt", "prompt"),
    Case("negative token id", completion_sdk(prompt=[1, -5]), 400, "invalid_value", "prompt"),
    Case("token id past 64 bits", post("/v1/completions", completion(prompt=[10**30])), 400, "invalid_value",
         "prompt"),
    Case("an empty token list", completion_sdk(prompt=[[1], []]), 400, "invalid_value", "prompt"),
    # ---- who is asking ----------------------------------------------------------------------------------------
    Case("wrong token", sdk(lambda c: c.chat.completions.create(**chat()), token="kvs-not-a-real-token-0000000000"),
         401, "invalid_api_key"),
    Case("missing token", raw("/v1/chat/completions", json.dumps(chat()).encode(), token=""), 401, "invalid_api_key"),
    Case("not a bearer token", raw("/v1/chat/completions", json.dumps(chat()).encode(), token="",
                                   Authorization="Basic YWNtZTpzZWNyZXQ="), 401, "invalid_api_key"),
    Case("metadata.tenant_id of another tenant", chat_sdk(metadata={"tenant_id": OTHER}), 403, "tenant_mismatch",
         "metadata.tenant_id", "permission_error"),
    Case("metadata.tenant_id not a string", post("/v1/chat/completions", chat(metadata={"tenant_id": 7})), 400,
         "invalid_value", "metadata"),
    Case("an admin route with a tenant's token", lambda s: httpx.put(
        s.base + "/v1/admin/tenants/acme/limits", json={"rpm": 5}, headers=s.headers(), timeout=30), 403,
         "permission_denied", type="permission_error"),
    Case("a tenant past its requests per minute", past_the_rate_limit, 429, "rate_limit_exceeded",
         type="requests"),
    # ---- Idempotency-Key --------------------------------------------------------------------------------------
    Case("empty Idempotency-Key", post("/v1/completions", completion(), **{"Idempotency-Key": ""}), 400,
         "invalid_idempotency_key", "Idempotency-Key"),
    Case("Idempotency-Key of 256 characters", post("/v1/completions", completion(), **{"Idempotency-Key": "k" * 256}),
         400, "invalid_idempotency_key", "Idempotency-Key"),
    Case("Idempotency-Key with a tab", post("/v1/completions", completion(), **{"Idempotency-Key": "a\tb"}), 400,
         "invalid_idempotency_key", "Idempotency-Key"),
    Case("Idempotency-Key reused with another body", lambda s: [
        post("/v1/completions", completion(prompt=p), **{"Idempotency-Key": "reused-key"})(s) for p in ("a", "b")][-1],
         422, "idempotency_key_reused", "Idempotency-Key"),
    Case("a method the path does not take", lambda s: allow_header(s, "PATCH", "/v1/files", "GET, POST"), 405,
         "method_not_allowed"),
    # ---- files, batches, usage --------------------------------------------------------------------------------
    Case("an empty batch file", lambda s: upload(s, b""), 400, "invalid_value", "file"),
    Case("a batch file of blank lines", lambda s: upload(s, b"\n  \n\n"), 400, "invalid_value", "file"),
    Case("a batch file over the size limit", lambda s: upload(s, b'{"custom_id": "x"}\n' * (MAX_FILE_BYTES // 10)),
         400, "invalid_value", "file"),
    Case("a file with another purpose", lambda s: upload(s, b'{"a": 1}\n', purpose="fine-tune"), 400,
         "invalid_value", "purpose"),
    Case("a form without the file", lambda s: httpx.post(s.base + "/v1/files", headers=s.headers(),
                                                         data={"purpose": "batch"}, timeout=30), 400,
         "missing_required_parameter", "file"),
    Case("a batch of an unknown file", post("/v1/batches", {"input_file_id": "file-nope", "endpoint": "/v1/completions",
                                                            "completion_window": "24h"}), 400, "file_not_found",
         "input_file_id"),
    Case("a batch for another endpoint", post("/v1/batches", {"input_file_id": "file-x", "endpoint": "/v1/embeddings",
                                                              "completion_window": "24h"}), 400, "invalid_value",
         "endpoint"),
    Case("a completion window of 10**400 days (regression: 500)", post("/v1/batches", {
        "input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "9" * 400 + "d"}), 400,
         "invalid_value", "completion_window"),
    Case("usage from NaN (regression: 500)", lambda s: httpx.get(s.base + "/v1/usage?start_time=nan",
                                                                 headers=s.headers(), timeout=30), 400,
         "invalid_value", "start_time"),
    Case("usage until infinity (regression: 500)", lambda s: httpx.get(s.base + "/v1/usage?end_time=1e400",
                                                                       headers=s.headers(), timeout=30), 400,
         "invalid_value", "end_time"),
    Case("a rate limit past 64 bits (regression: 500)", lambda s: httpx.put(
        s.base + "/v1/admin/tenants/beta/limits", json={"tpm": 10**22}, headers=s.headers(s.admin_token),
        timeout=30), 400, "invalid_value", "tpm"),
]


def allow_header(s: LiveServer, method: str, path: str, allow: str) -> httpx.Response:
    """The 405's Allow header names every method of the path (regression: only the first route's)."""
    r = httpx.request(method, s.base + path, headers=s.headers(), timeout=30)
    assert r.headers.get("allow") == allow, r.headers
    return r


def upload(s: LiveServer, data: bytes, purpose: str = "batch") -> httpx.Response:
    return httpx.post(s.base + "/v1/files", headers=s.headers(), data={"purpose": purpose},
                      files={"file": ("in.jsonl", data)}, timeout=60)


def assert_error(r: httpx.Response, status: int, code: str | None, param: str | None = None,
                 type: str = "invalid_request_error") -> dict:
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert err["code"] == code and err["type"] == type, err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(server, case):
    RESULTS[case.id] = False
    assert_error(case.send(server), case.status, case.code, case.param, case.type)
    RESULTS[case.id] = True


def test_a_batch_file_with_broken_lines_fails_naming_them(server):
    RESULTS["batch file with broken lines"] = False
    good = {"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": chat()}

    def line(custom_id: str, **body) -> bytes:
        return json.dumps({**good, "custom_id": custom_id, "body": {**good["body"], **body}}).encode()

    lines = [
        json.dumps(good).encode(),  # 1: fine
        b'{"custom_id": "latin-1", "method": "POST", "body": {"model": "caf\xe9"}}',  # 2: not UTF-8
        b'[{"custom_id": "array"}]',  # 3: a JSON array
        line("negative", max_tokens=-1),  # 4: a body that fails validation
        line("nan").replace(b'"max_tokens": 2', b'"max_tokens": NaN'),  # 5: NaN is not JSON
        line("surrogate", messages=[{"role": "user", "content": "\ud800"}]),  # 6: an unpaired surrogate
        line("streamed", stream=True),  # 7: streaming in a batch
        b"{}",  # 8: no custom_id
        line("post-only").replace(b'"POST"', b'"GET"'),  # 9: another method
    ]
    f = upload(server, b"\n".join(lines) + b"\n")
    assert f.status_code == 200, f.text
    client = server.openai()
    b = client.batches.create(input_file_id=f.json()["id"], endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and b.request_counts.total == 0
    by_line = {e.line: (e.code, e.param) for e in b.errors.data}
    assert by_line == {2: ("invalid_json", None), 3: ("invalid_json", None),
                       4: ("invalid_request", "body.max_tokens"), 5: ("invalid_json", None),
                       6: ("invalid_json", None), 7: ("invalid_value", "body.stream"),
                       8: ("missing_required_parameter", "custom_id"), 9: ("invalid_value", "method")}, by_line
    assert all(e.message and f"line {e.line}" in e.message for e in b.errors.data)
    RESULTS["batch file with broken lines"] = True


def test_zz_the_server_serves_on(server, figures):
    """After every case: healthy, and a good request of each kind succeeds."""
    assert httpx.get(server.base + "/health", timeout=10).json()["status"] == "ok"
    client = server.openai()
    assert client.chat.completions.create(**chat()).choices[0].finish_reason in ("stop", "length")
    assert client.completions.create(**completion()).choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(**chat(), stream=True)
    assert sum(1 for _ in stream) >= 1
    passed = sum(RESULTS.values())
    figures.record("bad inputs", "cases answered with their exact 4xx in the error schema", passed,
                   f"all {len(CASES) + 1}", passed == len(CASES) + 1,
                   ", ".join(k for k, v in RESULTS.items() if not v) or "then a good request succeeds")
