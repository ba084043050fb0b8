"""Budgets shared by three regions (metering/escrow.py, server/budget_share.py), with real servers: one tenant
spending at all three at once never spends more than its budget in all, and spends more than the regions'
floors (the ledger region's leases move the rest to where it is spent); a region cut off from the ledger
spends at most what it holds and is then refused (429 insufficient_quota naming the ledger), never overspends,
and takes leases again once the ledger answers."""
from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvserve.config import ServedModel
from kvserve.metering.prices import worst_case_price
from kvserve.store.tenants import mint_token
from tests.live_server import LiveServer, free_port, start_all, tiny_model_toml

pytestmark = pytest.mark.timeout(600)

NAMES = ("a", "b", "c")  # "a" keeps the ledger
PROMPT, MAX_TOKENS = [11, 12, 13, 14, 15], 4
FLOOR = 0.1
NO_TTFT_BOUND = "[models.interactive]\nmax_ttft_s = 60.0\n"  # only budgets refuse


def _regions_toml(local: str, ports: dict[str, int]) -> str:
    peers = ", ".join(f'{{name = "{n}", url = "http://127.0.0.1:{p}"}}' for n, p in ports.items() if n != local)
    return (f'\n[regions]\nlocal = "{local}"\nledger = "a"\npeers = [{peers}]\n'
            "[regions.policy]\nprobe_period_s = 0.2\nprobe_timeout_s = 0.5\nstale_after_s = 1.5\n"
            f"[regions.escrow]\nfloor_fraction = {FLOOR}\nrelease_period_s = 0.5\n")


@pytest.fixture
def three_regions(tmp_path, tiny_llama_gguf):
    minted, admin = mint_token(), mint_token()
    ports = {n: free_port() for n in NAMES}
    servers = {}
    for n in NAMES:
        (tmp_path / n).mkdir()
        servers[n] = LiveServer(tmp_path / n, tiny_model_toml(tiny_llama_gguf, extra=NO_TTFT_BOUND) + _regions_toml(n, ports),
                                port=ports[n], minted=minted, admin_minted=admin,
                                env={"KVSERVE_REGION_TOKEN": admin.token})
    start_all(list(servers.values()))
    yield servers
    for s in servers.values():
        s.stop(signal.SIGKILL)


def _worst(tiny_llama_gguf) -> float:
    return worst_case_price(ServedModel(id="tiny", source=str(tiny_llama_gguf)).price, "interactive", len(PROMPT),
                            MAX_TOKENS)


def _set_budget(servers, amount: float) -> None:
    for s in servers.values():
        r = httpx.put(s.base + "/v1/admin/tenants/acme/budget", json={"amount": amount, "period": "month"},
                      headers=s.headers(s.admin_token), timeout=10)
        assert r.status_code == 200, r.text


def _spent(server: LiveServer) -> float:
    """The tenant's spending settled in this region, once no request holds any of it."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        b = httpx.get(server.base + "/v1/admin/budgets", params={"tenant": "acme"},
                      headers=server.headers(server.admin_token), timeout=10).json()["data"][0]
        if b["reserved"] < 1e-12:  # floats: what is left of holds added and taken away
            return b["spent"]
        time.sleep(0.1)
    raise AssertionError("holds were never settled")


def _complete(server: LiveServer) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 1.0}
    return httpx.post(server.base + "/v1/completions", json=body, headers=server.headers(), timeout=60)


def _spend_everywhere(servers: dict, per_region: int, regions=NAMES) -> list[httpx.Response]:
    order = [servers[n] for _ in range(per_region) for n in regions]
    with ThreadPoolExecutor(12) as pool:
        return list(pool.map(_complete, order))


def _refusals_are_quota(responses) -> None:
    for r in responses:
        assert r.status_code == 200 or (r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"), \
            r.text


def test_one_tenant_spending_in_three_regions_never_overspends_and_uses_more_than_the_floors(three_regions,
                                                                                            tiny_llama_gguf):
    servers, worst = three_regions, _worst(tiny_llama_gguf)
    budget = 30.5 * worst  # the floors: 3 requests' worth in each region
    _set_budget(servers, budget)
    responses = _spend_everywhere(servers, 20)
    _refusals_are_quota(responses)
    served = sum(r.status_code == 200 for r in responses)
    spent = sum(_spent(s) for s in servers.values())
    assert spent <= budget + 1e-12
    assert served > 3 * 3 * 2  # well past the floors: leases moved the pool to where it was spent
    by_region = {n: sum(r.status_code == 200 and r.headers["x-kvserve-region"] == n for r in responses) for n in NAMES}
    assert all(by_region.values()), by_region
    # each region's usage rows are of what it served; any region's report merges them all
    def requests_in(page: dict) -> int:
        return sum(r["num_model_requests"] for b in page["data"] for r in b["results"])

    asked = {"regions": "all", "bucket_width": "1d", "limit": 1, "group_by": "tenant"}
    b = servers["b"]
    merged = httpx.get(b.base + "/v1/usage", params=asked, headers=b.headers(), timeout=30).json()
    assert merged["regions"] == {"b": "included", "a": "included", "c": "included"}
    assert requests_in(merged) == served
    local = httpx.get(b.base + "/v1/usage", params={**asked, "regions": "local"}, headers=b.headers(), timeout=30)
    assert requests_in(local.json()) == by_region["b"] and "regions" not in local.json()
    spent_merged = sum(r["amount"]["value"] for bucket in merged["data"] for r in bucket["results"])
    assert spent_merged == pytest.approx(spent, abs=1e-9)


def test_a_region_cut_off_from_the_ledger_spends_at_most_what_it_holds(three_regions, tiny_llama_gguf):
    servers, worst = three_regions, _worst(tiny_llama_gguf)
    budget = 40.5 * worst  # floors: 4 requests' worth each
    _set_budget(servers, budget)
    ledger = servers["a"]
    ledger.proc.send_signal(signal.SIGSTOP)  # partitioned: it neither answers nor dies
    try:
        cut_off = _spend_everywhere(servers, 8, regions=("b", "c"))
        _refusals_are_quota(cut_off)
        served = sum(r.status_code == 200 for r in cut_off)
        assert 0 < served <= 2 * 4  # each its floor at most
        refused = [r for r in cut_off if r.status_code == 429]
        assert refused and all("ledger region a" in r.json()["error"]["message"] for r in refused)
        assert _spent(servers["b"]) + _spent(servers["c"]) <= 2 * FLOOR * budget + 1e-12
    finally:
        ledger.proc.send_signal(signal.SIGCONT)
    later = _spend_everywhere(servers, 6, regions=("b", "c"))
    _refusals_are_quota(later)
    assert sum(r.status_code == 200 for r in later) > 0  # the ledger answers again: leases again
    assert sum(_spent(s) for s in servers.values()) <= budget + 1e-12


def test_a_rate_limit_holds_across_the_regions_within_a_window(three_regions):
    from kvserve.metering.rate_limits import window_start

    servers, rpm = three_regions, 24
    for s in servers.values():
        r = httpx.put(s.base + "/v1/admin/tenants/acme/limits", json={"rpm": rpm},
                      headers=s.headers(s.admin_token), timeout=10)
        assert r.status_code == 200, r.text
    left = window_start(time.time()) + 60 - time.time()
    if left < 25:  # every request in one window (a fixed window lets up to twice the limit across its edge)
        time.sleep(left + 0.05)
    responses = _spend_everywhere(servers, 20)
    for r in responses:
        assert r.status_code == 200 or (r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"), \
            r.text
    served = sum(r.status_code == 200 for r in responses)
    assert 3 * 2 < served <= rpm  # past the floors (2.4 requests each), never past the limit
