"""kvserve.store: migrations, tenants/tokens, usage ledger, idempotency keys, async facade."""
from __future__ import annotations

import asyncio
import os
import re
import sqlite3
import stat
import tempfile
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import kvserve_home
from kvserve.store import (
    AsyncStore,
    BeginOutcome,
    InvalidTenantName,
    SchemaError,
    Store,
    StoreClosedError,
    StoredResponse,
    TenantExistsError,
    TenantNotFoundError,
    TenantRevokedError,
    UsageRecord,
    default_db_path,
    migrate,
    request_body_hash,
)
from kvserve.store import tenants as tenants_mod
from kvserve.store.database import MIGRATIONS, split_sql

FAST_N = 2**10  # scrypt cost for tests; one test below uses the default


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(store_target, clock):  # SQLite and PostgreSQL alike (tests/conftest.py store_target)
    s = Store(store_target, clock=clock, scrypt_n=FAST_N)
    yield s
    s.close()


def rec(i: int | str, tenant: str = "a", model: str = "m1", created_at: float = 1_700_000_000.0, **kw) -> UsageRecord:
    base = dict(request_id=f"req-{i}", tenant=tenant, model=model, tier="interactive", prompt_tokens=10,
                cached_prompt_tokens=4, completion_tokens=5, queue_ms=1.0, ttft_ms=20.0, e2e_ms=100.0,
                status="ok", finish_reason="stop", created_at=created_at,
                finished_at=None if created_at is None else created_at + 0.1)
    base.update(kw)
    return UsageRecord(**base)


# --- data directory ------------------------------------------------------------------------

def test_kvserve_home_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "h"))
    assert kvserve_home() == tmp_path / "h"
    assert default_db_path() == tmp_path / "h" / "kvserve.db"
    monkeypatch.delenv("KVSERVE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kvserve_home() == tmp_path / "home" / ".kvserve"
    monkeypatch.setenv("KVSERVE_HOME", "~/data")
    assert kvserve_home() == tmp_path / "home" / "data"


def test_store_default_path_respects_kvserve_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "state" / "nested"))
    with Store(scrypt_n=FAST_N) as s:
        assert s.path == tmp_path / "state" / "nested" / "kvserve.db"
        s.create_tenant("acme")
    assert (tmp_path / "state" / "nested" / "kvserve.db").is_file()
    assert stat.S_IMODE(os.stat(tmp_path / "state" / "nested" / "kvserve.db").st_mode) == 0o600


# --- migrations ----------------------------------------------------------------------------

def test_migrations_idempotent_and_wal(tmp_path):
    path = tmp_path / "kvserve.db"
    with Store(path, scrypt_n=FAST_N) as s:
        assert s.schema_version == len(MIGRATIONS)
        s.create_tenant("acme")
        s.record_usage(rec(1))
    with Store(path, scrypt_n=FAST_N) as s:  # second open: nothing re-applied, data intact
        assert s.schema_version == len(MIGRATIONS)
        assert [t.name for t in s.list_tenants()] == ["acme"]
        assert s.usage_totals("a")[0]["requests"] == 1
        conn = s.db.conn()
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(v,) for v, _ in MIGRATIONS]
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert migrate(conn) == len(MIGRATIONS)
    conn = sqlite3.connect(path)
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"usage_tenant_created", "api_tokens_tenant", "idempotency_created"} <= indexes
    conn.close()


def test_failed_migration_rolls_back(tmp_path):
    conn = sqlite3.connect(tmp_path / "m.db", isolation_level=None)
    good = (1, "CREATE TABLE a (x INTEGER);")
    bad = (2, "CREATE TABLE b (x INTEGER); INSERT INTO a VALUES (1); THIS IS NOT SQL;")
    with pytest.raises(sqlite3.OperationalError):
        migrate(conn, [good, bad])
    tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert "a" in tables and "b" not in tables
    assert conn.execute("SELECT COUNT(*) FROM a").fetchone()[0] == 0
    assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == 1
    assert migrate(conn, [good, (2, "CREATE TABLE b (x INTEGER);")]) == 2
    with pytest.raises(SchemaError):  # database newer than the code
        migrate(conn, [good])
    with pytest.raises(SchemaError):  # malformed list
        migrate(conn, [(1, "SELECT 1;"), (3, "SELECT 1;")])
    conn.close()


def test_adapter_migration_keeps_an_existing_ledger(store_target):
    """Migration 12 on a database at version 11 with usage in it (SQLite and PostgreSQL): the ledger and its
    roll-ups keep every row, as the base model's; the roll-ups then key on the adapter too."""
    from kvserve.store.database import Database

    assert MIGRATIONS[11][0] == 12
    hour = 1_700_000_000.0 - 1_700_000_000.0 % 86400
    old = Database(store_target, migrations=MIGRATIONS[:11])
    assert old.schema_version == 11
    with old.write() as conn:
        for i, tier in enumerate(("interactive", "interactive", "batch")):
            conn.execute("INSERT INTO usage_records (request_id, tenant, model, tier, prompt_tokens,"
                         " cached_prompt_tokens, completion_tokens, status, created_at, price, cost, engine_s,"
                         " disk_cached_prompt_tokens) VALUES (?, 'a', 'tiny', ?, 10, 4, 5, 'ok', ?, 0.5, 0.25, 1.0, 2)",
                         (f"old-{i}", tier, hour + i))
        for table, col, width in (("usage_hourly", "hour", 3600), ("usage_daily", "day", 86400)):
            for tier, n in (("interactive", 2), ("batch", 1)):
                conn.execute(f"INSERT INTO {table} ({col}, tenant, model, tier, requests, prompt_tokens,"
                             " cached_prompt_tokens, completion_tokens, price, cost, engine_s,"
                             " disk_cached_prompt_tokens) VALUES (?, 'a', 'tiny', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                             (hour // width * width, tier, n, 10 * n, 4 * n, 5 * n, 0.5 * n, 0.25 * n, 1.0 * n, 2 * n))
    old.close()
    with Store(store_target, scrypt_n=FAST_N) as s:
        assert s.schema_version == len(MIGRATIONS) >= 12
        assert s.usage.get("a", "old-0").adapter is None
        s.record_usage_many([rec("new-base", model="tiny", created_at=hour + 10),
                             rec("new-sql", model="tiny", created_at=hour + 20, adapter="sql")])
        for start, width in ((hour, 86400), (hour, 3600), (hour - 1800, 86400)):  # daily, hourly roll-up, the rows
            rows = s.usage.buckets(start, start + 86400, width, ["model", "tier", "adapter"])
            got = [(r["model"], r["tier"], r["adapter"], r["requests"], r["input_disk_cached_tokens"], r["amount"])
                   for r in rows if r["bucket"] == 0]
            assert got == [("tiny", "batch", None, 1, 2, 0.5), ("tiny", "interactive", None, 3, 2 * 2, 1.0),
                           ("tiny", "interactive", "sql", 1, 0, 0.0)], (start, width, got)
        for table in ("usage_hourly", "usage_daily"):
            keys = s.db.conn().execute(f"SELECT tier, adapter, requests FROM {table} ORDER BY 1, 2").fetchall()
            assert [tuple(k) for k in keys] == [("batch", "", 1), ("interactive", "", 3), ("interactive", "sql", 1)]


def test_split_sql_respects_strings_and_comments():
    sql = "CREATE TABLE t (s TEXT DEFAULT 'a;b'); -- c;d\nINSERT INTO t VALUES ('x;y');\n"
    assert split_sql(sql) == ["CREATE TABLE t (s TEXT DEFAULT 'a;b');", "-- c;d\nINSERT INTO t VALUES ('x;y');"]


# --- tenants and tokens --------------------------------------------------------------------

def test_token_shown_once_and_stored_hashed(store):
    tenant, token = store.create_tenant("acme")
    extra = store.create_token("acme")
    assert re.fullmatch(r"kvs-[A-Za-z0-9_-]{43}", token) and token != extra
    assert tenant.name == "acme" and not tenant.revoked
    rows = store.db.conn().execute("SELECT prefix, hash FROM api_tokens ORDER BY id").fetchall()
    assert [r[0] for r in rows] == [token[4:12], extra[4:12]]
    assert all(r[1].startswith("scrypt$") for r in rows)
    if not store.db.postgres:  # the file itself holds no token (the rows above show the same for PostgreSQL)
        store.db.conn().execute("PRAGMA wal_checkpoint(PASSIVE)")
        blob = b"".join(p.read_bytes() for p in store.path.parent.iterdir() if p.name.startswith("kvserve.db"))
        for t in (token, extra):
            assert t.encode() not in blob
            assert t[12:].encode() not in blob  # the secret part, in any form
    # listings never show more than the prefix
    assert [i.prefix for i in store.list_tokens("acme")] == [token[:12], extra[:12]]


def test_default_scrypt_cost_roundtrip(tmp_path):
    with Store(tmp_path / "d.db") as s:  # production parameters, once
        _, token = s.create_tenant("acme")
        h = s.db.conn().execute("SELECT hash FROM api_tokens").fetchone()[0]
        assert h.startswith(f"scrypt${tenants_mod.DEFAULT_SCRYPT_N}$8$1$")
        assert s.authenticate(token).name == "acme"


def test_authenticate_ok_and_bad(store):
    _, ta = store.create_tenant("a")
    _, tb = store.create_tenant("b")
    assert store.authenticate(ta).name == "a"
    assert store.authenticate(tb).name == "b"
    same_prefix_wrong_secret = ta[:12] + ("A" if ta[12] != "A" else "B") + ta[13:]
    for bad in (same_prefix_wrong_secret, "kvs-" + "x" * 43, "", "Bearer " + ta, ta + "x", ta[:-1],
                "kvs-short", None, 123, "kvs-" + "a" * 10_000):
        assert store.authenticate(bad) is None, bad


def test_revoke_token_takes_effect_immediately_despite_cache(store, monkeypatch):
    calls = []
    real_verify = tenants_mod.verify_token_hash
    monkeypatch.setattr(tenants_mod, "verify_token_hash", lambda t, h: calls.append(1) or real_verify(t, h))
    _, t1 = store.create_tenant("acme")
    t2 = store.create_token("acme")
    assert store.authenticate(t1).name == "acme"
    assert store.authenticate(t1).name == "acme"
    assert len(calls) == 1  # second one came from the cache
    assert store.revoke_token(t1[:12])  # by "kvs-XXXXXXXX" prefix
    assert store.authenticate(t1) is None
    assert store.authenticate(t2).name == "acme"  # other tokens unaffected
    assert not store.revoke_token(t1[:12])  # already revoked
    # by full token: a wrong secret with the right prefix revokes nothing
    wrong = t2[:12] + ("A" if t2[12] != "A" else "B") + t2[13:]
    assert not store.revoke_token(wrong)
    assert store.authenticate(t2).name == "acme"
    assert store.revoke_token(t2)
    assert store.authenticate(t2) is None
    t3 = store.create_token("acme")
    assert store.revoke_token(t3[4:12])  # bare prefix
    assert store.authenticate(t3) is None
    assert not store.revoke_token("nope")
    assert store.list_tenants()[0].active_tokens == 0


def test_revoke_tenant(store):
    _, t1 = store.create_tenant("acme")
    t2 = store.create_token("acme")
    _, other = store.create_tenant("other")
    assert store.authenticate(t1) and store.authenticate(t2)
    assert store.revoke_tenant("acme")
    assert store.authenticate(t1) is None and store.authenticate(t2) is None
    assert store.authenticate(other).name == "other"
    assert not store.revoke_tenant("acme") and not store.revoke_tenant("ghost")
    with pytest.raises(TenantRevokedError):
        store.create_token("acme")
    with pytest.raises(TenantNotFoundError):
        store.create_token("ghost")
    with pytest.raises(TenantExistsError):
        store.create_tenant("acme")
    infos = {i.name: i for i in store.list_tenants()}
    assert infos["acme"].revoked and infos["acme"].active_tokens == 0
    assert not infos["other"].revoked and infos["other"].active_tokens == 1
    assert store.get_tenant("acme").revoked


def test_auth_cache_ttl_and_cross_process_revocation(tmp_path, clock, monkeypatch):
    path = tmp_path / "kvserve.db"
    s1 = Store(path, clock=clock, scrypt_n=FAST_N, auth_cache_ttl_s=30)
    s2 = Store(path, clock=clock, scrypt_n=FAST_N)  # stands in for another process
    calls = []
    real_verify = tenants_mod.verify_token_hash
    monkeypatch.setattr(tenants_mod, "verify_token_hash", lambda t, h: calls.append(1) or real_verify(t, h))
    _, token = s1.create_tenant("acme")
    assert s1.authenticate(token) and len(calls) == 1
    clock.advance(29)
    assert s1.authenticate(token) and len(calls) == 1
    clock.advance(2)  # past the TTL: hashed again
    assert s1.authenticate(token) and len(calls) == 2
    assert s2.revoke_token(token[:12])
    assert s1.authenticate(token) is not None  # other process: stale for at most the TTL
    clock.advance(31)
    assert s1.authenticate(token) is None
    s1.close()
    s2.close()


def test_auth_cache_drops_put_racing_a_revocation():
    cache = tenants_mod._AuthCache(ttl_s=30, maxsize=2)
    t = tenants_mod.Tenant(id=1, name="a", created_at=0.0)
    gen = cache.generation  # a lookup starts...
    cache.invalidate(token_id=7)  # ...a revoke lands...
    cache.put(b"k", t, 7, gen, now=0.0)  # ...the lookup's result must not be cached
    assert cache.get(b"k", 0.0) is None
    for i in range(3):  # LRU bound
        cache.put(bytes([i]), t, i, cache.generation, now=0.0)
    assert len(cache) == 2 and cache.get(bytes([0]), 0.0) is None


@pytest.mark.parametrize("name", ["", "a" * 65, "has space", "slash/", "ümlaut", "semi;colon", None])
def test_tenant_name_validation(store, name):
    with pytest.raises(InvalidTenantName):
        store.create_tenant(name)


def test_tenant_name_edge_cases_accepted(store):
    for name in ("a", "A" * 64, "team_1.prod-eu"):
        tenant, _ = store.create_tenant(name)
        assert tenant.name == name
    assert [i.name for i in store.list_tenants()] == sorted(["a", "A" * 64, "team_1.prod-eu"])


# --- usage ---------------------------------------------------------------------------------

def test_usage_totals_tenant_isolation(store):
    store.record_usage(rec(1, tenant="a"))
    store.record_usage(rec(2, tenant="a", completion_tokens=7, disk_cached_prompt_tokens=3))
    store.record_usage(rec(3, tenant="b", prompt_tokens=1000, cached_prompt_tokens=0))
    [a] = store.usage_totals("a")
    assert a == {"requests": 2, "prompt_tokens": 20, "cached_prompt_tokens": 8, "disk_cached_prompt_tokens": 3,
                 "host_cached_prompt_tokens": 0, "completion_tokens": 12, "total_tokens": 32}
    assert store.usage_totals("b")[0]["prompt_tokens"] == 1000
    assert store.usage_totals("nobody") == [{"requests": 0, "prompt_tokens": 0, "cached_prompt_tokens": 0,
                                              "disk_cached_prompt_tokens": 0, "host_cached_prompt_tokens": 0,
                                              "completion_tokens": 0, "total_tokens": 0}]
    with pytest.raises(ValueError):  # more from the disk than cached at all
        store.record_usage(rec(9, tenant="a", disk_cached_prompt_tokens=3, host_cached_prompt_tokens=2))
    assert store.usage_totals("a", group_by="model") == [dict(a, model="m1")]
    # same request id in another tenant is a different request; a repeat in the same tenant is ignored
    assert store.record_usage(rec(1, tenant="b"))
    assert not store.record_usage(rec(1, tenant="a", prompt_tokens=999))
    assert store.usage_totals("a")[0]["requests"] == 2
    with pytest.raises(ValueError):
        store.usage_totals("")


def test_usage_group_by_model_and_day_and_window(store, clock):
    day0 = datetime(2026, 3, 1, 23, 59, tzinfo=timezone.utc).timestamp()
    day1 = datetime(2026, 3, 2, 0, 1, tzinfo=timezone.utc).timestamp()
    store.record_usage_many([
        rec(1, model="llama", created_at=day0),
        rec(2, model="gemma", created_at=day0, completion_tokens=1),
        rec(3, model="llama", created_at=day1, prompt_tokens=3, cached_prompt_tokens=0),
        rec(4, tenant="b", model="other", created_at=day1),
    ])
    by_model = store.usage_totals("a", group_by="model")
    assert [(r["model"], r["requests"], r["total_tokens"]) for r in by_model] == [("gemma", 1, 11), ("llama", 2, 23)]
    by_day = store.usage_totals("a", group_by="day")
    assert [(r["day"], r["requests"]) for r in by_day] == [("2026-03-01", 2), ("2026-03-02", 1)]
    # since inclusive, until exclusive; datetimes accepted
    assert store.usage_totals("a", since=day1)[0]["requests"] == 1
    assert store.usage_totals("a", until=day1)[0]["requests"] == 2
    assert store.usage_totals("a", since=datetime.fromtimestamp(day0, timezone.utc),
                              until=datetime.fromtimestamp(day1, timezone.utc))[0]["requests"] == 2
    assert store.usage_totals("a", since=day1 + 1, group_by="model") == []
    with pytest.raises(ValueError):
        store.usage_totals("a", group_by="tenant")


def test_usage_record_validation_and_defaults(store, clock):
    for bad in (dict(tier="gold"), dict(prompt_tokens=-1), dict(cached_prompt_tokens=11), dict(tenant=""),
                dict(completion_tokens=1.5), dict(status=""), dict(adapter=""), dict(adapter=3)):
        with pytest.raises(ValueError):
            store.record_usage(rec("bad", **bad))
    store.record_usage(rec("x", created_at=None, tier="batch", status="aborted", finish_reason=None, ttft_ms=None))
    got = store.usage.get("a", "req-x")
    assert got.created_at == clock.t and got.tier == "batch" and got.status == "aborted" and got.ttft_ms is None
    assert got.adapter is None
    store.record_usage(rec("y", adapter="sql"))
    assert store.usage.get("a", "req-y").adapter == "sql"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["t1", "t2", "t3"]), st.sampled_from(["m1", "m2"]),
                          st.integers(0, 500), st.integers(0, 500), st.integers(0, 3)), max_size=25))
def test_usage_totals_match_model(rows):
    with tempfile.TemporaryDirectory() as d, Store(Path(d) / "k.db", scrypt_n=FAST_N) as s:
        s.record_usage_many([rec(i, tenant=t, model=m, prompt_tokens=p, cached_prompt_tokens=p // 2,
                                 completion_tokens=c, created_at=1_700_000_000.0 + 86400 * day)
                             for i, (t, m, p, c, day) in enumerate(rows)])
        for tenant in ("t1", "t2", "t3"):
            mine = [r for r in rows if r[0] == tenant]
            [tot] = s.usage_totals(tenant)
            assert tot["requests"] == len(mine)
            assert tot["prompt_tokens"] == sum(r[2] for r in mine)
            assert tot["cached_prompt_tokens"] == sum(r[2] // 2 for r in mine)
            assert tot["total_tokens"] == sum(r[2] + r[3] for r in mine)
            by_model = {r["model"]: r["completion_tokens"] for r in s.usage_totals(tenant, group_by="model")}
            assert by_model == {m: sum(r[3] for r in mine if r[1] == m) for m in {r[1] for r in mine}}
            assert sum(r["requests"] for r in s.usage_totals(tenant, group_by="day")) == len(mine)


# --- idempotency ---------------------------------------------------------------------------

def test_idempotency_lifecycle(store):
    h = request_body_hash({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert store.begin_idempotent("a", "k1", h).outcome is BeginOutcome.NEW
    assert store.begin_idempotent("a", "k1", h).outcome is BeginOutcome.IN_PROGRESS
    assert store.begin_idempotent("a", "k1", "other").outcome is BeginOutcome.MISMATCH
    assert store.begin_idempotent("b", "k1", "other").outcome is BeginOutcome.NEW  # keys are per tenant
    resp = StoredResponse(200, {"content-type": "application/json", "x-request-id": "r1"}, body=b'{"ok":true}\x00')
    assert store.complete_idempotent("a", "k1", resp)
    r = store.begin_idempotent("a", "k1", h)
    assert r.outcome is BeginOutcome.REPLAY and r.response == resp and not r.response.is_stream
    assert store.begin_idempotent("a", "k1", "other").outcome is BeginOutcome.MISMATCH
    assert not store.complete_idempotent("a", "k1", resp)  # only an in-progress key can complete
    assert not store.abandon_idempotent("a", "k1")  # a done key is not abandoned
    # streaming response: the SSE events replay in order
    events = ['data: {"x": 1}\n\n', "data: [DONE]\n\n"]
    store.begin_idempotent("a", "k2", h)
    assert store.complete_idempotent("a", "k2", StoredResponse(200, {"content-type": "text/event-stream"},
                                                                events=events))
    r = store.begin_idempotent("a", "k2", h)
    assert r.outcome is BeginOutcome.REPLAY and r.response.events == events and r.response.body is None


def test_idempotency_abandon_allows_retry(store):
    assert store.begin_idempotent("a", "k", "h1").new
    assert store.abandon_idempotent("a", "k")
    assert not store.abandon_idempotent("a", "k")
    assert store.begin_idempotent("a", "k", "h2").new  # the retry may even change the body
    assert store.idempotency.reset_in_progress() == 1
    assert store.begin_idempotent("a", "k", "h1").new


def test_idempotency_lease_frees_a_key_whose_process_died(store, clock):
    lease = store.idempotency.lease_s
    assert store.begin_idempotent("a", "alive", "h").new and store.begin_idempotent("a", "dead", "h").new
    for _ in range(4):  # the holder of "alive" renews it a few times a lease; "dead"'s holder is gone
        clock.advance(lease / 3)
        assert store.idempotency.renew([("a", "alive")]) == 1
    assert store.begin_idempotent("a", "alive", "h").outcome is BeginOutcome.IN_PROGRESS
    assert store.begin_idempotent("a", "dead", "h").new  # lapsed: the retry runs afresh, and now holds it
    assert store.begin_idempotent("a", "dead", "h").outcome is BeginOutcome.IN_PROGRESS
    assert store.complete_idempotent("a", "alive", StoredResponse(200, body=b"x"))
    assert store.idempotency.renew([("a", "alive")]) == 0  # a done key has no lease
    clock.advance(10 * lease)
    assert store.begin_idempotent("a", "alive", "h").outcome is BeginOutcome.REPLAY  # done keys never lapse


def test_idempotency_expiry_and_purge(store, clock):
    store.begin_idempotent("a", "old", "h")
    store.complete_idempotent("a", "old", StoredResponse(200, body=b"x"))
    store.begin_idempotent("a", "stuck", "h")  # in progress forever (process died)
    clock.advance(12 * 3600)
    store.begin_idempotent("a", "young", "h")
    clock.advance(12 * 3600 - 1)
    assert store.begin_idempotent("a", "old", "h").outcome is BeginOutcome.REPLAY
    clock.advance(1)  # 24 h after "old" began: treated as absent
    assert store.begin_idempotent("a", "old", "different").new
    assert store.purge_expired() == 1  # "stuck"; "old" was replaced, "young" is 12 h old
    keys = {r[0] for r in store.db.conn().execute("SELECT key FROM idempotency_keys")}
    assert keys == {"old", "young"}
    clock.advance(24 * 3600)
    assert store.purge_expired() == 2


def test_request_body_hash_canonical_and_key_validation(store):
    assert request_body_hash({"a": 1, "b": [1, 2]}) == request_body_hash({"b": [1, 2], "a": 1})
    assert request_body_hash({"a": 1}) != request_body_hash({"a": 2})
    assert request_body_hash({"s": "é"}) != request_body_hash({"s": "e"})
    for bad in ("", "x" * 256, "a\nb", None):
        with pytest.raises(ValueError):
            store.begin_idempotent("a", bad, "h")


# --- async facade and concurrency ----------------------------------------------------------

def test_async_concurrent_writes_all_land(tmp_path):
    async def main():
        async with await AsyncStore.aopen(tmp_path / "kvserve.db", scrypt_n=FAST_N) as astore:
            await asyncio.gather(*(astore.arecord_usage(rec(i, tenant=f"t{i % 3}")) for i in range(300)))
            totals = await asyncio.gather(*(astore.ausage_totals(f"t{i}") for i in range(3)))
            assert [t[0]["requests"] for t in totals] == [100, 100, 100]
            assert await astore.arecord_usage_many([rec(i, tenant="t0") for i in (0, 3, 297, 1000, 1001)]) == 2
            # concurrent begin on one key: exactly one owner
            results = await asyncio.gather(*(astore.abegin_idempotent("t0", "k", "h") for _ in range(40)))
            outcomes = [r.outcome for r in results]
            assert outcomes.count(BeginOutcome.NEW) == 1
            assert outcomes.count(BeginOutcome.IN_PROGRESS) == 39
            assert await astore.acomplete_idempotent("t0", "k", StoredResponse(201, body=b"done"))
            r = await astore.abegin_idempotent("t0", "k", "h")
            assert r.outcome is BeginOutcome.REPLAY and r.response.status_code == 201
            assert await astore.abegin_idempotent("t0", "k", "h2") == await astore.abegin_idempotent("t0", "k", "h3")
            assert (await astore.abegin_idempotent("t0", "k2", "h")).new
            assert await astore.aabandon_idempotent("t0", "k2")
            assert await astore.apurge_expired() == 0
        with pytest.raises(RuntimeError):
            await astore.arecord_usage(rec("late"))

    asyncio.run(main())
    with Store(tmp_path / "kvserve.db", scrypt_n=FAST_N) as s:  # durable after close
        assert s.usage_totals("t0")[0]["requests"] == 102


def test_async_off_loop_and_single_writer_thread(tmp_path, monkeypatch):
    async def main():
        astore = AsyncStore.open(tmp_path / "kvserve.db", scrypt_n=FAST_N)
        loop_thread = threading.get_ident()
        seen: dict[str, set[str]] = {"write": set(), "auth": set()}
        real_record, real_auth = astore.store.usage.record, astore.store.tenants.authenticate

        def record(r):
            assert threading.get_ident() != loop_thread
            seen["write"].add(threading.current_thread().name)
            return real_record(r)

        def auth(t):
            assert threading.get_ident() != loop_thread
            seen["auth"].add(threading.current_thread().name)
            return real_auth(t)

        monkeypatch.setattr(astore.store.usage, "record", record)
        monkeypatch.setattr(astore.store.tenants, "authenticate", auth)
        tenant, token = await astore.acreate_tenant("acme")
        extra = await astore.acreate_token(tenant)
        await asyncio.gather(*(astore.arecord_usage(rec(i, tenant="acme")) for i in range(50)))
        assert len(seen["write"]) == 1 and next(iter(seen["write"])).startswith("kvserve-store-writer")

        assert (await astore.aauthenticate(token)).name == "acme"
        assert len(seen["auth"]) == 1
        assert (await astore.aauthenticate(token)).name == "acme"  # cache hit: served on the loop
        assert len(seen["auth"]) == 1 and all(n.startswith("kvserve-store-reader") for n in seen["auth"])
        assert await astore.aauthenticate("kvs-nope") is None
        assert await astore.arevoke_token(token)
        assert await astore.aauthenticate(token) is None
        assert (await astore.aauthenticate(extra)).name == "acme"
        assert [i.active_tokens for i in await astore.alist_tenants()] == [1]
        assert len(await astore.alist_tokens("acme")) == 2
        assert (await astore.aget_tenant("acme")).name == "acme"
        assert await astore.arevoke_tenant("acme")
        assert await astore.aauthenticate(extra) is None
        await astore.aclose()

    asyncio.run(main())


def test_sync_store_threads_write_concurrently(store):
    errors = []

    def worker(w):
        try:
            for i in range(25):
                store.record_usage(rec(f"{w}-{i}"))
            store.begin_idempotent("a", "shared", "h")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.usage_totals("a")[0]["requests"] == 100
    assert len(store.db._conns) == 5  # the fixture's thread + one per worker


def test_closed_store_refuses(tmp_path):
    s = Store(tmp_path / "kvserve.db", scrypt_n=FAST_N)
    s.close()
    with pytest.raises(StoreClosedError):
        s.list_tenants()
