"""Budgets and rate limits: the store's holds (all or nothing, settled once by the usage row, released,
expired, rolled into a new period; rate windows counted and given back), and through the server: 200
concurrent requests against a budget that covers about 50 never overspend it and serve at least 45 (the
refused get 429 insufficient_quota); a rate limit answers 429 rate_limit_exceeded with Retry-After and
x-ratelimit-* headers."""
from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import httpx
import pytest

from kvserve.config import ServedModel, ServerConfig
from kvserve.metering.budgets import Budget, period_end, period_start
from kvserve.store import Store, UsageRecord

T0 = datetime(2026, 3, 31, 23, 0, tzinfo=timezone.utc).timestamp()  # an hour before a day and a month end


class Clock:
    def __init__(self, t: float = T0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(store_target, clock):  # SQLite and PostgreSQL alike
    s = Store(store_target, clock=clock, scrypt_n=2**10, auth_cache_ttl_s=0)
    s.create_tenant("acme")
    yield s
    s.close()


def usage(rid: str, price: float, model: str = "m", tokens: int = 2) -> UsageRecord:
    return UsageRecord(request_id=rid, tenant="acme", model=model, prompt_tokens=1, completion_tokens=tokens - 1,
                       price=price)


def hold(store, model: str, *asks) -> object:
    """store.holds.admit with (request id, dollars) asks of 10 tokens each; the refusing budget, or None."""
    return store.holds.admit("acme", model, [(rid, dollars, 10) for rid, dollars in asks]).short


def test_periods():
    assert period_start("day", T0) == datetime(2026, 3, 31, tzinfo=timezone.utc).timestamp()
    assert period_start("month", T0) == datetime(2026, 3, 1, tzinfo=timezone.utc).timestamp()
    assert period_end("month", T0) == datetime(2026, 4, 1, tzinfo=timezone.utc).timestamp()
    assert period_end("month", datetime(2026, 12, 9, tzinfo=timezone.utc).timestamp()) == \
        datetime(2027, 1, 1, tzinfo=timezone.utc).timestamp()
    assert period_start("none", T0) == 0.0 and period_end("none", T0) is None
    with pytest.raises(ValueError, match="period"):
        period_start("week", T0)
    assert Budget("a", "*", 1.0, "day", spent=0.5, reserved=0.25).remaining == 0.25


def test_reservations_hold_settle_once_and_release(store):
    b = store.budgets
    b.set_budget("acme", 1.0, "month")
    assert hold(store, "m", ("r1", 0.4), ("r2", 0.4)) is None
    short = hold(store, "m", ("r3", 0.3))  # 0.8 held: 0.3 more does not fit
    assert short is not None and short.remaining == pytest.approx(0.2)
    assert store.usage.record(usage("r1", 0.1))  # settles r1: 0.4 held -> 0.1 spent
    assert not store.usage.record(usage("r1", 0.1))  # the same request again: not charged twice
    got = b.get("acme")
    assert (got.spent, got.reserved) == (pytest.approx(0.1), pytest.approx(0.4))
    store.holds.release("acme", ["r2"])
    assert b.get("acme").reserved == pytest.approx(0.0)
    assert hold(store, "m", ("r3", 0.9)) is None
    assert hold(store, "m", ("r4", 0.01)) is not None
    assert store.holds.admit("other", "m", [("x", 100.0, 10)]).admitted  # no budget, no limit


def test_a_model_budget_and_the_tenant_budget_both_apply(store):
    b = store.budgets
    b.set_budget("acme", 1.0, "none")
    b.set_budget("acme", 0.3, "day", model="big")
    assert hold(store, "big", ("a", 0.25)) is None
    assert hold(store, "big", ("b", 0.1)).model == "big"
    assert hold(store, "small", ("c", 0.7)) is None  # only the all-models budget applies
    assert hold(store, "small", ("d", 0.1)).model == "*"
    store.usage.record(usage("a", 0.2, model="big"))
    assert b.get("acme", "big").spent == pytest.approx(0.2) and b.get("acme").spent == pytest.approx(0.2)


def test_a_new_period_starts_from_zero_and_stale_holds_expire(store, clock):
    b = store.budgets
    b.set_budget("acme", 1.0, "day")
    hold(store, "m", ("r1", 0.5))
    store.usage.record(usage("r1", 0.5))
    assert hold(store, "m", ("r2", 0.6)) is not None
    clock.t += 3600  # midnight: a new day
    assert b.get("acme").spent == 0.0
    assert hold(store, "m", ("r2", 0.6)) is None
    clock.t += store.holds.hold_lease_s + 1  # its gateway died: the hold's lease lapses
    assert b.get("acme").reserved == 0.0
    store.usage.record(usage("r2", 0.2))  # a late row is still charged
    assert b.get("acme").spent == pytest.approx(0.2)


def test_holds_renewed_by_their_process_stay_and_a_dead_process_holds_lapse_within_a_lease(store, clock):
    """Two gateways on one store: the live one renews its holds (the gate's loop); the other was SIGKILLed
    with a request in flight, and its hold lapses a lease later instead of staying."""
    from kvserve.config import ModelPrice
    from kvserve.metering.prices import worst_case_price
    from kvserve.service.gate import MeteringGate
    from kvserve.store import AsyncStore

    b, lease, price = store.budgets, store.holds.hold_lease_s, ModelPrice(input=1000.0, output=1000.0)
    worst = worst_case_price(price, "interactive", 10, 10)
    b.set_budget("acme", 1.0, "month")
    assert hold(store, "m", ("dead", 0.4)) is None

    async def run():
        gate = MeteringGate()
        gate.open(AsyncStore(store))
        await gate.admit("acme", "m", price, "interactive", [("live", 10, 10), ("done", 10, 10)])
        assert sorted(gate.held()) == [("acme", "done"), ("acme", "live")]
        assert b.get("acme").reserved == pytest.approx(0.4 + 2 * worst)
        store.usage.record(usage("done", 0.0))  # settled by its usage row
        for _ in range(3):
            clock.t += lease * 2 / 3
            await gate.renew(gate.held())
        assert gate.held() == [("acme", "live")]  # the settled one is forgotten
        hold(store, "m")  # an admission expires what lapsed: "dead" goes, "live" stays
        assert b.get("acme").reserved == pytest.approx(worst)
        await gate.release("acme", ["live"])
        assert gate.held() == [] and b.get("acme").reserved == pytest.approx(0.0)

    asyncio.run(run())
    assert store.holds.renew([("acme", "dead")]) == []  # too late: it is gone


def test_rate_windows_count_refuse_give_back_and_reset(store, clock):
    from kvserve.metering.rate_limits import window_start

    clock.t = window_start(clock.t) + 10
    store.rate_limits.set_limits("acme", rpm=3, tpm=100)
    a = store.holds.admit("acme", "m", [("r1", 0.0, 40)])
    assert a.admitted and (a.rate.requests, a.rate.tokens) == (1, 40)
    assert a.rate.headers()["x-ratelimit-remaining-tokens"] == "60"
    assert a.rate.headers()["x-ratelimit-reset-requests"] == "50s"
    refused = store.holds.admit("acme", "m", [("r2", 0.0, 61)])
    assert refused.rate_limited and refused.rate.reset_s == pytest.approx(50)
    store.usage.record(usage("r1", 0.0, tokens=15))  # used 15 of the 40 counted: 25 come back
    assert store.holds.admit("acme", "m", [("r2", 0.0, 61)]).admitted
    assert store.holds.admit("acme", "m", [("r3", 0.0, 1)]).admitted
    assert store.holds.admit("acme", "m", [("r4", 0.0, 1)]).rate_limited  # the fourth request this minute
    clock.t += 60
    assert store.holds.admit("acme", "m", [("r4", 0.0, 1)]).rate.requests == 1  # a new window
    with pytest.raises(ValueError, match="rpm"):
        store.rate_limits.set_limits("acme", rpm=0, tpm=None)


def test_200_concurrent_requests_never_overspend_a_budget(tiny_llama_gguf, tmp_path, store_target):
    from kvserve.metering.prices import worst_case_price
    from kvserve.server.app import create_app

    model = ServedModel(id="tiny", source=str(tiny_llama_gguf), role="fast",
                        engine_args=dict(dtype="float32", num_gpu_blocks_override=256, max_model_len=128,
                                         max_num_seqs=64,  # 200 at once: no TTFT bound, only the budget refuses
                                         interactive={"max_waiting": 512, "max_ttft_s": float("inf")}))
    app = create_app(ServerConfig(models=[model], home=str(tmp_path), db_path=store_target))
    state = app.state.kv
    prompt, max_tokens = [11, 12, 13, 14, 15], 4
    worst = worst_case_price(model.price, "interactive", len(prompt), max_tokens)
    budget = 50.5 * worst

    async def scenario():
        await state.startup()
        try:
            _, token = await state.store.acreate_tenant("acme")
            await asyncio.to_thread(state.store.store.budgets.set_budget, "acme", budget, "month")
            await asyncio.to_thread(state.store.store.rate_limits.set_limits, "acme", 10_000, None)
            assert await asyncio.to_thread(state.models["tiny"].client.wait_ready, 60)
            auth = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=120) as client:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0}
                responses = await asyncio.gather(*(client.post("/v1/completions", json=body, headers=auth)
                                                   for _ in range(200)))
            await state.service.ledger.flush()
            return responses, await asyncio.to_thread(state.store.store.budgets.get, "acme")
        finally:
            await state.shutdown()

    responses, b = asyncio.run(scenario())
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert all(r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    assert b.spent <= budget + 1e-12 and b.reserved == pytest.approx(0.0, abs=1e-12)
    assert len(served) >= 45
    assert b.spent == pytest.approx(sum(
        worst_case_price(model.price, "interactive", len(prompt), r.json()["usage"]["completion_tokens"])
        for r in served))


def test_a_rate_limited_tenant_gets_429_with_retry_after_and_headers(tiny_llama_gguf, tmp_path):
    import time

    from kvserve.metering.rate_limits import window_start
    from kvserve.server.app import create_app

    model = ServedModel(id="tiny", source=str(tiny_llama_gguf), role="fast",
                        engine_args=dict(dtype="float32", num_gpu_blocks_override=64, max_model_len=128))
    app = create_app(ServerConfig(models=[model], home=str(tmp_path)))
    state = app.state.kv

    async def scenario():
        await state.startup()
        try:
            _, token = await state.store.acreate_tenant("acme")
            assert await asyncio.to_thread(state.models["tiny"].client.wait_ready, 60)
            auth = {"Authorization": f"Bearer {token}"}
            body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
                await client.post("/v1/completions", json=body, headers=auth)  # warm: the three take well under 5 s
                left = window_start(time.time()) + 60 - time.time()
                if left < 5:  # all three in one window
                    await asyncio.sleep(left + 0.01)
                await asyncio.to_thread(state.store.store.rate_limits.set_limits, "acme", 2, None)
                return [await client.post("/v1/completions", json=body, headers=auth) for _ in range(3)]
        finally:
            await state.shutdown()

    ok1, ok2, limited = asyncio.run(scenario())
    assert ok1.status_code == ok2.status_code == 200
    assert ok1.headers["x-ratelimit-limit-requests"] == "2" and ok2.headers["x-ratelimit-remaining-requests"] == "0"
    assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["Retry-After"]) >= 1 and limited.headers["x-ratelimit-remaining-requests"] == "0"


def test_regions_share_a_budget_through_leases_from_the_ledger(store, clock, tmp_path):
    """Two regions' stores (metering/escrow.py): each spends its floor without asking, more only by a lease
    from the ledger (kept in `store`), gives back what it does not need, and starts a new period at its floor."""
    from kvserve.config import EscrowPolicy

    regions, policy = ["a", "b"], EscrowPolicy(floor_fraction=0.1, lease_fraction=0.5, min_lease_fraction=0.02)
    other = Store(tmp_path / "b.db", clock=clock, scrypt_n=2**10, auth_cache_ttl_s=0)
    other.create_tenant("acme")
    for s in (store, other):
        s.budgets.set_budget("acme", 1.0, "day")
        s.budgets.share_with_regions(policy.floor_fraction)
    b = other.budgets.get("acme")
    assert (b.floor, b.allotment, b.cap) == (pytest.approx(0.1), pytest.approx(0.1), pytest.approx(0.1))
    assert hold(other, "m", ("r1", 0.08)) is None
    short = hold(other, "m", ("r2", 0.05))
    assert short is not None and short.fits_globally(0.05) and short.remaining == pytest.approx(0.02)
    # the pool is 1.0 - 2 floors = 0.8: a lease of half of it, more than the 0.03 needed
    got = store.escrow.lease("acme", "*", b.period_start, "b", 0.03, regions, policy)
    assert got == pytest.approx(0.4)
    assert other.budgets.receive("acme", "*", b.period_start, got)
    assert hold(other, "m", ("r2", 0.05)) is None
    assert store.escrow.lease("acme", "*", b.period_start, "a", 0.5, regions, policy) == 0.0  # 0.4 left: not 0.5
    assert store.escrow.lease("acme", "*", b.period_start, "a", 0.1, regions, policy) == pytest.approx(0.2)
    assert store.escrow.lease("acme", "*", b.period_start, "c", 0.1, regions, policy) == 0.0  # not a region
    # b gives back all but 0.05 of its unspent lease; the ledger may grant it again
    start, spare = other.budgets.give_back("acme", "*", keep=0.05)
    assert start == b.period_start and spare == pytest.approx(0.5 - 0.13 - 0.05)
    assert other.budgets.get("acme").allotment == pytest.approx(0.18)
    store.escrow.release("acme", "*", start, "b", spare)
    assert store.escrow.leases("acme", "*", start) == {"a": pytest.approx(0.2), "b": pytest.approx(0.4 - spare)}
    # a lease of a period that ended is not received; the new period starts at the floor
    clock.t += 3600
    assert not other.budgets.receive("acme", "*", b.period_start, 0.3)
    assert other.budgets.get("acme").allotment == pytest.approx(0.1)
    # an admin raises the amount: the floor follows, the lease held stays
    new_start = other.budgets.get("acme").period_start
    assert other.budgets.receive("acme", "*", new_start, 0.05)
    other.budgets.set_budget("acme", 2.0, "day")
    b = other.budgets.get("acme")
    assert (b.floor, b.allotment) == (pytest.approx(0.2), pytest.approx(0.25))
    other.budgets.share_with_regions(None)  # budgets this store's alone again
    assert other.budgets.get("acme").allotment is None and other.budgets.get("acme").cap == 2.0
    other.close()


def test_regions_share_rate_limits_per_window(store, clock, tmp_path):
    """Rate limits leased like budgets, per window (keys '#rpm' and '#tpm'): each region counts its floor of
    the window without asking, more only by a lease; a new window starts at the floors again."""
    from kvserve.config import EscrowPolicy
    from kvserve.metering.rate_limits import window_start

    regions, policy = ["a", "b"], EscrowPolicy(floor_fraction=0.1, lease_fraction=0.5, min_lease_fraction=0.02)
    other = Store(tmp_path / "b.db", clock=clock, scrypt_n=2**10, auth_cache_ttl_s=0)
    other.create_tenant("acme")
    for s in (store, other):
        s.rate_limits.set_limits("acme", 20, 1000)
        s.rate_limits.floor_fraction = policy.floor_fraction
    admit = lambda rid, tokens=10: other.holds.admit("acme", "m", [(rid, 0.0, tokens)])  # noqa: E731
    assert admit("r1").admitted and admit("r2").admitted  # the floor: 2 requests of 20
    refused = admit("r3")
    assert refused.rate_limited and refused.rate.allows_globally(10) and refused.rate.needs(10) == {"#rpm": 1.0}
    start = window_start(clock())
    got = store.escrow.lease("acme", "#rpm", start, "b", 1.0, regions, policy)
    assert got == pytest.approx(8.0)  # half of the pool: 20 - 2 floors = 16
    assert other.rate_limits.receive("acme", "#rpm", start, got)
    assert admit("r3").admitted
    big = admit("r4", tokens=150)  # 30 tokens counted, a floor of 100
    assert big.rate_limited and big.rate.needs(150) == {"#tpm": pytest.approx(80.0)}
    assert store.escrow.lease("acme", "#tpm", start, "b", 80.0, regions, policy) == pytest.approx(400.0)
    assert other.rate_limits.receive("acme", "#tpm", start, 400.0) and admit("r4", tokens=150).admitted
    back = dict((k, v) for k, _, v in other.rate_limits.give_back("acme", keep_fraction=0.05))
    assert back == {"#rpm": pytest.approx(10 - 4 - 1), "#tpm": pytest.approx(500 - 180 - 50)}
    clock.t += 60  # a new window: the floors again, and a lease of the old one is not taken
    assert not other.rate_limits.receive("acme", "#rpm", start, 5.0)
    assert admit("r5").admitted and admit("r6").admitted and admit("r7").rate_limited
    other.close()
