"""Migration changes nothing a user gets, in the default configuration (bfloat16 on the fused CPU decoder,
numerics = "batch_invariant"): on a real local Ray cluster with two SmolLM2 replicas, 12 greedy streams
(up to 96 tokens each) are run once undisturbed, then again with the busiest replica SIGKILLed once the streams
hold about 30% of their text. Every stream must finish, and each must be the undisturbed run's tokens and
logprobs, bit for bit, migrated or not (a migrated stream's rest is a recompute of prompt + delivered tokens
on the survivor: tests/integration/test_batch_invariance.py holds the engine to the same bits).
"""
from __future__ import annotations

import os
import threading
import time

import pytest

pytest.importorskip("ray")

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

STREAMS, TOKENS, KILL_AT = 12, 96, 0.3
TOPICS = ["tides", "volcanoes", "bread", "chess", "rainbows", "bees", "glaciers", "trains", "violins", "comets",
          "coral reefs", "paper"]


def _streams(fleet, on_token) -> list[list[tuple[str, float]]]:
    """The 12 greedy streams at once: each one's (token, logprob) list, in order."""
    from openai import OpenAI

    client = OpenAI(base_url=fleet.base_url + "/v1", api_key=fleet.token, max_retries=0, timeout=300)
    out: list[list[tuple[str, float]]] = [[] for _ in range(STREAMS)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            stream = client.chat.completions.create(
                model=fleet_model(), stream=True, temperature=0, max_tokens=TOKENS, logprobs=True,
                messages=[{"role": "user", "content": f"Write a long story about {TOPICS[i]}."}])
            for chunk in stream:
                for choice in chunk.choices:
                    for entry in (choice.logprobs.content if choice.logprobs and choice.logprobs.content else []):
                        out[i].append((entry.token, entry.logprob))
                        on_token()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    return out


def fleet_model() -> str:
    from benchmarks.fleet import MODEL

    return MODEL


def test_a_replica_sigkilled_mid_stream_changes_no_stream(tmp_path, figures):
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from benchmarks.fleet import Fleet

    fleet = Fleet(tmp_path)
    fleet.start(2, 1.0)
    try:
        undisturbed = _streams(fleet, lambda: None)
        assert sum(map(len, undisturbed)) > STREAMS * TOKENS / 2, [len(s) for s in undisturbed]
        before = dict(fleet.status().get("migrations") or {})

        delivered, total = [0], sum(map(len, undisturbed))
        lock, reached = threading.Lock(), threading.Event()

        def count() -> None:
            with lock:
                delivered[0] += 1
                if delivered[0] >= KILL_AT * total:
                    reached.set()

        kills: list[dict] = []

        def killer() -> None:
            reached.wait(timeout=300)
            replicas = fleet.replicas()
            victim = max(replicas, key=lambda r: replicas[r].get("inflight") or 0)
            kills.append(fleet.kill(victim))

        k = threading.Thread(target=killer)
        k.start()
        t0 = time.monotonic()
        disturbed = _streams(fleet, count)
        k.join()
        seconds = time.monotonic() - t0
        after = dict(fleet.status().get("migrations") or {})
    finally:
        fleet.shutdown()

    migrated = after.get("migrated", 0) - before.get("migrated", 0)
    same = sum(a == b for a, b in zip(undisturbed, disturbed))
    figures.record("fleet chaos", "greedy streams identical to an undisturbed run, a replica SIGKILLed mid-stream",
                   f"{same} of {STREAMS}", f"{STREAMS} of {STREAMS}", same == STREAMS,
                   detail=f"{migrated} migrated; tokens and logprobs bit for bit; {TOKENS} tokens a stream, the kill at "
                          f"{KILL_AT:.0%} of the text; bfloat16, numerics = batch_invariant; {seconds:.0f} s")
    assert kills and migrated >= 1, (kills, before, after)
    assert [len(s) for s in disturbed] == [len(s) for s in undisturbed]
    for i, (a, b) in enumerate(zip(undisturbed, disturbed)):
        assert a == b, f"stream {i} differs at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
