"""Regions (server/regions.py over service/region_routing.py), with real servers: two single-process servers as
two regions, each the other's peer, the same tenant token in both. A region whose model cannot serve forwards
to its peer (streamed back as the peer sends it, the serving region in `x-kvserve-region`); a forwarded request
is never forwarded again; a dead peer is detected within the policy's bound and nothing is sent to it; one that
comes back takes traffic again only after recover_after_s of answered probes. A retry that reaches another
region than the one holding its Idempotency-Key is served by the holder: replayed, or attached, never run twice."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from kvserve.store.tenants import mint_token
from tests.live_server import LiveServer, free_port, start_all, tiny_model_toml

pytestmark = pytest.mark.timeout(600)

PROBE_S, RECOVER_S = 0.2, 1.5


def _regions_toml(local: str, peer: str, port: int) -> str:
    return (f'\n[regions]\nlocal = "{local}"\npeers = [{{name = "{peer}", url = "http://127.0.0.1:{port}"}}]\n'
            f"[regions.policy]\nprobe_period_s = {PROBE_S}\nprobe_timeout_s = 0.5\nstale_after_s = 1.5\n"
            f"recover_after_s = {RECOVER_S}\n")


def _wait(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _peer_health(server: LiveServer, peer: str) -> str:
    return httpx.get(server.base + "/v1/region/status", timeout=2).json()["peers"][peer]


@pytest.fixture
def regions(tmp_path, tiny_llama_gguf):
    """us: its model's file is broken (the pool cannot serve); eu: serves."""
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file" * 100)
    minted = mint_token()
    ports = {"us": free_port(), "eu": free_port()}
    for name in ports:
        (tmp_path / name).mkdir()
    us = LiveServer(tmp_path / "us", tiny_model_toml(broken) + _regions_toml("us", "eu", ports["eu"]),
                    port=ports["us"], minted=minted)
    eu = LiveServer(tmp_path / "eu", tiny_model_toml(tiny_llama_gguf) + _regions_toml("eu", "us", ports["us"]),
                    port=ports["eu"], minted=minted)
    start_all([us, eu], ready_path="/v1/region/status")
    yield us, eu
    for s in (us, eu):
        s.stop()


@pytest.fixture
def two_regions(tmp_path, tiny_llama_gguf):
    minted = mint_token()
    ports = {"us": free_port(), "eu": free_port()}
    servers = []
    for name, peer in (("us", "eu"), ("eu", "us")):
        (tmp_path / name).mkdir()
        servers.append(LiveServer(tmp_path / name, tiny_model_toml(tiny_llama_gguf) +
                                  _regions_toml(name, peer, ports[peer]), port=ports[name], minted=minted))
    start_all(servers)
    yield servers
    for s in servers:
        s.stop()


def _complete(server: LiveServer, stream: bool = False, **headers) -> httpx.Response:
    body = {"model": "tiny", "prompt": "regions", "max_tokens": 12, "temperature": 0, "stream": stream}
    return httpx.post(server.base + "/v1/completions", json=body, headers=server.headers(**headers), timeout=60)


def test_a_region_that_cannot_serve_forwards_to_its_peer_and_nothing_goes_to_a_dead_one(regions):
    us, eu = regions
    _wait(lambda: _peer_health(us, "eu") == "up", 30, "us to see eu up")
    assert _peer_health(eu, "us") == "down"  # us is not ready: eu never forwards there
    local = _complete(eu)
    assert local.status_code == 200 and local.headers["x-kvserve-region"] == "eu"
    r = _complete(us)
    assert r.status_code == 200 and r.headers["x-kvserve-region"] == "eu"
    assert r.json()["choices"][0]["text"] == local.json()["choices"][0]["text"]  # greedy: the same text
    s = _complete(us, stream=True)  # streamed through us as eu sends it
    events = [json.loads(line[6:]) for line in s.text.splitlines() if line.startswith("data: {")]
    assert s.status_code == 200 and s.headers["x-kvserve-region"] == "eu"
    assert "".join(e["choices"][0]["text"] for e in events) == local.json()["choices"][0]["text"]
    # a request already forwarded is served where it lands or refused, never forwarded again
    again = _complete(us, **{"x-kvserve-forwarded-from": "eu"})
    assert again.status_code == 503 and again.headers["x-kvserve-region"] == "us"
    assert "error" in again.json()
    # eu dies: us detects it within its bound and stops forwarding (its own 503, no hang on a dead peer)
    eu.kill()
    killed = time.monotonic()
    _wait(lambda: _peer_health(us, "eu") == "down", 10, "us to see eu down")
    assert time.monotonic() - killed < 5.0
    r = _complete(us)
    assert r.status_code == 503 and r.headers["x-kvserve-region"] == "us"
    # eu comes back: recovering first, up only after answering every probe for recover_after_s
    eu.start(ready_path="/v1/region/status")
    _wait(lambda: _peer_health(us, "eu") == "recovering", 30, "us to see eu recovering")
    seen = time.monotonic()
    assert _complete(us).status_code == 503  # not yet
    _wait(lambda: _peer_health(us, "eu") == "up", 30, "us to see eu up again")
    assert time.monotonic() - seen >= RECOVER_S - 2 * PROBE_S
    r = _complete(us)
    assert r.status_code == 200 and r.headers["x-kvserve-region"] == "eu"


def test_a_retry_at_another_region_is_served_by_the_region_that_holds_its_key(two_regions):
    us, eu = two_regions
    _wait(lambda: _peer_health(eu, "us") == "up" and _peer_health(us, "eu") == "up", 30, "both peers up")
    key = {"Idempotency-Key": "regions-key-1"}
    first = _complete(us, stream=True, **key)
    assert first.status_code == 200 and first.headers["x-kvserve-region"] == "us"
    # the client retries (the OpenAI SDKs' header) at eu: us holds the key, so us replays it
    retry = _complete(eu, stream=True, **key, **{"x-stainless-retry-count": "1"})
    assert retry.status_code == 200 and retry.headers["x-kvserve-region"] == "us"
    assert retry.headers.get("x-kvserve-idempotent-replay") == "true" and retry.text == first.text
    # resumed at eu from an event of the first stream: us sends only the events after it
    ids = [line[4:] for line in first.text.splitlines() if line.startswith("id: ")]
    resumed = _complete(eu, stream=True, **key, **{"Last-Event-ID": ids[2]})
    assert resumed.status_code == 200 and resumed.headers["x-kvserve-region"] == "us"
    assert resumed.text == first.text[first.text.index(f"id: {ids[2]}\n"):].split("\n\n", 1)[1]
    # a first attempt (no retry header) with a key eu does not hold runs at eu: nothing is asked
    fresh = _complete(eu, stream=True, **{"Idempotency-Key": "regions-key-2"})
    assert fresh.status_code == 200 and fresh.headers["x-kvserve-region"] == "eu"
    # billed once each, in the region that generated the tokens (the replays generate nothing)
    _wait(lambda: _usage_rows(us) >= 1 and _usage_rows(eu) >= 1, 20, "usage rows written")
    time.sleep(1.0)
    assert (_usage_rows(us), _usage_rows(eu)) == (1, 1)


def _usage_rows(server: LiveServer) -> int:
    import sqlite3

    with sqlite3.connect(server.home / "kvserve.db") as db:
        return db.execute("SELECT COUNT(*) FROM usage_records").fetchone()[0]
