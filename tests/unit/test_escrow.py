"""Budget escrow across regions (metering/escrow.py): whatever the network does (partitions, lost grants, lost
releases), the regions together never spend more than the limit; connected, one busy region can spend all but
the others' floors; partitioned, a region serves up to its allotment and then refuses."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.metering.escrow import EPSILON, EscrowPolicy, Ledger, RegionAccount

REGIONS = ["us", "eu", "ap"]


def accounts(ledger: Ledger) -> dict[str, RegionAccount]:
    return {r: RegionAccount(ledger.limit, ledger.floors[r], ledger.policy) for r in REGIONS}


def refill(ledger: Ledger, acct: RegionAccount, region: str, reply_lost: bool = False) -> None:
    want = acct.wanted(ledger.pool)
    if want:
        got = ledger.grant(region, want)
        if not reply_lost:
            acct.received(got)


OPS = st.lists(st.tuples(st.sampled_from(["spend"] * 4 + ["refill"] * 2 + ["ask", "finish", "give_back", "cut", "heal"]),
                         st.sampled_from(REGIONS), st.floats(0.0, 0.3), st.booleans()), max_size=300)


@settings(max_examples=300, deadline=None)
@given(ops=OPS, limit=st.floats(10.0, 200.0), floor=st.sampled_from([0.0, 0.1, 0.3]))
def test_the_regions_together_never_spend_more_than_the_limit(ops, limit, floor):
    ledger = Ledger(limit, REGIONS, EscrowPolicy(floor_fraction=floor))
    accts = accounts(ledger)
    cut: set[str] = set()
    running: dict[str, list[float]] = {r: [] for r in REGIONS}
    for op, region, share, lost in ops:
        a, amount = accts[region], share * limit
        if op == "spend" and a.reserve(amount):
            running[region].append(amount)
        elif op == "finish" and running[region]:
            reserved = running[region].pop()
            a.settle(reserved, reserved * (0.5 if lost else 1.0))
        elif op == "refill" and region not in cut:
            refill(ledger, a, region, reply_lost=lost)
        elif op == "ask" and region not in cut:  # any lease, whatever the region's policy
            got = ledger.grant(region, amount)
            if not lost:
                a.received(got)
        elif op == "give_back":
            spare = a.give_back()
            if region not in cut and not lost:
                ledger.release(region, spare)
        elif op == "cut":
            cut.add(region)
        elif op == "heal":
            cut.discard(region)
        assert sum(x.spent for x in accts.values()) <= limit + EPSILON
        assert sum(ledger.allotment(r) for r in REGIONS) <= limit + EPSILON
        assert all(x.allotment <= ledger.allotment(r) + EPSILON for r, x in accts.items())


def test_a_busy_region_spends_all_but_the_others_floors_and_a_partitioned_one_refuses_past_its_allotment():
    ledger = Ledger(100.0, REGIONS, EscrowPolicy(floor_fraction=0.1))
    accts = accounts(ledger)
    us = accts["us"]
    spent = 0.0
    for _ in range(1000):  # one busy region, the others idle: requests of 1.0, a refill when it runs low
        if not us.reserve(1.0):
            refill(ledger, us, "us")
            if not us.reserve(1.0):
                break
        spent += 1.0
    assert spent == pytest.approx(80.0)  # 100 less the two idle regions' floors of 10
    # eu is cut off: it serves its floor, then refuses; nothing it does moves the total past the limit
    eu = accts["eu"]
    served = sum(eu.reserve(1.0) for _ in range(50))
    assert served == 10 and spent + served <= 100
    # us gives back what it holds unused; ap, still connected, can lease it
    ap = accts["ap"]
    us.settle(1.0, 0.0)  # a request that cost nothing
    ledger.release("us", us.give_back())
    assert sum(ap.reserve(1.0) for _ in range(10)) == 10  # its floor
    refill(ledger, ap, "ap")
    assert ap.reserve(1.0) and ledger.pool >= 0


def test_policy_and_settlement_errors_are_refused():
    with pytest.raises(ValueError, match="exceed the limit"):
        Ledger(10.0, REGIONS, EscrowPolicy(floor_fraction=0.5))
    with pytest.raises(ValueError, match="within"):
        EscrowPolicy(lease_fraction=1.5)
    a = RegionAccount(10.0, 5.0)
    assert a.reserve(2.0)
    with pytest.raises(ValueError, match="within its reservation"):
        a.settle(2.0, 3.0)
    assert a.wanted() == 0.0 and a.headroom == 3.0
