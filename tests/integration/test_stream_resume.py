"""Resuming a stream from the client's Last-Event-ID (service/resume.py), with real servers: two servers of
the same model and tenant (two regions); a stream cut at any event and resumed on the other server gives the
rest, so the client's text is the uninterrupted stream's, no token twice or lost (greedy and seeded); also after
the first server is killed mid-stream. On the server that still has the stream (Idempotency-Key), a reconnect
gets only the events after its Last-Event-ID. A resume token that does not match the tokens generated again is
a 409, a malformed one a 400; a request that cannot be generated again exactly, or sent without an
Idempotency-Key, carries no ids."""
from __future__ import annotations

import json
import uuid

import httpx
import pytest

from kvserve.store.tenants import mint_token
from tests.live_server import LiveServer, start_all, tiny_model_toml

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_llama_gguf):
    minted = mint_token()
    out = []
    for name in ("a", "b"):
        home = tmp_path_factory.mktemp(name)
        out.append(LiveServer(home, tiny_model_toml(tiny_llama_gguf), minted=minted))
    start_all(out)
    yield out
    for s in out:
        s.stop()


def body(**kw) -> dict:
    return {"model": "tiny", "prompt": "resume me", "max_tokens": 40, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **kw}


def events(server: LiveServer, data: dict, **headers) -> tuple[int, list[tuple[str | None, dict | str]]]:
    """(status, [(event id, payload)]) of one streamed request, with an Idempotency-Key of its own unless given
    one (a reconnecting client sends one: the server sends resume ids only then)."""
    headers.setdefault("Idempotency-Key", f"resume-{uuid.uuid4()}")
    headers = {k: v for k, v in headers.items() if v is not None}
    out: list[tuple[str | None, dict | str]] = []
    with httpx.stream("POST", server.base + "/v1/completions", json=data, headers=server.headers(**headers),
                      timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [(None, r.json())]
        event_id = None
        for line in r.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                payload = line[6:]
                out.append((event_id, payload if payload == "[DONE]" else json.loads(payload)))
                event_id = None
    return 200, out


def usage_of(evs) -> dict:
    return next(p["usage"] for _, p in evs if isinstance(p, dict) and p.get("usage"))


def text_of(evs) -> str:
    return "".join(p["choices"][0]["text"] for _, p in evs if isinstance(p, dict) and p.get("choices"))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
def test_a_stream_cut_anywhere_resumes_on_another_server_with_the_rest(servers, sampling):
    a, b = servers
    status, full = events(a, body(**sampling))
    assert status == 200 and full[-1][1] == "[DONE]"
    ids = [(k, e) for k, (e, _) in enumerate(full) if e is not None]
    assert len(ids) >= 5
    for k, event_id in ids[:: max(1, len(ids) // 4)]:
        status, rest = events(b, body(**sampling), **{"Last-Event-ID": event_id})
        assert status == 200, rest
        assert text_of(full[:k + 1]) + text_of(rest) == text_of(full)
        assert rest[-1][1] == "[DONE]"
        count = int(event_id.split(".")[1])  # usage (and billing) here: the tokens this server sent
        assert usage_of(rest)["completion_tokens"] == usage_of(full)["completion_tokens"] - count


def test_a_stream_resumes_on_another_server_after_the_first_died_mid_stream(servers, tmp_path, tiny_llama_gguf):
    _, b = servers
    _, reference = events(b, body(max_tokens=60))
    doomed = LiveServer(tmp_path, tiny_model_toml(tiny_llama_gguf), tenant="acme").start()
    got, last = [], None
    with httpx.stream("POST", doomed.base + "/v1/completions", json=body(max_tokens=60),
                      headers=doomed.headers(**{"Idempotency-Key": "resume-doomed"}), timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: {"):
                got.append(json.loads(line[6:]))
                if last is not None and len(got) >= 5:
                    doomed.kill()
                    break
    status, rest = events(b, body(max_tokens=60), **{"Last-Event-ID": last})
    assert status == 200
    upto = int(last.split(".")[1])
    assert upto >= 1
    prefix = "".join(p["choices"][0]["text"] for p in got if p.get("choices"))
    assert prefix + text_of(rest) == text_of(reference)


def test_a_reconnect_to_the_server_that_has_the_stream_gets_only_what_it_missed(servers):
    a, _ = servers
    key = {"Idempotency-Key": "resume-same-server-1"}
    _, full = events(a, body(max_tokens=30), **key)
    ids = [(k, e) for k, (e, _) in enumerate(full) if e is not None]
    k, event_id = ids[len(ids) // 2]
    status, rest = events(a, body(max_tokens=30), **key, **{"Last-Event-ID": event_id})
    assert status == 200 and rest == full[k + 1:]


def test_bad_resume_tokens_are_refused_and_unresumable_streams_carry_no_ids(servers):
    a, b = servers
    _, full = events(a, body())
    event_id = next(e for e, _ in full if e is not None)
    version, count, digest = event_id.split(".")
    wrong = f"{version}.{count}.{'0' * 16 if digest != '0' * 16 else '1' * 16}"
    status, err = events(b, body(), **{"Last-Event-ID": wrong})
    assert status == 409 and err[0][1]["error"]["code"] == "resume_mismatch"
    status, err = events(b, body(), **{"Last-Event-ID": "nope"})
    assert status == 400 and err[0][1]["error"]["code"] == "invalid_last_event_id"
    _, unseeded = events(a, body(temperature=1.0))
    assert all(e is None for e, _ in unseeded)
    _, keyless = events(a, body(), **{"Idempotency-Key": None})  # no key: every event one data line (vLLM's client)
    assert keyless[-1][1] == "[DONE]" and all(e is None for e, _ in keyless)
    status, err = events(b, body(temperature=1.0), **{"Last-Event-ID": event_id})
    assert status == 400 and err[0][1]["error"]["code"] == "not_resumable"
