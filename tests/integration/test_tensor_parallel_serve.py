"""`tensor_parallel_size = 2` through `kvserve serve` with the real `openai` client, on the CPU (gloo): the model split
over two ranks (rank 1 a process of the server's) answers with the tokens of the same model whole, served beside it;
a rank killed mid-service fails that model promptly (the request it meets aborted, the next ones 503 in OpenAI's
error schema) and the server keeps serving the other."""
from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.live_server import LiveServer, tiny_model_toml

pytestmark = pytest.mark.timeout(600)
PROMPT = [17, 2054, 931, 4011, 88, 7, 12500, 301, 55, 4096, 12, 8]


def _ranks(server_pid: int) -> list[int]:
    """The server's tensor-parallel rank processes (multiprocessing's spawned children, not its resource tracker)."""
    children = [pid for task in Path(f"/proc/{server_pid}/task").iterdir()  # any thread's children
                for pid in (task / "children").read_text().split()]
    return [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2_gguf_path):
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    root = tmp_path_factory.mktemp("tp-serve")
    path = root / "tiny-qwen3.gguf"
    write_tiny_gguf(path, TinySpec(arch="qwen3", quant="F32"), str(smollm2_gguf_path))
    toml = (tiny_model_toml(path, "whole", blocks=64)
            + tiny_model_toml(path, "split", blocks=64, extra="tensor_parallel_size = 2\n"))
    srv = LiveServer(tmp_path_factory.mktemp("tp-home"), toml).start()
    yield srv
    srv.stop()


def test_two_ranks_answer_with_the_whole_models_tokens(served):
    client = served.openai()
    args = dict(prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(model="whole", **args)
    split = client.completions.create(model="split", **args)
    assert split.usage.completion_tokens == 16 and split.choices[0].text == whole.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(model="split", stream=True, **args)
                       if c.choices)
    assert streamed == whole.choices[0].text


def test_a_killed_rank_fails_its_model_not_the_server(served):
    import os
    import signal

    (rank,) = _ranks(served.proc.pid)
    os.kill(rank, signal.SIGKILL)
    t0 = time.monotonic()
    body = {"model": "split", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{served.base}/v1/completions", json=body, headers=served.headers(), timeout=60)
    assert time.monotonic() - t0 < 10
    # The request the failure met ends there (aborted, as every request in flight when an engine fails) ...
    assert r.status_code == 503 or r.json()["choices"][0]["finish_reason"] == "abort", r.text
    # ... and the model stays failed: reported, never hanging.
    again = httpx.post(f"{served.base}/v1/completions", json=body, headers=served.headers(), timeout=60)
    assert again.status_code == 503 and {"message", "type", "code"} <= set(again.json()["error"]), again.text
    ok = served.openai().completions.create(model="whole", prompt=PROMPT, max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4
