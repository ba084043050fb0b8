"""The fleet's routing policy (kvserve/fleet/routing.py): affinity keys are the KV manager's chain hashes,
consistent hashing under pool changes, the bounded-load guard against a hot prefix, and load."""
from __future__ import annotations

import random

import pytest

from kvserve.engine.kv.manager import hash_block
from kvserve.fleet.routing import ReplicaView, RoutingPolicy, RoutingStats, affinity_key, choose, rank

POLICY = RoutingPolicy()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(50_000) for _ in range(n)]


def test_the_affinity_key_is_the_kv_managers_chain_hash_of_the_first_blocks():
    rng = random.Random(0)
    prompt = tokens(rng, 200)  # 12 full blocks; the key covers the first 8
    expected = None
    for i in range(8):
        expected = hash_block(expected, prompt[16 * i:16 * (i + 1)], "acme")
    assert affinity_key(prompt, "acme", POLICY) == expected
    assert affinity_key(prompt[:128] + tokens(rng, 50), "acme", POLICY) == expected  # same first 128 tokens
    assert affinity_key(prompt, "other-tenant", POLICY) != expected  # salted: tenants never share
    assert affinity_key(prompt[:40], "acme", POLICY) == hash_block(hash_block(None, prompt[:16], "acme"),
                                                                   prompt[16:32], "acme")
    assert affinity_key(prompt[:15], "acme", POLICY) is None
    # A LoRA adapter's requests share one key, whatever their prompts and tenants: they go where it is resident.
    sql = affinity_key(prompt, "acme", POLICY, adapter="sql")
    assert sql == affinity_key(prompt[:15], "other", POLICY, "key", adapter="sql") != affinity_key(
        prompt, "acme", POLICY, adapter="poem") and sql != expected


def test_keys_stay_on_their_replica_and_only_a_departed_replicas_keys_move():
    rng = random.Random(1)
    keys = [affinity_key(tokens(rng, 32), None, POLICY) for _ in range(2000)]
    four = [f"r{i}" for i in range(4)]
    placed = {k: rank(k, four)[0] for k in keys}
    shares = [sum(1 for v in placed.values() if v == r) / len(keys) for r in four]
    assert all(0.2 < s < 0.3 for s in shares), shares
    assert all(rank(k, list(reversed(four)))[0] == placed[k] for k in keys)  # order of the pool does not matter
    three = four[:3]  # r3 leaves
    moved = [k for k in keys if rank(k, three)[0] != placed[k]]
    assert moved and all(placed[k] == "r3" for k in moved)
    five = four + ["r4"]  # r4 joins: keys move only to it, about a fifth of them
    joined = [k for k in keys if rank(k, five)[0] != placed[k]]
    assert all(rank(k, five)[0] == "r4" for k in joined) and 0.15 < len(joined) / len(keys) < 0.25


def simulate(prompts: list[list[int]], num_replicas: int, concurrency: int) -> tuple[RoutingStats, list]:
    """Requests arrive one by one with `concurrency` in flight (the oldest finishes as the next arrives)."""
    inflight = {f"r{i}": 0 for i in range(num_replicas)}
    window: list[str] = []
    stats, decisions = RoutingStats(), []
    for prompt in prompts:
        if len(window) == concurrency:
            inflight[window.pop(0)] -= 1
        d = choose([ReplicaView(r, inflight=n) for r, n in inflight.items()], affinity_key(prompt, "t", POLICY),
                   POLICY)
        stats.count(d)
        decisions.append(d)
        inflight[d.replica] += 1
        window.append(d.replica)
    return stats, decisions


def test_a_hot_shared_prefix_is_spread_and_distinct_prefixes_keep_their_replica():
    rng = random.Random(2)
    system = tokens(rng, 512)
    hot = [system + tokens(rng, 64) for _ in range(200)]  # every request shares a 512-token system prompt
    stats, _ = simulate(hot, num_replicas=2, concurrency=4)
    assert max(stats.routed.values()) / 200 <= 0.65, stats
    assert stats.by_reason["spilled"] > 0
    prefixes = [tokens(rng, 512) for _ in range(8)]
    mixed = [prefixes[i % 8] + tokens(rng, 64) for i in range(400)]
    _, decisions = simulate(mixed, num_replicas=2, concurrency=4)
    by_prefix: dict[int, set[str]] = {}
    for i, d in enumerate(decisions):
        by_prefix.setdefault(i % 8, set()).add(d.replica)
    assert sum(len(v) == 1 for v in by_prefix.values()) >= 6  # most prefixes never leave their replica


def test_load_overrides_affinity_and_only_ready_replicas_serve():
    rng = random.Random(3)
    key = affinity_key(tokens(rng, 64), None, POLICY)
    preferred, other = rank(key, ["a", "b"])
    calm = [ReplicaView("a"), ReplicaView("b")]
    assert choose(calm, key, POLICY).replica == preferred
    swamped = [ReplicaView(preferred, queued_prompt_tokens=40_000, running=64, kv_usage=0.9), ReplicaView(other)]
    d = choose(swamped, key, POLICY)
    assert (d.replica, d.reason, d.preferred) == (other, "load", preferred)
    busy_but_close = [ReplicaView(preferred, running=32, kv_usage=0.3), ReplicaView(other, running=24, kv_usage=0.2)]
    assert choose(busy_but_close, key, POLICY).reason == "affinity"  # a small difference keeps the cache hit
    down = [ReplicaView(preferred, ready=False), ReplicaView(other)]
    assert choose(down, key, POLICY).replica == other
    assert choose([ReplicaView("a", running=10), ReplicaView("b", running=2)], None, POLICY).replica == "b"
    with pytest.raises(ValueError, match="no ready replica"):
        choose([ReplicaView("a", ready=False)], key, POLICY)
    with pytest.raises(ValueError):
        RoutingPolicy(load_bound=0.5)
