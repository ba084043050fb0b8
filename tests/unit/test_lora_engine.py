"""LoRA adapters' bookkeeping in the engine (engine/lora.py, the scheduler's max_loras, the prefix cache's key),
pure logic: the host LRU with pinning and requests in use, the device slots, at most max_loras adapters in a step,
and another adapter never hitting a prefix cached under one."""
from __future__ import annotations

import pytest

from kvserve.config import ConfigError, LoRAAdapterSpec, engine_config_from_kwargs
from kvserve.engine.lora import AdapterCache, LoRAFull, SlotTable
from tests.unit.test_scheduler import Harness


def test_the_host_cache_unloads_the_least_recently_used_never_a_pinned_one_or_one_in_use():
    cache = AdapterCache(3)
    assert cache.put("a", 1, pinned=True) == [] and cache.put("b", 2) == [] and cache.put("c", 3) == []
    cache.acquire("b")
    assert cache.put("d", 4) == ["c"]  # a is pinned, b is in use: c goes
    cache.acquire("d")
    with pytest.raises(LoRAFull):
        cache.put("e", 5)  # a is pinned, b and d are in use
    cache.release("b")
    assert cache.put("e", 5) == ["b"] and set(cache.keys()) == {"a", "d", "e"}
    assert not cache.remove("d") and cache.remove("e") and "e" not in cache  # d is still in use


def test_slots_keep_the_adapters_they_hold_and_give_the_least_recently_used_others():
    table = SlotTable(2)
    slots, loads = table.assign(["x", "y", "x"])
    assert slots == {"x": 0, "y": 1} and loads == [(0, "x"), (1, "y")]
    assert table.assign(["y"]) == ({"y": 1}, [])
    slots, loads = table.assign(["z", "y"])  # x is the least recently used
    assert slots == {"z": 0, "y": 1} and loads == [(0, "z")]
    with pytest.raises(ValueError, match="max_loras"):
        table.assign(["a", "b", "c"])
    assert table.drop("z") == 0 and table.assign(["q"]) == ({"q": 0}, [(0, "q")])


def test_a_step_holds_at_most_max_loras_adapters_and_the_others_wait():
    h = Harness(max_loras=2, max_num_batched_tokens=64)
    seqs = []
    for lora in ("a", "b", "c", None, "a"):
        seq = h.make(prompt_len=4)
        seq.lora = lora
        h.sched.add_request([seq])
        seqs.append(seq)
    out = h.step()
    ran = [s.seq for s in out.scheduled]
    assert {s.lora for s in ran} - {None} == {"a", "b"}
    # c's prompt is the waiting head that cannot go: its tier's admission closes behind it (head of line)
    assert seqs[2] not in ran and seqs[3] not in ran
    for _ in range(40):
        if all(s.is_finished for s in seqs):
            break
        out = h.step()
        assert len({s.seq.lora for s in out.scheduled} - {None}) <= 2
    assert all(s.is_finished for s in seqs)


def test_another_adapter_never_hits_a_prefix_cached_under_one():
    h = Harness(block_size=4)
    tokens = list(range(100, 117))
    first = h.add(tokens=tokens, max_tokens=1)
    first.lora = "a@1"
    while not first.is_finished:
        h.step()
    for lora, hit in (("a@1", 16), ("b@1", 0), (None, 0), ("a@2", 0)):
        seq = h.make(tokens=tokens, max_tokens=1)
        seq.lora = lora
        assert h.kv.get_computed_blocks(seq) == hit, lora


def test_adapters_are_configured_per_model():
    c = engine_config_from_kwargs("m", adapters=[{"name": "sql", "path": "/a", "pinned": True}], max_loras=2)
    assert c.lora_enabled and c.lora_adapters == (LoRAAdapterSpec("sql", "/a", True),) and c.scheduler.max_loras == 2
    assert not engine_config_from_kwargs("m").lora_enabled
    with pytest.raises(ConfigError, match="name"):
        engine_config_from_kwargs("m", adapters=[{"name": "a:b", "path": "/a"}])
    with pytest.raises(ConfigError, match="twice"):
        engine_config_from_kwargs("m", adapters=[{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}])
    with pytest.raises(ConfigError, match="allowed keys"):
        engine_config_from_kwargs("m", adapters=[{"name": "a", "path": "/a", "rank": 8}])
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        engine_config_from_kwargs("m", enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        engine_config_from_kwargs("m", enable_lora=True, max_cpu_loras=2, max_loras=4)
