"""Fleet chaos on a real local Ray cluster with real Serve and SmolLM2 replicas (the fleet of benchmarks/fleet.py):
W1-shaped load (32 streams at once, 256-token prompts, 128 output tokens) while a replica is SIGKILLed every
30 s; every request must complete (streams migrate to the survivor) and the fleet must be back to its size
before the next kill. Then the gateway itself is SIGKILLed: Serve restarts it, and the shared store's
ledger and idempotency keys are intact: an idempotent retry returns the stored response, billed once.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from kvserve.server.idempotency import REPLAY_HEADER
from tests.reliability.conftest import scale

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.real_model, pytest.mark.alone]

REPLICAS, KILL_PERIOD_S = 2, 30.0


def _load(fleet, seconds: float, out) -> dict:
    from benchmarks.fleet import run_loadgen

    args = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128", "--ignore-eos",
            "--max-concurrency", "32", "--duration", f"{seconds:g}"]
    return run_loadgen(fleet.base_url, fleet.token, args, 21, out)


def _gateway_pid() -> int:
    from ray._private import state

    for a in state.actors(actor_state_name="ALIVE").values():
        if a.get("Name", "").startswith("SERVE_REPLICA::kvserve#gateway#") and a.get("Pid"):
            return a["Pid"]
    raise AssertionError("no live gateway actor")


def test_replicas_killed_every_30s_under_load_then_the_gateway(tmp_path, figures):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from benchmarks.fleet import Fleet

    duration = scale(40.0, 300.0)  # make test: one kill, then the gateway's
    fleet = Fleet(tmp_path)
    fleet.start(REPLICAS, 1.0)
    try:
        result: dict = {}
        load = threading.Thread(target=lambda: result.update(_load(fleet, duration, tmp_path / "load.json")))
        t0 = time.monotonic()
        load.start()
        kills, recoveries = [], []
        while (len(kills) + 1) * KILL_PERIOD_S < duration - 5:  # a kill every 30 s while the load runs
            time.sleep(max(0.0, (len(kills) + 1) * KILL_PERIOD_S - (time.monotonic() - t0)))
            replicas = fleet.replicas()
            victim = max(replicas, key=lambda r: replicas[r].get("inflight") or 0)
            kills.append(fleet.kill(victim))
            k0 = time.monotonic()
            fleet.wait_pool(fleet.pool, REPLICAS, exclude=(victim,), timeout=KILL_PERIOD_S * 4)
            recoveries.append(time.monotonic() - k0)
        load.join()
        failed = result["failed"]
        figures.record("fleet chaos", "load", f"{result['completed']} requests in {duration:.0f} s",
                       detail=f"W1 shape, 32 streams at once, {REPLICAS} replicas x 1 CPU, "
                              f"{result['output_throughput']:.0f} output tok/s")
        figures.record("fleet chaos", "replicas SIGKILLed", len(kills), detail=f"one every {KILL_PERIOD_S:g} s")
        figures.record("fleet chaos", "failed requests", failed, "0", failed == 0,
                       detail=str(result["error_counts"]) if failed else "streams migrated to the survivor")
        figures.record("fleet chaos", "fleet back to its size after each kill", f"{len(recoveries)} of {len(kills)}",
                       "all", len(recoveries) == len(kills),
                       detail="seconds to a new ready replica: " + ", ".join(f"{s:.0f}" for s in recoveries))
        assert kills and failed == 0, result["error_counts"]
        assert len(recoveries) == len(kills)

        # The gateway, SIGKILLed with idempotent requests in flight; Serve restarts it. Each request retried
        # with its key completes once (409 while the dead gateway's lease on the key runs out), a second
        # retry replays the stored response, and each is billed once.
        keys = [f"chaos-gateway-{i}" for i in range(8)]
        first: dict[str, object] = {}

        def send(key: str) -> None:
            try:
                first[key] = _complete(fleet, key, timeout=120).status_code
            except httpx.TransportError as e:
                first[key] = type(e).__name__

        senders = [threading.Thread(target=send, args=(k,)) for k in keys]
        for t in senders:
            t.start()
        time.sleep(2.0)
        os.kill(_gateway_pid(), signal.SIGKILL)
        g0 = time.monotonic()
        for t in senders:
            t.join()
        final, waited = {}, 0.0
        for key in keys:
            r = _retry_until_done(fleet, key)
            final[key] = r.json()["id"]
            waited = max(waited, time.monotonic() - g0)
        replays = [_complete(fleet, key) for key in keys]
        replayed = all(r.status_code == 200 and r.headers.get(REPLAY_HEADER) is not None
                       and r.json()["id"] == final[k] for k, r in zip(keys, replays))
        billed, deadline = {}, time.monotonic() + 30
        while time.monotonic() < deadline:  # rows are per choice: <response id>-<index>
            with fleet_store(fleet) as store:
                billed = {rid: store.db.conn().execute("SELECT COUNT(*) FROM usage_records WHERE request_id LIKE ?",
                                                       (rid + "-%",)).fetchone()[0] for rid in final.values()}
            if 0 not in billed.values():
                break
            time.sleep(1)
        cut = sum(1 for v in first.values() if v != 200)
        figures.record("fleet chaos", "gateway SIGKILLed with 8 idempotent requests in flight",
                       f"{cut} cut, {len(keys) - cut} answered",
                       detail=f"first answers {sorted(map(str, first.values()))}; the cut ones fail at the client "
                              "(one gateway in this fleet: gateway_replicas = 1)")
        figures.record("fleet chaos", "after the gateway kill: each key's retry completed", f"{len(final)} of 8",
                       "all", len(final) == len(keys), detail=f"all done {waited:.0f} s after the kill (a dead "
                       "gateway's keys are free once their lease lapses)")
        figures.record("fleet chaos", "a second retry replays the stored response", replayed, "True", replayed)
        figures.record("fleet chaos", "usage rows per key", sorted(set(billed.values())), "[1]",
                       set(billed.values()) == {1}, detail="nothing billed twice")
        assert replayed, [(r.status_code, dict(r.headers)) for r in replays]
        assert set(billed.values()) == {1}, billed
    finally:
        fleet.shutdown()


def fleet_store(fleet):
    from kvserve.store import Store

    return Store(fleet.home / "kvserve.db")


BODY = {"model": "smollm2-135m", "prompt": "The lighthouse keeper", "max_tokens": 48, "temperature": 0}


def _complete(fleet, key: str, timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {fleet.token}", "Idempotency-Key": key}
    return httpx.post(fleet.base_url + "/v1/completions", headers=headers, json=BODY, timeout=timeout)


def _retry_until_done(fleet, key: str, timeout: float = 240) -> httpx.Response:
    """Retry as a client would: through a restarting gateway (connection errors, 5xx) and 409s (the key still
    held by a lease), honouring Retry-After, until a 200."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            last = _complete(fleet, key)
            if last.status_code == 200:
                return last
            assert last.status_code in (409, 500, 502, 503, 504), last.text
            time.sleep(float(last.headers.get("retry-after", 1)))
        except httpx.TransportError:
            time.sleep(1)
    raise AssertionError(f"key {key} never completed: {last and (last.status_code, last.text)}")
