"""Abandoned streams: streamed chat and completion calls cut by the client at random points, many at once,
against a real server (a subprocess: the tiny model; at full scale the shipped SmolLM2 serves some of them).

Where a stream is cut: in the middle of the request body (nothing may run); after the whole body but
before the response headers (the call waits in the queue or for its first token: raw sockets, so no
bytes of the response were seen); right after the headers; after k token chunks for a random k; right
after every choice's finish chunk (before the usage chunk and [DONE]); and some run to [DONE] as the
control. Some are n=2 chats and two-prompt completions (one call, several sequences or engine requests).

Afterwards, once the server is idle: no KV block and no sequence is held, every call the server accepted
has its usage rows (one per engine request: `<response id>-<prompt index>`, the id is the `x-request-id`
header and every chunk's `id`), and each row's completion_tokens is the number the engine really produced:
exactly max_tokens x n where the client saw every choice finish (ignore_eos), and for a cut stream at
least the tokens the client received (logprobs give one entry per token) and at most max_tokens x n. The
ledger as a whole equals the engine's own count (kvserve:request_success, kvserve:generation_tokens,
counted in the finish hook, not through the store), so no row is missing, doubled or miscounted. Calls cut
before the headers have no id the client knows: they are accounted by count (rows nobody claimed are at
most the number of such cuts, and each is an aborted one). Then a normal request is served.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import pytest

from tests.live_server import LiveServer, tiny_model_toml
from tests.reliability.conftest import FULL, scale

pytestmark = pytest.mark.slow

BLOCKS = 256  # 16-token blocks: room for about 24 of these calls at once, so some wait in the queue
STREAMS = scale(160, 1000)
CONCURRENCY = scale(16, 32)
MAX_TOKENS = (8, 64)
MODES = {"mid_body": 1, "before_headers": 3, "after_headers": 2, "after_k": 6, "at_end": 1, "full": 2}
SMOLLM2_SHARE = scale(0.0, 0.06)  # at full scale the shipped SmolLM2 (real tokenizer and weights) serves some
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar".split()


@dataclass
class Stream:
    """One call and what the client saw of it."""

    i: int
    kind: str  # "chat" | "completion"
    mode: str  # where the client meant to cut it (MODES)
    body: dict
    k: int = 0  # after_k: token chunks to read
    outcome: str = ""  # what happened: no_body, before_headers, after_headers, after_k, at_end, complete, refused
    status: int | None = None
    response_id: str | None = None
    received: Counter = field(default_factory=Counter)  # choice index -> tokens received (a lower bound)
    finished: set = field(default_factory=set)  # choice indexes whose finish chunk arrived
    usage: dict | None = None
    refusal: str | None = None  # the error code of a refused call
    errors: list = field(default_factory=list)

    @property
    def prompts(self) -> int:
        p = self.body.get("prompt")
        return len(p) if isinstance(p, list) else 1

    @property
    def n(self) -> int:
        return self.body.get("n", 1)

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.kind == "chat" else "/v1/completions"

    def row_ids(self) -> list[str]:
        return [f"{self.response_id}-{p}" for p in range(self.prompts)]

    def received_for(self, prompt: int) -> int:
        return sum(self.received[prompt * self.n + k] for k in range(self.n))

    def all_finished_for(self, prompt: int) -> bool:
        return all(prompt * self.n + k in self.finished for k in range(self.n))


def make_stream(i: int, rng: random.Random) -> Stream:
    kind = "chat" if rng.random() < 0.6 else "completion"
    model = "smollm2" if rng.random() < SMOLLM2_SHARE else "tiny"
    max_tokens = rng.randint(MAX_TOKENS[0], MAX_TOKENS[1] if model == "tiny" else 32)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 24)))
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                  "temperature": rng.choice([0.0, 0.8])}
    logprobs = rng.random() < 0.75  # one entry per token: the client's count is exact
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        if logprobs:
            body["logprobs"] = True
        if rng.random() < 0.1:
            body["n"] = 2
    else:
        body["prompt"] = [text, text[::-1]] if rng.random() < 0.1 else text
        if logprobs:
            body["logprobs"] = 0
    if rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    mode = rng.choices(list(MODES), weights=list(MODES.values()))[0]
    return Stream(i, kind, mode, body, k=rng.randint(1, max(1, max_tokens - 1)))


async def raw_cut(server: LiveServer, s: Stream, rng: random.Random) -> None:
    """Over a raw socket: send part of the body (mid_body) or all of it, then close after a random wait,
    before any byte of the response came (or, when the headers came first, right after them)."""
    data = json.dumps(s.body).encode()
    head = (f"POST {s.path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nAuthorization: Bearer {server.token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        if s.mode == "mid_body":
            writer.write(head + data[:rng.randint(0, len(data) - 1)])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, 0.05))
            s.outcome = "no_body"
            return
        writer.write(head + data)
        await writer.drain()
        try:  # at once (the server may not have read the body yet), or a while later (queued, prefilling)
            wait = rng.choice([0.0, rng.uniform(0, 0.01), rng.uniform(0, 0.05), rng.uniform(0, 0.3)])
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError):
            s.outcome = "before_headers"
            return
        lines = raw.decode("latin-1").split("\r\n")
        s.status = int(lines[0].split()[1])
        headers = dict(x.split(": ", 1) for x in lines[1:] if ": " in x)
        s.response_id = {k.lower(): v for k, v in headers.items()}.get("x-request-id")
        s.outcome = "after_headers" if s.status == 200 else "refused"
    finally:
        if rng.random() < 0.5:
            writer.transport.abort()  # a reset: a client that vanished
        else:
            writer.close()


async def http_cut(client: httpx.AsyncClient, server: LiveServer, s: Stream) -> None:
    """Through httpx: read the headers, then k token chunks, or up to the finish chunks, or to [DONE]."""
    choices = s.prompts * s.n
    token_chunks = 0
    async with client.stream("POST", s.path, json=s.body, headers=server.headers()) as r:
        s.status, s.response_id = r.status_code, r.headers.get("x-request-id")
        if r.status_code != 200:
            s.refusal = json.loads(await r.aread())["error"]["code"]
            s.outcome = "refused"
            return
        s.outcome = "after_headers"
        if s.mode == "after_headers":
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                s.outcome = "complete"
                return
            ev = json.loads(line[6:])
            if "error" in ev:
                s.errors.append(ev["error"])
                continue
            assert ev["id"] == s.response_id
            if ev.get("usage"):
                s.usage = ev["usage"]
            for ch in ev["choices"]:
                lp = ch.get("logprobs")
                if lp:
                    got = len(lp["content"]) if s.kind == "chat" else len(lp["tokens"])
                else:  # no logprobs: a chunk carries one token or more
                    got = 1 if (ch.get("delta", {}).get("content") or ch.get("text")) else 0
                s.received[ch["index"]] += got
                token_chunks += got > 0
                if ch.get("finish_reason"):
                    s.finished.add(ch["index"])
            if s.mode == "after_k" and token_chunks >= s.k:
                s.outcome = "after_k"
                return
            if s.mode == "at_end" and len(s.finished) == choices:
                s.outcome = "at_end"
                return


async def run_streams(server: LiveServer, streams: list[Stream], seed: int) -> None:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=server.base, timeout=120, limits=limits) as client:
        async def one(s: Stream) -> None:
            async with gate:
                await asyncio.sleep(rng.uniform(0, 0.02))
                if s.mode in ("mid_body", "before_headers"):
                    await raw_cut(server, s, rng)
                else:
                    await http_cut(client, server, s)

        await asyncio.gather(*(one(s) for s in streams))


def ledger(server: LiveServer) -> dict[str, dict]:
    with server.store() as store:
        cur = store.db.conn().execute("SELECT request_id, completion_tokens, status, finish_reason FROM usage_records"
                                      " WHERE tenant = 'acme'")
        return {r[0]: {"completion_tokens": r[1], "status": r[2], "finish_reason": r[3]} for r in cur.fetchall()}


def idle_state(server: LiveServer) -> dict:
    m = server.metrics()
    inflight = sum(v["inflight"] for v in httpx.get(server.base + "/health", timeout=10).json()["models"].values())
    return {"running": m.get("kvserve:num_requests_running", 0.0),
            "waiting": m.get("kvserve:num_requests_waiting", 0.0),
            "inflight": inflight, "blocks": round(m.get("kvserve:kv_cache_usage_perc", 0.0) * BLOCKS),
            "finished": m.get("kvserve:request_success_total", 0.0),
            "generated": m.get("kvserve:generation_tokens_total", 0.0)}


@pytest.fixture
def server(tiny_llama_gguf, tmp_path, request):
    # A TTFT bound this load stays within: the calls are admitted (and cut), not refused at admission
    relaxed = "[models.interactive]\nmax_ttft_s = 60.0\n"
    models = tiny_model_toml(tiny_llama_gguf, blocks=BLOCKS, extra=relaxed)
    if FULL:
        smollm2 = request.getfixturevalue("smollm2_gguf_path")
        models += (f'\n[[models]]\nid = "smollm2"\nsource = "{smollm2}"\nmax_model_len = 512\n'
                   f"num_gpu_blocks_override = {BLOCKS}\n{relaxed}")
    s = LiveServer(tmp_path, models).start()
    yield s
    s.kill()


def test_abandoned_streams_leak_nothing_and_are_billed_what_was_produced(server, figures):
    t0 = time.monotonic()
    warm = server.openai().chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4)
    deadline = time.monotonic() + 10
    while len(ledger(server)) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = idle_state(server)
    rows_before = ledger(server)
    assert set(rows_before) == {warm.id + "-0"}

    rng = random.Random(2121)
    streams = [make_stream(i, rng) for i in range(STREAMS)]
    asyncio.run(run_streams(server, streams, seed=rng.randrange(1 << 30)))
    t_run = time.monotonic() - t0

    # idle: nothing held, and the ledger has caught up with every engine request that finished
    deadline = time.monotonic() + 60
    while True:
        now = idle_state(server)
        rows = {k: v for k, v in ledger(server).items() if k not in rows_before}
        settled = now["running"] == now["waiting"] == now["inflight"] == now["blocks"] == 0
        if settled and len(rows) == now["finished"] - before["finished"]:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(1.0)  # a late row would show up now
    now = idle_state(server)
    rows = {k: v for k, v in ledger(server).items() if k not in rows_before}

    outcomes = Counter(s.outcome for s in streams)
    accepted = [s for s in streams if s.status == 200]
    refused = [s for s in streams if s.outcome == "refused"]
    missing, wrong, claimed = [], [], set()
    overshoot = []  # tokens billed beyond those the client received, in cut streams
    for s in accepted:
        assert s.response_id, s
        usage_total = 0
        for p, rid in enumerate(s.row_ids()):
            claimed.add(rid)
            row = rows.get(rid)
            if row is None:
                missing.append(rid)
                continue
            got, cap = s.received_for(p), s.body["max_tokens"] * s.n
            tokens = row["completion_tokens"]
            usage_total += tokens
            if s.all_finished_for(p):  # every token reached the client: exact
                ok = tokens == cap and row["status"] == "ok" and row["finish_reason"] == "length"
            else:
                ok = got <= tokens <= cap
                if s.outcome not in ("after_headers", "complete"):
                    overshoot.append(tokens - got)
            if not ok:
                wrong.append((rid, s.outcome, got, tokens, cap, row))
        if s.outcome == "complete" and (len(s.finished) != s.prompts * s.n or (
                s.usage is not None and s.usage["completion_tokens"] != usage_total)):
            wrong.append((s.response_id, "complete, but its finish or usage chunk disagrees", s.usage, usage_total))
    billed_refused = [s.response_id for s in refused if any(rid.startswith(f"{s.response_id}-") for rid in rows)]
    unclaimed = {k: v for k, v in rows.items() if k not in claimed}
    unclaimed_calls = {rid.rsplit("-", 1)[0] for rid in unclaimed}  # a two-prompt call has two rows
    cut_before_headers = outcomes["before_headers"]
    before_headers_prompts = sum(s.prompts for s in streams if s.outcome == "before_headers")
    ledger_tokens = sum(r["completion_tokens"] for r in rows.values())
    engine_requests = now["finished"] - before["finished"]
    engine_tokens = now["generated"] - before["generated"]
    leaked_seqs = now["running"] + now["waiting"] + now["inflight"]

    f = figures.record
    f("abandoned", "streams", len(streams), "", None,
      ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())) + f"; {CONCURRENCY} at once; "
      f"{sum(s.body['model'] == 'smollm2' for s in streams)} on SmolLM2; refused: "
      + (", ".join(f"{k} {v}" for k, v in Counter(s.refusal for s in refused).items()) or "none"))
    f("abandoned", "streams cut", sum(v for k, v in outcomes.items() if k not in ("complete", "refused")))
    f("abandoned", "leaked KV blocks", now["blocks"], "0", now["blocks"] == 0)
    f("abandoned", "leaked sequences", leaked_seqs, "0", leaked_seqs == 0,
      f"running {now['running']:.0f}, waiting {now['waiting']:.0f}, engine in flight {now['inflight']}")
    f("abandoned", "usage rows missing", len(missing), "0", not missing,
      f"{len(rows)} rows for {len(accepted)} calls with headers and {cut_before_headers} cut before them")
    f("abandoned", "rows whose completion_tokens differ from the tokens produced", len(wrong), "0", not wrong,
      "exact where the client saw the finish; received <= billed <= max_tokens x n where it cut")
    f("abandoned", "ledger vs engine count (requests, tokens)",
      f"{len(rows)} / {engine_requests:.0f}, {ledger_tokens} / {engine_tokens:.0f}", "equal",
      len(rows) == engine_requests and ledger_tokens == engine_tokens)
    f("abandoned", "calls cut before the headers that reached the engine", len(unclaimed_calls),
      f"<= {cut_before_headers}", len(unclaimed_calls) <= cut_before_headers and
      len(unclaimed) <= before_headers_prompts, f"{len(unclaimed)} rows")
    if overshoot:
        f("abandoned", "tokens billed past those received (cut streams)",
          f"mean {sum(overshoot) / len(overshoot):.1f}, max {max(overshoot)}", "", None,
          "produced, not read: in the socket buffers at the cut, or made before the abort took effect")
    f("abandoned", "run time (s)", round(t_run, 1))

    assert not any(s.errors for s in streams), [s.errors for s in streams if s.errors][:3]
    assert now["blocks"] == 0 and leaked_seqs == 0, now
    assert not missing, missing[:5]
    assert not wrong, wrong[:5]
    assert not billed_refused, billed_refused[:5]
    assert len(rows) == engine_requests and ledger_tokens == engine_tokens, (len(rows), engine_requests,
                                                                               ledger_tokens, engine_tokens)
    assert len(unclaimed_calls) <= cut_before_headers, (len(unclaimed_calls), cut_before_headers)
    assert len(unclaimed) <= before_headers_prompts, (len(unclaimed), before_headers_prompts)
    assert all(r["status"] == "aborted" and r["finish_reason"] == "abort" for r in unclaimed.values()), unclaimed
    assert outcomes["complete"] and outcomes["after_k"] and outcomes["before_headers"], outcomes

    # and the server still serves: a normal call, billed what it says
    done = server.openai().completions.create(model="tiny", prompt="After the storm", max_tokens=6,
                                              extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 6
    deadline = time.monotonic() + 10
    while (row := ledger(server).get(done.id + "-0")) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert row["completion_tokens"] == 6 and row["status"] == "ok"
    errors = [ln for ln in server.log_text().splitlines()
              if "Traceback" in ln or ln.startswith("ERROR") or " ERROR " in ln or "never retrieved" in ln]
    f("abandoned", "errors in the server log", len(errors), "0", not errors, "; ".join(errors[:3]))
    assert not errors, errors[:5]
