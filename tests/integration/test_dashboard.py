"""The dashboard in a real headless Chromium (Debian's chromium and chromedriver, driven by Selenium) against
a real kvserve server (a subprocess, the tiny model): the page loads with no console error, and the
figures it shows are the ones /v1/usage and /v1/admin/budgets give. The screenshot it takes is kept under
$KVSERVE_SCREENSHOT_DIR when set (docs/dashboard.png was made so)."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER) and os.environ.get("KVSERVE_REQUIRE_BROWSER") != "1":
    pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs them)",
                allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tiny_llama_gguf, tmp_path):
    port = _free_port()
    config = tmp_path / "models.toml"
    config.write_text(f'[server]\nhome = "{tmp_path}"\n[[models]]\nid = "tiny"\nsource = "{tiny_llama_gguf}"\n'
                      'dtype = "float32"\nmax_model_len = 128\nnum_gpu_blocks_override = 64\n')
    env = {**os.environ, "KVSERVE_HOME": str(tmp_path)}
    from kvserve.store import Store

    with Store(tmp_path / "kvserve.db") as store:
        _, admin = store.create_tenant("root", admin=True)
        tokens = {name: store.create_tenant(name)[1] for name in ("acme", "beta")}
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


def test_the_dashboard_shows_what_the_apis_say(server, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    base, admin, tokens = server
    for name, n in (("acme", 3), ("beta", 2)):
        for i in range(n):
            r = httpx.post(base + "/v1/completions", headers={"Authorization": f"Bearer {tokens[name]}"},
                           json={"model": "tiny", "prompt": [5 + i, 6, 7], "max_tokens": 4,
                                 "priority": "batch" if i == 0 else "interactive"}, timeout=60)
            assert r.status_code == 200, r.text
    auth = {"Authorization": f"Bearer {admin}"}
    assert httpx.put(base + "/v1/admin/tenants/acme/budget", headers=auth, json={"amount": 5, "period": "month"},
                     timeout=10).status_code == 200
    usage = httpx.get(base + "/v1/usage?bucket_width=1d&limit=14&group_by=tenant,model,tier", headers=auth,
                      timeout=10).json()
    results = [r for b in usage["data"] for r in b["results"]]
    charged = sum(r["amount"]["value"] for r in results)

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1400"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(f"{base}/dashboard#token={admin}")
        WebDriverWait(driver, 30).until(
            lambda d: d.find_element(By.ID, "status").text.startswith(("updated", "needs")) or
            d.find_element(By.ID, "status").get_attribute("class") == "bad")
        assert driver.find_element(By.ID, "status").text.startswith("updated"), driver.find_element(By.ID, "status").text

        def text(test_id: str) -> str:
            return driver.find_element(By.CSS_SELECTOR, f'[data-testid="{test_id}"]').text

        assert text("total-charged") == f"${charged:.6f}"
        assert text("total-requests") == str(sum(r["num_model_requests"] for r in results)) == "5"
        assert text("total-output") == str(sum(r["output_tokens"] for r in results))
        tenants = driver.find_element(By.ID, "by-tenant").find_elements(By.TAG_NAME, "tr")[1:]
        shown = {row.find_elements(By.TAG_NAME, "td")[0].text: row.find_elements(By.TAG_NAME, "td")[1].text
                 for row in tenants}
        assert shown == {"acme": "3", "beta": "2"}
        budget_rows = driver.find_element(By.ID, "budgets").find_elements(By.TAG_NAME, "tr")[1:]
        assert [r.find_elements(By.TAG_NAME, "td")[3].text for r in budget_rows] == ["$5.000000"]
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        keep = os.environ.get("KVSERVE_SCREENSHOT_DIR")
        if keep:
            shutil.copy(shot, Path(keep) / "dashboard.png")
    finally:
        driver.quit()
