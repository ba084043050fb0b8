"""LoRA adapters through `kvserve serve` with the real `openai` client: a tiny Qwen3 checkpoint (safetensors) with a
configured PEFT adapter and one loaded at run time by an admin. A request naming an adapter (as its model, or
"<model>:<adapter>") gets transformers + PEFT's greedy tokens (the adapter merged), the base model its own, in the
same steps; /v1/models lists the adapters with their parent; an adapter with its own prices is charged them, the base
model its own; an unloaded or unknown adapter is a 404, a bad one a 400, a tenant's load a 403, in OpenAI's error
schema."""
from __future__ import annotations

import copy
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from kvserve.store.tenants import mint_token
from tests.hf_factory import tiny_model, write_hf_dir
from tests.live_server import LiveServer
from tests.lora_factory import peft_model, write_peft_adapter

pytestmark = pytest.mark.timeout(600)
PROMPT = [17, 2054, 931, 4011, 88, 7, 12500, 301, 55, 4096, 12, 8]
TOKENS = 16


def _greedy(model) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)
    return out[0, len(PROMPT):].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf_path):
    root = tmp_path_factory.mktemp("lora")
    base = tiny_model("qwen3", seed=3)
    path = write_hf_dir(base, root / "base", str(smollm2_gguf_path))
    adapters = {"sql": dict(rank=8, seed=1), "poem": dict(rank=16, alpha=8, seed=2, rslora=True)}
    want = {None: _greedy(base)}
    for name, kw in adapters.items():
        write_peft_adapter(copy.deepcopy(base), root / name, **kw)
        want[name] = _greedy(peft_model(copy.deepcopy(base), **kw).merge_and_unload())
    toml = (f'[[models]]\nid = "tiny"\nsource = "{path}"\ndtype = "float32"\nmax_model_len = 256\n'
            f'num_gpu_blocks_override = 64\nmax_loras = 2\n'
            f'adapters = [{{name = "sql", path = "{root / "sql"}", price = {{input = 2.0, cached_input = 2.0, output = 8.0}}}}]\n'
            '[models.price]\ninput = 0.02\noutput = 0.08\ncached_input = 0.02\n')
    from kvserve.models.tokenizer import Tokenizer

    srv = LiveServer(tmp_path_factory.mktemp("lora-home"), toml, admin_minted=mint_token()).start()
    tokenizer = Tokenizer.from_gguf(str(smollm2_gguf_path))
    srv.root, srv.want = root, {name: tokenizer.decode(ids) for name, ids in want.items()}
    yield srv
    srv.stop()


def _complete(srv, model: str) -> str:
    r = httpx.post(f"{srv.base}/v1/completions", headers=srv.headers(), timeout=60,
                   json={"model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == model and body["usage"]["completion_tokens"] == TOKENS
    return body["choices"][0]["text"]


def test_an_adapter_answers_as_peft_merged_and_the_base_as_itself_in_the_same_steps(served):
    with ThreadPoolExecutor(4) as pool:
        got = dict(zip(["sql", "tiny:sql", "tiny", "sql"], pool.map(lambda m: _complete(served, m),
                                                                    ["sql", "tiny:sql", "tiny", "sql"])))
    assert got["sql"] == served.want["sql"] and got["tiny:sql"] == served.want["sql"]
    assert got["tiny"] == served.want[None] != served.want["sql"]
    cards = {m.id: m for m in served.openai().models.list().data}
    assert cards["sql"].model_extra["parent"] == "tiny" and cards["tiny"].model_extra["parent"] is None
    # Each request's price: the adapter's own ([[models.adapters]] price), else the model's.
    import sqlite3
    import time

    deadline = time.monotonic() + 10
    while True:
        with sqlite3.connect(served.home / "kvserve.db") as db:
            rows = db.execute("SELECT adapter, prompt_tokens, completion_tokens, price FROM usage_records").fetchall()
        if len(rows) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    rates = {"sql": (2.0, 8.0), None: (0.02, 0.08)}
    assert len(rows) >= 4 and {r[0] for r in rows} == {"sql", None}, rows
    for adapter, prompt, completion, price in rows:
        per_input, per_output = rates[adapter]
        assert price == pytest.approx((prompt * per_input + completion * per_output) * 1e-6), rows


def test_an_admin_loads_and_unloads_an_adapter_at_run_time(served):
    admin = served.headers(served.admin_token)
    body = {"lora_name": "poem", "lora_path": str(served.root / "poem")}
    assert httpx.post(f"{served.base}/v1/load_lora_adapter", json=body, headers=served.headers()).status_code == 403
    r = httpx.post(f"{served.base}/v1/load_lora_adapter", json=body, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    assert _complete(served, "poem") == served.want["poem"]
    client = served.openai()
    out = client.chat.completions.create(model="poem", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.model == "poem" and out.usage.completion_tokens >= 1
    r = httpx.post(f"{served.base}/v1/unload_lora_adapter", json={"lora_name": "poem"}, headers=admin, timeout=60)
    assert r.status_code == 200, r.text
    gone = httpx.post(f"{served.base}/v1/completions", headers=served.headers(), timeout=60,
                      json={"model": "poem", "prompt": PROMPT, "max_tokens": 2})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found", gone.text
    for bad, status in (({"lora_name": "x", "lora_path": str(served.root / "missing")}, 400),
                        ({"lora_name": "x", "lora_path": str(served.root / "base")}, 400),  # not an adapter
                        ({"lora_name": "tiny", "lora_path": str(served.root / "poem")}, 400),
                        ({"lora_name": "x"}, 400)):
        r = httpx.post(f"{served.base}/v1/load_lora_adapter", json=bad, headers=admin, timeout=60)
        assert r.status_code == status and {"message", "type", "code"} <= set(r.json()["error"]), (bad, r.text)
    r = httpx.post(f"{served.base}/v1/completions", headers=served.headers(), timeout=60,
                   json={"model": "tiny:nope", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text
    assert _complete(served, "sql") == served.want["sql"]  # still served
