"""The batch API end to end with the official openai client against a real server (a subprocess, the tiny
model): files and batches, bad files (named lines, nothing runs), cancel, expiry, a budget running out
mid-batch, and SIGKILL in the middle of a batch: after a restart it resumes, every line is in the output
exactly once, and every line is billed once."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.live_server import LiveServer, tiny_model_toml

pytestmark = pytest.mark.slow


class Server(LiveServer):
    """The tiny model with a fast batch poll and short leases."""

    def __init__(self, home: Path, model: Path):
        super().__init__(home, tiny_model_toml(model), "[batch]\npoll_s = 0.1\nlease_s = 3.0\nmax_inflight = 8\n")


@pytest.fixture
def server(tiny_llama_gguf, tmp_path):
    s = Server(tmp_path, tiny_llama_gguf).start()
    yield s
    s.stop(signal.SIGKILL)


def jsonl(n: int, max_tokens: int = 8, **extra) -> bytes:
    rows = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": "tiny", "messages": [{"role": "user", "content": f"Tell me about number {i}."}],
                      "max_tokens": max_tokens, "temperature": 0, **extra}} for i in range(n)]
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def wait(client, batch_id: str, statuses: tuple[str, ...], timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in statuses:
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {b.status}: {b.request_counts}")


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def test_a_batch_runs_through_the_openai_client(server):
    client = server.openai()
    f = client.files.create(file=("in.jsonl", jsonl(12)), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and client.files.retrieve(f.id).id == f.id
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "nightly"})
    assert b.status == "in_progress" and b.request_counts.total == 12 and b.metadata == {"job": "nightly"}
    b = wait(client, b.id, ("completed",))
    assert b.request_counts.completed == 12 and b.request_counts.failed == 0 and b.error_file_id is None
    assert b.in_progress_at <= b.finalizing_at <= b.completed_at
    out = lines_of(client, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(12))
    assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in out)
    assert all(x["response"]["body"]["object"] == "chat.completion" for x in out)
    assert b.id in [x.id for x in client.batches.list(limit=5).data]
    rows = server.usage_rows(f"chatcmpl-{b.id}-")
    assert len(rows) == 12 and all(r["tier"] == "batch" for r in rows)  # batch tier prices
    assert sum(r["completion_tokens"] for r in rows) == sum(x["response"]["body"]["usage"]["completion_tokens"]
                                                            for x in out)
    assert client.files.delete(f.id).deleted
    with pytest.raises(Exception):
        client.files.retrieve(f.id)


def test_a_bad_file_fails_the_batch_naming_its_lines(server):
    client = server.openai()
    rows = [json.loads(x) for x in jsonl(4).splitlines()]
    rows[1]["custom_id"] = "req-0"  # duplicate
    rows[2]["url"] = "/v1/embeddings"
    rows[3]["body"]["model"] = "gpt-9"
    data = ("\n".join(json.dumps(r) for r in rows) + "\nnot json\n").encode()
    f = client.files.create(file=("bad.jsonl", data), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert b.status == "failed" and b.failed_at is not None and b.request_counts.total == 0
    by_line = {e.line: e.code for e in b.errors.data}
    assert by_line == {2: "duplicate_custom_id", 3: "invalid_url", 4: "model_not_found", 5: "invalid_json"}
    assert server.usage_rows(f"chatcmpl-{b.id}-") == []
    r = httpx.post(server.base + "/v1/files", headers={"Authorization": f"Bearer {server.token}"},
                   files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "fine-tune"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = httpx.post(server.base + "/v1/batches", headers={"Authorization": f"Bearer {server.token}"},
                   json={"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "soon"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_window"


def test_cancel_and_expiry_end_every_line_once(server):
    client = server.openai()
    # Every line runs to max_tokens (ignore_eos): 200 lines of 200 tokens, 8 at a time, are thousands of engine
    # steps, so neither the cancel nor the window can come after the last line on any machine.
    n = 200
    for window, action, status, code in (("24h", "cancel", "cancelled", "batch_cancelled"),
                                         ("1s", None, "expired", "batch_expired")):
        f = client.files.create(file=("in.jsonl", jsonl(n, max_tokens=200, ignore_eos=True)), purpose="batch")
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)
        if action:
            time.sleep(0.3)
            assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")
        b = wait(client, b.id, (status,))
        out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
        ids = [x["custom_id"] for x in out + err]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(n))  # every line exactly once
        assert err and all(x["error"]["code"] == code for x in err)
        assert b.request_counts.completed == len(out) and b.request_counts.failed == len(err)


def test_sigkill_mid_batch_resumes_with_exactly_once_output_and_billing(server):
    client = server.openai()
    n = 40  # every line runs to max_tokens (ignore_eos), so most are still to run when the server is killed
    f = client.files.create(file=("in.jsonl", jsonl(n, max_tokens=96, ignore_eos=True)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while (done := client.batches.retrieve(b.id).request_counts.completed) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    server.stop(signal.SIGKILL)
    assert done < n - 8, f"the batch was nearly done ({done}/{n}) before the kill: nothing resumed"
    server.start()
    client = server.openai()
    b = wait(client, b.id, ("completed",))
    out = lines_of(client, b.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
    assert b.request_counts.completed == n
    rows = server.usage_rows(f"chatcmpl-{b.id}-")
    assert len(rows) == n == len({r["request_id"] for r in rows})  # billed once per line
    assert sum(r["completion_tokens"] for r in rows) == sum(x["response"]["body"]["usage"]["completion_tokens"]
                                                            for x in out)


def test_a_budget_that_runs_out_fails_the_remaining_lines(server):
    from kvserve.config import ModelPrice
    from kvserve.metering.prices import worst_case_price
    from kvserve.store import Store

    with Store(server.home / "kvserve.db") as store:
        # about five lines' worst case (the batch tier's price), held line by line as they start
        store.budgets.set_budget("acme", 5.5 * worst_case_price(ModelPrice(), "batch", 40, 8), "month")
    time.sleep(6)  # the server's cached "no budget" flag expires (auth_cache_ttl_s)
    client = server.openai()
    f = client.files.create(file=("in.jsonl", jsonl(20)), purpose="batch")
    b = wait(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                           completion_window="24h").id, ("completed",))
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    assert 1 <= len(out) < 20 and len(out) + len(err) == 20
    assert all(x["response"]["status_code"] == 429 and x["error"]["code"] == "insufficient_quota" for x in err)


def test_the_batch_cli(server, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl(6))
    base = [sys.executable, "-m", "kvserve.cli", "batch", "--url", server.base, "--token", server.token]
    done = subprocess.run(base + ["submit", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    batch_id = done.stdout.split()[1]
    assert f"{batch_id}  completed   6/6 done, 0 failed" in done.stdout
    out = tmp_path / "out.jsonl"
    got = subprocess.run(base + ["download", batch_id, "-o", str(out)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0 and len(out.read_text().splitlines()) == 6
    listed = subprocess.run(base + ["list"], capture_output=True, text=True, timeout=60)
    assert batch_id in listed.stdout
    bad = subprocess.run(base + ["cancel", batch_id], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "invalid_state" in bad.stderr


def test_batch_lines_with_response_format_and_tools_are_constrained(server):
    """A batch line gets what the endpoint gives: JSON of its schema, tool calls of its tools (the tiny model's
    text is noise, so only the constraint makes these valid)."""
    client = server.openai()
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"enum": ["a", "b"]}}, "required": ["q"], "additionalProperties": False}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}
    data = jsonl(3, max_tokens=60, response_format=fmt) + jsonl(3, max_tokens=60, tools=[tool], tool_choice="required")
    rows = [json.loads(x) for x in data.splitlines()]
    for i, r in enumerate(rows):
        r["custom_id"] = f"line-{i}"
    f = client.files.create(file=("in.jsonl", ("\n".join(json.dumps(r) for r in rows) + "\n").encode()),
                            purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    b = wait(client, b.id, ("completed",))
    out = {x["custom_id"]: x["response"]["body"]["choices"][0] for x in lines_of(client, b.output_file_id)}
    assert len(out) == 6
    for i in range(3):
        assert json.loads(out[f"line-{i}"]["message"]["content"])["n"] in range(100)
        call = out[f"line-{i + 3}"]
        assert call["finish_reason"] == "tool_calls"
        assert json.loads(call["message"]["tool_calls"][0]["function"]["arguments"])["q"] in ("a", "b")
