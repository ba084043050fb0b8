"""The dashboard in a real headless Chromium (Debian's chromium and chromedriver, driven by Selenium) against
a real kvserve server (a subprocess, two tiny models): 20 requests from two tenants on both models and tiers,
over a ledger the test first fills with a day of usage rows (so the time axis has a day to draw: hourly
buckets). The page loads with no console error and no third-party URL, its figures are what /v1/usage says,
its uPlot charts hold data, and it uses the width at 1366 and 1920 px.

Screenshots: with KVSERVE_SCREENSHOT_DIR set, the 1366 px one is written there as dashboard.png (that is how
docs/dashboard.png is made) and the 1920 px one as dashboard-1920.png."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from kvserve.metering.money import format_money

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER) and os.environ.get("KVSERVE_REQUIRE_BROWSER") != "1":
    pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)",
                allow_module_level=True)

MODELS = ("tiny-a", "tiny-b")
OUTPUT_PRICE = {"tiny-a": 0.08, "tiny-b": 0.16}  # dollars per million output tokens
HISTORY_HOURS = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _history(now: float):
    """A day of usage rows before the test's requests: each hour, 1 to 4 requests per tenant, model and tier,
    priced by the models' prices (the fixture's [models.price]) and costed at 1.5 ms of engine time a token."""
    from kvserve.config import ModelPrice
    from kvserve.metering.prices import request_cost, request_price
    from kvserve.store import UsageRecord

    rows = []
    for h in range(1, HISTORY_HOURS + 1):
        for tenant in ("acme", "beta"):
            for m, model in enumerate(MODELS):
                for tier in ("interactive", "batch"):
                    for k in range(1 + (h + m) % 4):
                        out = 600 + 40 * h
                        rows.append(UsageRecord(
                            request_id=f"hist-{h}-{tenant}-{model}-{tier}-{k}", tenant=tenant, model=model, tier=tier,
                            prompt_tokens=1500, cached_prompt_tokens=500, completion_tokens=out,
                            created_at=now - h * 3600 + 60 * k, engine_s=0.0015 * out,
                            price=request_price(ModelPrice(output=OUTPUT_PRICE[model]), tier, 1500, 500, out),
                            cost=request_cost(ModelPrice(), 0.0015 * out),
                            adapter="sql" if model == "tiny-a" and k == 1 else None))  # a LoRA adapter's
    return rows


@pytest.fixture
def server(tiny_llama_gguf, tmp_path):
    port = _free_port()
    config = tmp_path / "models.toml"
    models = "".join(f'[[models]]\nid = "{m}"\nsource = "{tiny_llama_gguf}"\ndtype = "float32"\nmax_model_len = 128\n'
                     f'num_gpu_blocks_override = 64\n[models.price]\noutput = {OUTPUT_PRICE[m]}\n' for m in MODELS)
    config.write_text(f'[server]\nhome = "{tmp_path}"\nload_sample_interval_s = 0.5\n{models}')
    env = {**os.environ, "KVSERVE_HOME": str(tmp_path)}
    from kvserve.store import Store

    with Store(tmp_path / "kvserve.db") as store:
        _, admin = store.create_tenant("root", admin=True)
        tokens = {name: store.create_tenant(name)[1] for name in ("acme", "beta")}
        store.record_usage_many(_history(time.time()))
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), "--config", str(config)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        else:
            raise AssertionError((tmp_path / "server.log").read_text()[-3000:])
        yield base, admin, tokens
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _browser(width: int):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", f"--window-size={width},1000",
                "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


CHARTS_JS = """return Object.entries(window.kvCharts).map(([name, u]) => ({name, width: u.width,
  labels: u.series.slice(1).map(s => s.label), lengths: u.data.map(d => d.length),
  nonzero: u.data.slice(1).some(s => s.some(v => v != null && v !== 0))}));"""


def test_the_dashboard_shows_what_the_apis_say(server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    base, admin, tokens = server
    auth = {"Authorization": f"Bearer {admin}"}
    assert httpx.put(base + "/v1/admin/tenants/acme/budget", headers=auth, json={"amount": 5, "period": "month"},
                     timeout=10).status_code == 200

    def complete(name: str, model: str, i: int) -> None:
        r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {tokens[name]}"},
                       json={"model": model, "prompt": [5 + i, 6, 7], "max_tokens": 20 * (i + 1), "ignore_eos": True,
                             "priority": "batch" if i % 2 else "interactive"}, timeout=120)
        assert r.status_code == 200, r.text

    with ThreadPoolExecutor(20) as pool:  # at once, so the sampled queues and KV use have something to show
        list(pool.map(lambda a: complete(*a), [(n, m, i) for n in ("acme", "beta") for m in MODELS for i in range(5)]))
    # the load series: wait for a few samples of each model (the server samples every 0.5 s here)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        data = httpx.get(base + "/v1/admin/dashboard", headers=auth, timeout=10).json()
        if all(len(m["load"]["t"]) >= 4 for m in data["serving"]):
            break
        time.sleep(0.5)
    assert [m["model"] for m in data["serving"]] == list(MODELS)
    refused = httpx.get(base + "/v1/admin/dashboard", headers={"Authorization": f"Bearer {tokens['acme']}"}, timeout=10)
    assert refused.status_code == 403  # a tenant's token does not see every tenant's money
    uplot = httpx.get(base + "/dashboard/static/vendor/uplot/uPlot.iife.min.js", timeout=10)
    assert uplot.status_code == 200 and "javascript" in uplot.headers["content-type"] and "uPlot" in uplot.text
    assert data["bucket_width"] == "1h"  # a day of history: hourly buckets, not days
    assert HISTORY_HOURS + 1 <= len(data["usage"]["data"]) <= HISTORY_HOURS + 2
    assert all(len(m["load"]["t"]) >= 4 for m in data["serving"]), data["serving"]
    usage = httpx.get(base + "/v1/usage?bucket_width=1d&limit=3&group_by=tenant,model,tier", headers=auth,
                      timeout=10).json()
    results = [r for b in usage["data"] for r in b["results"]]
    charged = sum(r["amount"]["value"] for r in results)
    cost = sum(r["cost"]["value"] for r in results)
    requests = sum(r["num_model_requests"] for r in results)
    assert requests == 20 + len(_history(0))

    shots = {}
    for width in (1366, 1920):
        driver = _browser(width)
        try:
            driver.get(f"{base}/dashboard#token={admin}")
            status = driver.find_element(By.ID, "status")
            WebDriverWait(driver, 30).until(
                lambda d: status.text.startswith(("updated", "needs")) or status.get_attribute("class") == "bad")
            assert status.text.startswith("updated"), status.text

            def text(test_id: str) -> str:
                return driver.find_element(By.CSS_SELECTOR, f'[data-testid="{test_id}"]').text

            # no third-party URL: every script and stylesheet is the server's own
            assets = driver.execute_script("return [...document.querySelectorAll('script[src], link[rel=stylesheet]')]"
                                           ".map(e => e.getAttribute('src') || e.getAttribute('href'))")
            assert assets and all(a.startswith("/dashboard/static/") for a in assets), assets
            money = lambda v: driver.execute_script("return money(arguments[0])", v)  # noqa: E731
            amounts = (0, 0.00123, 0.0000456, 0.00999, 0.01, 0.0149, 0.125, 0.5, -0.5, 1234.567, 1e-7, -0.0042)
            assert [money(v) for v in amounts] == [format_money(v) for v in amounts]  # the CLI's and the 429's rule
            assert text("total-charged") == money(charged) and charged > 0
            assert text("total-cost") == money(cost)
            assert text("total-margin-pct") == f"{100 * (charged - cost) / charged:.1f}%"
            assert text("total-requests") == f"{requests:,}"
            assert text("total-output") == f"{sum(r['output_tokens'] for r in results):,}"
            rows = driver.find_element(By.ID, "by-tenant").find_elements(By.TAG_NAME, "tr")[1:]
            shown = {row.find_elements(By.TAG_NAME, "td")[0].text: row.find_elements(By.TAG_NAME, "td")[1].text
                     for row in rows}
            per_tenant = len(_history(0)) // 2 + 10
            assert shown == {"acme": str(per_tenant), "beta": str(per_tenant)}
            # a LoRA adapter's requests in a table of their own ("-": the base model's)
            cells = [[c.text for c in row.find_elements(By.TAG_NAME, "td")]
                     for row in driver.find_element(By.ID, "by-adapter").find_elements(By.TAG_NAME, "tr")[1:]]
            on_sql = sum(r.adapter == "sql" for r in _history(0))
            assert driver.find_element(By.ID, "adapters-section").is_displayed() and on_sql > 0
            assert {c[0]: int(c[1].replace(",", "")) for c in cells} == {"sql": on_sql, "-": requests - on_sql}, cells
            budget_rows = driver.find_element(By.ID, "budgets").find_elements(By.TAG_NAME, "tr")[1:]
            budget = [c.text for c in budget_rows[0].find_elements(By.TAG_NAME, "td")]
            assert len(budget_rows) == 1 and budget[3] == "$5.00" and budget[4] != "$0.00", budget  # spent: this test's
            assert budget[8].startswith("$") and budget[9] == "not this period", budget
            prices = {cells[0]: cells for cells in ([c.text for c in r.find_elements(By.TAG_NAME, "td")] for r in
                                                    driver.find_element(By.ID, "prices").find_elements(By.TAG_NAME, "tr")[1:])}
            for m in MODELS:  # each model's output break-even, from the engine time its traffic took
                assert data["prices"][m]["break_even_output"] > 0
                assert prices[m][4] == format_money(data["prices"][m]["break_even_output"]), prices
            serving = driver.find_element(By.ID, "serving").find_elements(By.TAG_NAME, "tr")
            header = [c.text for c in serving[0].find_elements(By.TAG_NAME, "th")]
            assert {"TTFT p50", "TPOT p50", "TPOT p99", "e2e p50", "e2e p99"} <= set(header)
            for row in serving[1:]:
                cells = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
                for name in ("TTFT p50", "TTFT p99", "TPOT p50", "e2e p99"):
                    assert re.fullmatch(r"–|\d{1,3}(,\d{3})*|\d{1,2}\.\d", cells[header.index(name)]), cells

            # every chart holds data: the stacked spend, the totals, and each model's sampled load
            charts = {c["name"]: c for c in driver.execute_script(CHARTS_JS)}
            assert set(charts) == {"stacked", "totals", *(f"load:{m}" for m in MODELS)}
            for c in charts.values():
                assert c["labels"] and all(n == c["lengths"][0] > 0 for n in c["lengths"]), c
            assert charts["stacked"]["nonzero"] and charts["totals"]["nonzero"]
            assert sorted(charts["stacked"]["labels"]) == ["acme", "beta"]
            assert charts["stacked"]["lengths"][0] == len(data["usage"]["data"])
            # the layout uses the width: charts span the page, no panel scrolls sideways, and at 1920 px the
            # group tables share a row
            page = driver.execute_script("return document.documentElement.clientWidth")
            assert charts["stacked"]["width"] > 0.9 * page and charts["totals"]["width"] > 0.9 * page
            cramped = driver.execute_script(
                "return [...document.querySelectorAll('.panel')].filter(p => p.scrollWidth > p.clientWidth + 1)"
                ".map(p => p.querySelector('h2').textContent + ': ' + p.scrollWidth + ' > ' + p.clientWidth)")
            assert not cramped, (width, cramped)
            tops = [driver.find_element(By.ID, t).location["y"] for t in ("by-tenant", "by-model", "by-tier")]
            if width == 1920:
                assert len(set(tops)) == 1, tops
            height = driver.execute_script("return document.documentElement.scrollHeight")
            driver.set_window_size(width, height + 140)  # the whole page in one picture
            shot = tmp_path / f"dashboard-{width}.png"
            driver.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000
            shots[width] = shot

            Select(driver.find_element(By.ID, "group")).select_by_value("model")
            charts = {c["name"]: c for c in driver.execute_script(CHARTS_JS)}
            assert sorted(charts["stacked"]["labels"]) == list(MODELS) and charts["stacked"]["nonzero"]
            Select(driver.find_element(By.ID, "group")).select_by_value("tier")
            Select(driver.find_element(By.ID, "measure")).select_by_value("margin")
            charts = {c["name"]: c for c in driver.execute_script(CHARTS_JS)}
            assert sorted(charts["stacked"]["labels"]) == ["batch", "interactive"]

            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors

        finally:
            driver.quit()
    keep = os.environ.get("KVSERVE_SCREENSHOT_DIR")
    if keep:
        shutil.copy(shots[1366], Path(keep) / "dashboard.png")
        shutil.copy(shots[1920], Path(keep) / "dashboard-1920.png")
