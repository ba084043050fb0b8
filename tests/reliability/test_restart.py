"""Kill and restart: SIGKILL of the server under load, then a restart on the same home (its SQLite store).

The load, while the server is killed: streamed and non-streamed chat and completion calls, half of them with
an Idempotency-Key, from a tenant with a budget and rate limits (set with `kvserve tenants budget/limits`),
and a batch in progress. A consistent snapshot of the store is read a moment before the kill.

After the restart: the store opens cleanly (integrity check); every usage row, every stored idempotent
response of the snapshot is still there, unchanged; a retry of a key stored before the kill is a replay
(the replay header, the same x-request-id, the same bytes) and runs nothing; a retry of a key whose call was
in flight at the kill runs afresh (start-up releases keys left in progress by the previous run: never
stuck, never 409) and its next retry replays it; the batch resumes and every line is in the output once
(tests/integration/test_batch.py checks that in depth); the budget's spend is the sum of the ledger's
prices and nothing is held once idle (start-up also releases the budget holds of the calls that died with
the process: they would never be settled), the rate limits are unchanged; every ledger row belongs to one
call the client knows, or to a call in flight at the kill whose id the client never saw, so nothing is
billed twice. The windows left are counted: a keyed call whose usage row was committed and whose stored
response was not yet (a few milliseconds apart on the store's writer thread) is billed again when retried
after the restart, and a call that finished on the engine just before the kill is billed though its response
was never sent; their rows must be from the last moments (< 2 s) before the kill. Calls the kill cut mid-way
are not billed at all (no row: the tokens they produced died with the process).

Also: SIGKILL of a process in the middle of the store's write transactions, many times over, leaves a
database that opens, passes its integrity check and holds exactly the committed transactions.
"""
from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.integration.test_batch import jsonl, lines_of, wait
from tests.live_server import LiveServer, tiny_model_toml
from tests.reliability.conftest import scale

CYCLES = scale(2, 5)  # kill and restart this many times, on the same home
WORKERS = scale(6, 12)  # calls in flight at once
BATCH_LINES = scale(12, 24)
LOAD_S = scale(2.5, 5.0)  # load before the kill, at least
REPLAY = "x-kvserve-idempotent-replay"
BUDGET = 5.0  # dollars, period "none": far above what the test spends, so nothing is refused for it
RPM, TPM = 100_000, 50_000_000
SERVER_TOML = "[batch]\npoll_s = 0.1\nlease_s = 3.0\nmax_inflight = 4\n"


@dataclass
class Call:
    i: int
    stream: bool
    path: str
    body: dict
    key: str | None
    status: int | None = None
    response_id: str | None = None
    content: bytes = b""
    complete: bool = False
    replayed: bool = False
    error: str | None = None
    started: bool = False


def make_call(i: int, cycle: int, rng: random.Random) -> Call:
    keyed, stream = rng.random() < 0.5, rng.random() < 0.5
    max_tokens = rng.randint(16, 64) if stream else rng.randint(8, 32)
    body: dict = {"model": "tiny", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8}
    text = f"call {cycle}.{i}: " + " ".join(rng.choice("red green blue cyan gold".split()) for _ in range(6))
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return Call(i, stream, path, body, f"k{cycle}-{i}" if keyed else None)


async def send(client: httpx.AsyncClient, server: LiveServer, c: Call) -> Call:
    headers = {**server.headers(), **({"Idempotency-Key": c.key} if c.key else {})}
    c.started = True
    try:
        if not c.stream:
            r = await client.post(c.path, json=c.body, headers=headers)
            c.status, c.response_id, c.content = r.status_code, r.headers.get("x-request-id"), r.content
        else:
            async with client.stream("POST", c.path, json=c.body, headers=headers) as r:
                c.status, c.response_id = r.status_code, r.headers.get("x-request-id")
                async for chunk in r.aiter_bytes():
                    c.content += chunk
        c.replayed = r.headers.get(REPLAY) == "true"
        c.complete = c.status == 200 and (not c.stream or c.content.endswith(b"data: [DONE]\n\n"))
    except httpx.HTTPError as e:  # the kill
        c.error = type(e).__name__
    return c


def read_snapshot(server: LiveServer) -> dict:
    """The ledger, the budget, the limits and the stored idempotent responses, in one read transaction (a
    plain reader: opening a Store would take the write lock for its migration check)."""
    conn = sqlite3.connect(str(server.home / "kvserve.db"), timeout=30, isolation_level=None)
    try:
        conn.execute("BEGIN")
        cols = ("request_id", "tenant", "model", "tier", "prompt_tokens", "cached_prompt_tokens",
                "completion_tokens", "status", "finish_reason", "created_at", "price", "cost")
        rows = {r[0]: r for r in conn.execute(f"SELECT {', '.join(cols)} FROM usage_records")}
        keys = {(t, k): tuple(r) for t, k, *r in conn.execute(
            "SELECT tenant, key, state, status_code, headers, body, events FROM idempotency_keys")}
        budget = conn.execute("SELECT spent, reserved FROM budgets WHERE tenant = 'acme'").fetchone()
        holds = conn.execute("SELECT COUNT(*) FROM budget_reservations").fetchone()[0]
        limits = conn.execute("SELECT rpm, tpm FROM rate_limits WHERE tenant = 'acme'").fetchone()
        conn.execute("COMMIT")
    finally:
        conn.close()
    return {"rows": rows, "keys": keys, "spent": budget[0], "reserved": budget[1], "holds": holds,
            "limits": limits, "price": sum(r[10] or 0.0 for r in rows.values() if r[1] == "acme")}


def integrity(db: Path) -> str:
    conn = sqlite3.connect(str(db))
    try:
        return conn.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        conn.close()


def idle(server: LiveServer, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if m.get("kvserve:num_requests_running", 0) == m.get("kvserve:num_requests_waiting", 0) == 0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.1)


def interactive_finished(server: LiveServer) -> float:
    """Engine requests of the interactive tier finished since the server started (batch lines excluded)."""
    text = httpx.get(server.base + "/metrics", timeout=10).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("kvserve:request_success_total{") and 'tier="interactive"' in ln)


def cli(server: LiveServer, *args: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvserve.cli", *args], env=server.env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@dataclass
class Tally:
    """Over all cycles."""

    calls: int = 0
    in_flight: int = 0  # calls the kill cut (started, not complete)
    replayed: int = 0  # keys stored before the kill, retried after: replays
    replay_bad: int = 0
    rerun: int = 0  # keys not stored at the kill, retried: ran afresh (or replayed, if stored just in time)
    rerun_bad: int = 0
    rows_changed: int = 0
    keys_changed: int = 0
    unbilled: int = 0  # calls in flight at the kill with no row: the tokens they produced died unbilled
    double_billed: int = 0  # the window: row committed, response not yet stored
    undelivered: int = 0  # rows of calls the kill cut before the client saw their id (finished just before it)
    window_s: float = 0.0  # the oldest of those rows and the double-billed ones: how long before the kill
    unclaimed_excess: int = 0
    batch_bad: int = 0
    budget_bad: int = 0
    integrity_bad: int = 0
    restart_s: float = 0.0


def run_cycle(server: LiveServer, cycle: int, rng: random.Random, tally: Tally, known: set[str]) -> None:
    client = server.openai()
    batch = client.batches.create(input_file_id=client.files.create(
        file=("in.jsonl", jsonl(BATCH_LINES, max_tokens=48, ignore_eos=True)), purpose="batch").id,
        endpoint="/v1/chat/completions", completion_window="24h")
    calls: list[Call] = []

    async def load_then_kill() -> tuple[dict, float]:
        stop = asyncio.Event()
        limits = httpx.Limits(max_connections=WORKERS * 2, max_keepalive_connections=WORKERS)
        async with httpx.AsyncClient(base_url=server.base, timeout=60, limits=limits) as http:
            async def worker() -> None:
                while not stop.is_set():
                    c = make_call(len(calls), cycle, rng)
                    calls.append(c)
                    await send(http, server, c)
                    if c.error:
                        return

            workers = [asyncio.ensure_future(worker()) for _ in range(WORKERS)]
            t0 = time.monotonic()
            while True:  # until calls of each kind are stored, batch lines done, and keyed streams in flight
                await asyncio.sleep(0.1)
                snap = await asyncio.to_thread(read_snapshot, server)
                done_keys = {k for (t, k), r in snap["keys"].items() if r[0] == "done" and k.startswith(f"k{cycle}-")}
                kinds = {next(c.stream for c in calls if c.key == k) for k in done_keys}
                flying = [c for c in calls if c.key and c.stream and c.response_id and not c.complete]
                lines = sum(1 for r in snap["rows"] if r.startswith(f"chatcmpl-{batch.id}-"))
                if time.monotonic() - t0 >= LOAD_S and kinds == {True, False} and flying and lines >= 2:
                    break
                assert time.monotonic() - t0 < 90, (len(done_keys), kinds, len(flying), lines)
            assert not [c.error for c in calls if c.error], "calls failed before the kill"
            bad = [(c.status, c.content[:300]) for c in calls if c.status not in (None, 200)]
            assert not bad, bad[:3]  # every call answered is served
            assert snap["spent"] == pytest.approx(snap["price"], rel=1e-9, abs=1e-15)  # settled with its row
            await asyncio.sleep(rng.uniform(0.05, 0.3))  # the store keeps writing: the kill lands on writes
            stop.set()  # no new calls; those in flight are cut by the kill
            t_kill = time.time()
            server.kill()
            await asyncio.gather(*workers)
        return snap, t_kill

    snap, t_kill = asyncio.run(load_then_kill())
    wal = server.home / "kvserve.db-wal"
    wal_bytes = wal.stat().st_size if wal.exists() else 0
    t0 = time.monotonic()
    server.start()
    tally.restart_s = max(tally.restart_s, time.monotonic() - t0)
    if integrity(server.home / "kvserve.db") != "ok":
        tally.integrity_bad += 1
    after = read_snapshot(server)
    tally.rows_changed += sum(after["rows"].get(rid) != row for rid, row in snap["rows"].items())
    tally.keys_changed += sum(after["keys"].get(k) != v for k, v in snap["keys"].items() if v[0] == "done")
    assert after["limits"] == snap["limits"] == (RPM, TPM)
    tally.calls += len(calls)
    cut = [c for c in calls if c.started and not c.complete]
    tally.in_flight += len(cut)

    # retries of every keyed call: stored before the kill -> a replay; otherwise a fresh run, then a replay
    stored = {k for (t, k), r in snap["keys"].items() if t == "acme" and r[0] == "done"}
    keyed = [c for c in calls if c.key]

    async def retry_all(cs: list[Call]) -> list[Call]:
        async with httpx.AsyncClient(base_url=server.base, timeout=120) as http:
            return list(await asyncio.gather(*(send(http, server, Call(c.i, c.stream, c.path, c.body, c.key))
                                               for c in cs)))

    counters0 = interactive_finished(server)
    first = dict(zip((c.key for c in keyed if c.key in stored), asyncio.run(retry_all(
        [c for c in keyed if c.key in stored]))))
    time.sleep(0.3)
    ran = interactive_finished(server) - counters0
    for c in keyed:
        r = first.get(c.key)
        if r is None:
            continue
        tally.replayed += 1
        same = r.complete and r.replayed and r.response_id == c.response_id
        if c.complete:
            same = same and r.content == c.content
        else:  # the client lost the end of a response the server had stored
            same = same and r.content.startswith(c.content)
        tally.replay_bad += not same
    tally.replay_bad += int(ran)  # replays run nothing on the engine

    others = [c for c in keyed if c.key not in stored]
    again = asyncio.run(retry_all(others))
    third = asyncio.run(retry_all(others))
    for c, r, r2 in zip(others, again, third):
        tally.rerun += 1
        ok = r.complete and r2.complete and r2.replayed and r2.response_id == r.response_id and r2.content == r.content
        if ok and not r.replayed:  # ran afresh: a new id
            ok = r.response_id != c.response_id
        elif ok and c.complete:  # stored in the moment between the snapshot and the kill: the same response
            ok = r.response_id == c.response_id and r.content == c.content
        tally.rerun_bad += not ok
        known.update(x.response_id for x in (r, r2) if x.response_id)

    b = wait(client, batch.id, ("completed",), timeout=180)
    out = lines_of(client, b.output_file_id)
    batch_rows = [r for r in read_snapshot(server)["rows"] if r.startswith(f"chatcmpl-{batch.id}-")]
    if sorted(x["custom_id"] for x in out) != sorted(f"req-{i}" for i in range(BATCH_LINES)) \
            or len(batch_rows) != BATCH_LINES:
        tally.batch_bad += 1
    known.update(rid.rsplit("-", 1)[0] for rid in batch_rows)  # one row per line (the count is checked above)
    idle(server)

    # every row is a call the client knows, or one cut at the kill before the client saw its id
    time.sleep(0.5)
    final = read_snapshot(server)
    known.update(c.response_id for c in calls if c.response_id)
    unknown_cut = sum(1 for c in cut if not c.response_id)
    unclaimed = [rid for rid in final["rows"] if rid.rsplit("-", 1)[0] not in known]
    tally.unclaimed_excess += max(0, len(unclaimed) - unknown_cut)
    tally.undelivered += len(unclaimed)
    tally.window_s = max([tally.window_s] + [t_kill - final["rows"][rid][9] for rid in unclaimed])
    known.update(rid.rsplit("-", 1)[0] for rid in unclaimed)
    for c in cut:
        if c.response_id and not any(rid.startswith(c.response_id + "-") for rid in final["rows"]):
            tally.unbilled += 1
    for c, r in zip(others, again):  # the first run was billed, and its retry ran again
        if not r.replayed and c.response_id and any(rid.startswith(c.response_id + "-") for rid in final["rows"]):
            created = max(row[9] for rid, row in final["rows"].items() if rid.startswith(c.response_id + "-"))
            tally.double_billed += 1
            tally.window_s = max(tally.window_s, t_kill - created)
    if abs(final["spent"] - final["price"]) > 1e-9 * max(1.0, final["price"]) or abs(final["reserved"]) > 1e-12 \
            or final["holds"]:
        tally.budget_bad += 1
    print(f"cycle {cycle}: {len(calls)} calls, {len(cut)} cut by the kill, WAL {wal_bytes} bytes at the kill, "
          f"{len(first)} replays, {len(others)} reruns, rows {len(snap['rows'])} -> {len(final['rows'])}, "
          f"spent {final['spent']:.9f} = ledger {final['price']:.9f}, held {final['reserved']}")


@pytest.mark.slow
def test_sigkill_under_load_then_restart_keeps_ledger_budgets_keys_and_batches(tiny_llama_gguf, tmp_path, figures):
    t_start = time.monotonic()
    server = LiveServer(tmp_path, tiny_model_toml(tiny_llama_gguf, blocks=256,
                                                  extra="[models.interactive]\nmax_ttft_s = 60.0\n"), SERVER_TOML)
    cli(server, "tenants", "budget", "acme", str(BUDGET), "--period", "none")
    cli(server, "tenants", "limits", "acme", "--rpm", str(RPM), "--tpm", str(TPM))
    server.start()
    rng = random.Random(2104)
    tally, known = Tally(), set()
    try:
        for cycle in range(CYCLES):
            run_cycle(server, cycle, rng, tally, known)
        budgets = cli(server, "tenants", "budgets", "acme")
    finally:
        server.stop(signal.SIGKILL)
    t = tally
    f = figures.record
    f("restart", "kills (SIGKILL under load, then restart)", CYCLES, "", None,
      f"{t.calls} calls by {WORKERS} clients, {t.in_flight} in flight at the kills; a {BATCH_LINES}-line batch each")
    f("restart", "store integrity after restart", "ok" if not t.integrity_bad else f"{t.integrity_bad} bad", "ok",
      not t.integrity_bad, f"restart to ready in at most {t.restart_s:.1f} s")
    f("restart", "usage rows changed or lost", t.rows_changed, "0", not t.rows_changed)
    f("restart", "stored idempotent responses changed or lost", t.keys_changed, "0", not t.keys_changed)
    f("restart", "retries of keys stored before the kill that did not replay", t.replay_bad, "0", not t.replay_bad,
      f"{t.replayed} retried: replay header, same id, same bytes, no engine work")
    f("restart", "retries of keys in flight at the kill that failed or stuck", t.rerun_bad, "0", not t.rerun_bad,
      f"{t.rerun} retried: ran afresh (start-up released the keys), the next retry replays")
    f("restart", "batches not completed exactly once", t.batch_bad, "0", not t.batch_bad)
    f("restart", "budgets whose spend != ledger or with holds left", t.budget_bad, "0", not t.budget_bad,
      budgets.strip().splitlines()[-1] if budgets.strip() else "")
    f("restart", "rows billed twice or not owned by a call", t.unclaimed_excess, "0", not t.unclaimed_excess)
    f("restart", "keyed calls billed again in the row/response window", t.double_billed, "", None,
      "usage row committed, stored response not yet, at the kill (ms); the retry runs and is billed")
    f("restart", "calls billed whose response the kill cut", t.undelivered, "", None,
      "finished on the engine (row written) just before the kill, response not yet sent")
    f("restart", "those rows' distance before the kill (s)", round(t.window_s, 3), "< 10", t.window_s < 10.0,
      "a row older than that without a delivered or stored response would be a response lost otherwise")
    f("restart", "calls cut by the kill and not billed", t.unbilled, "", None,
      "the tokens they produced died with the process: no row, hold released at start-up")
    f("restart", "test time (s)", round(time.monotonic() - t_start, 1))
    assert not t.integrity_bad
    assert not t.rows_changed and not t.keys_changed
    assert not t.replay_bad and not t.rerun_bad
    assert not t.batch_bad
    assert not t.budget_bad, budgets
    assert not t.unclaimed_excess
    assert t.window_s < 10.0, t.window_s  # ms normally; generous for a loaded machine


WRITER = """
import sys
from kvserve.store import Store, UsageRecord
store = Store(sys.argv[1])
n = int(sys.argv[2])
while True:
    recs = [UsageRecord(request_id=f"b{n}-{i}", tenant="acme", model="tiny", prompt_tokens=10, completion_tokens=5,
                        price=1e-6) for i in range(200)]
    store.holds.admit("acme", "tiny", [(r.request_id, 2e-6, 15) for r in recs])
    store.record_usage_many(recs)
    print(n, flush=True)
    n += 1
"""


def test_sigkill_mid_store_write_leaves_a_store_that_opens_with_every_commit(tmp_path, figures):
    """A process writing usage rows (200 a transaction, with their budget holds taken and settled) is killed at
    random moments, many times: each time the store opens, passes its integrity check, and holds exactly the
    transactions that committed: whole batches of rows, spend equal to their prices, no hold half-settled."""
    from kvserve.store import Store

    db = tmp_path / "kvserve.db"
    with Store(db) as store:
        store.create_tenant("acme")
        store.budgets.set_budget("acme", 1e6, "none")
    rng = random.Random(21)
    kills = scale(6, 20)
    bad, left_holds = [], 0
    rows_before, start = 0, 0
    for k in range(kills):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db), str(start)], stdout=subprocess.PIPE,
                                text=True)
        committed = [int(proc.stdout.readline())]  # its first commit: it is writing now
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        committed += [int(x) for x in proc.stdout.read().split()]
        with Store(db) as store:
            conn = store.db.conn()
            check = conn.execute("PRAGMA integrity_check").fetchone()[0]
            n_rows = conn.execute("SELECT COUNT(*) FROM usage_records").fetchone()[0]
            hourly = conn.execute("SELECT COALESCE(SUM(requests), 0) FROM usage_hourly").fetchone()[0]
            holds = conn.execute("SELECT COUNT(*) FROM budget_reservations").fetchone()[0]
            batches = conn.execute("SELECT COUNT(DISTINCT substr(request_id, 1, instr(request_id, '-')))"
                                   " FROM usage_records").fetchone()[0]
            top = conn.execute("SELECT MAX(CAST(substr(request_id, 2, instr(request_id, '-') - 2) AS INTEGER))"
                               " FROM usage_records").fetchone()[0]
            b = store.budgets.get("acme")
            store.holds.release_all()  # a hold taken for rows that did not commit: the next start-up releases it
            b2 = store.budgets.get("acme")
        # every printed commit is there, and at most one more (committed, killed before it printed)
        printed = rows_before + (max(committed) - start + 1) * 200
        ok = (check == "ok" and n_rows in (printed, printed + 200) and hourly == n_rows and batches * 200 == n_rows
              and b.spent == pytest.approx(n_rows * 1e-6, rel=1e-9) and holds in (0, 200)
              and b.reserved == pytest.approx(holds * 2e-6, rel=1e-9, abs=1e-15) and b2.reserved == 0
              and b2.spent == b.spent)
        left_holds += holds > 0
        if not ok:
            bad.append((k, check, n_rows, printed, hourly, batches, holds, b, b2))
        rows_before, start = n_rows, top + 1
    figures.record("restart", "SIGKILL mid store write: stores not clean", len(bad), "0", not bad,
                   f"{kills} kills of a process committing 200 usage rows a transaction (and their budget "
                   f"holds in one before); {left_holds} left holds that the next start-up released")
    assert not bad, bad
