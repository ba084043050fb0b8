"""The planner's KV arithmetic under the engine's KV-group rule (engine/kv/groups.py) and `kvserve plan context`:
what one long sequence costs under full attention, a native window and a StreamingLLM window, and how many
fit on the devices, in host memory and on disk. Pure arithmetic against hand-worked figures, and the CLI."""
from __future__ import annotations

import json

import pytest

from kvserve.config import SchedulerConfig
from kvserve.engine.kv.groups import KVGroup, KVLayout
from kvserve.planning import memory
from kvserve.planning.long_context import KVPolicy, Tiers, long_context, policies
from kvserve.planning.roofline import Deployment, StepModel
from kvserve.planning.search import replica_memory, replica_simulator
from kvserve.planning.specs import AcceleratorSpec, accelerator_spec, model_spec

L70_TOKEN = 2 * 80 * 8 * 128 * 2  # bytes of KV a token holds in Llama-3.1-70B at bf16 (all layers)
L70_PAGE = 16 * L70_TOKEN  # one group of all 80 layers: a page is the classic block


def test_layer_windows_follow_gemma3s_pattern():
    g = model_spec("gemma-3-27b")
    windows = memory.layer_windows(g)
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    assert sum(w is not None for w in windows) == g.num_sliding_layers == 52
    assert set(windows) == {None, 1024}
    assert memory.layer_windows(model_spec("llama-3.1-70b")) == [None] * 80


@pytest.mark.parametrize("name", ["gemma-3-270m", "gemma-3-1b", "gemma-3-4b", "gemma-3-27b"])
def test_a_gemma3_sequence_at_32k_holds_under_a_quarter_of_every_layers_blocks(name):
    g = model_spec(name)
    grouped, classic = memory.kv_layout(g), memory.kv_layout(g, split=False)
    assert classic.num_groups == 1 and grouped.num_groups > 1
    layer_blocks = grouped.pages_held(32768, 16, new_tokens=1) * grouped.group_size
    every = classic.pages_held(32768, 16, new_tokens=1) * g.num_layers  # 2048 blocks in each layer
    assert every == 2048 * g.num_layers and layer_blocks <= 0.25 * every
    # bytes follow pages: the Gemma 3 27B figure, 10 global layers x 32768 tokens + 52 sliding x their 1024
    if name == "gemma-3-27b":
        assert memory.kv_bytes_at_context(g, 32768, "bf16") == 2 * 16 * 128 * 2 * (10 * 32768 + 52 * 1024)


def test_the_pool_of_a_sliding_model_is_counted_in_pages():
    g, h100 = model_spec("gemma-3-27b"), accelerator_spec("h100-sxm")
    p = memory.memory_plan(g, h100, tp=1)
    per_layer = 2 * 16 * 128 * 2  # K and V, 16 KV heads x 128, bf16
    assert p.layout.group_size == 2 and p.layout.num_groups == 31 and p.layout.reserved_pages == 1
    assert p.page_bytes == 2 * 16 * per_layer and p.num_blocks == int(p.kv_bytes // p.page_bytes)
    pages = 5 * 2048 + 26 * (2048 - (32767 - 1023) // 16)  # 5 full groups, 26 sliding ones at 32k, decoding
    assert p.pages_per_sequence(32768) == pages
    assert p.max_sequences(32768) == (p.num_blocks - 1) // pages
    classic = memory.memory_plan(g, h100, tp=1, layout=memory.kv_layout(g, split=False))
    assert classic.max_sequences(32768) == 0 < p.max_sequences(32768)  # every layer's blocks: none fits
    assert p.kv_tokens == (p.num_blocks - 1) // 31 * 16  # as KVCacheManager.token_capacity


def test_a_model_without_a_window_is_counted_as_before():
    l70, h100 = model_spec("llama-3.1-70b"), accelerator_spec("h100-sxm")
    p = memory.memory_plan(l70, h100, tp=4)
    assert p.layout.num_groups == 1 and p.layout.reserved_pages == 0 and p.page_bytes == 81_920 * 16
    assert p.num_blocks == 26_329 and p.max_sequences(8192) == 51 and p.kv_tokens == 26_329 * 16
    assert memory.kv_bytes_at_context(l70, 1000, "bf16") == 63 * 16 * L70_TOKEN  # whole blocks


def test_llama_70b_at_a_million_tokens_hand_worked():
    l70 = model_spec("llama-3.1-70b")
    assert memory.kv_bytes_at_context(l70, 1_000_000, "bf16") == 2 * 80 * 8 * 128 * 2 * 10**6 == 327_680_000_000
    assert memory.kv_bytes_at_context(l70, 1_000_000, "fp8") == 163_840_000_000
    full, streaming = policies(l70, window=4096, sinks=4)
    assert full.pages(10**6, 16) == 62_500
    # the window's 256 blocks (1e6 - 4096 is a multiple of 16) and the 4 sinks' block
    assert streaming.pages(10**6, 16) == 257
    assert streaming.sequence_bytes(l70, 10**6, "bf16", 16) == 257 * L70_PAGE == (4096 + 16) * L70_TOKEN
    assert [p.name for p in policies(l70)] == ["full attention"]  # no window asked, none native


def test_sinks_are_counted_once_and_only_once_the_window_has_passed_them():
    layout = KVLayout((KVGroup((0,), 64),))
    p = KVPolicy("w", layout, sinks=(4,))
    assert p.pages(16, 16) == 1  # the sinks are inside the window
    assert p.pages(1000, 16) == layout.pages_held(1000, 16, new_tokens=1) + 1
    assert KVPolicy("w", layout, sinks=(20,)).pages(1000, 16) == layout.pages_held(1000, 16, new_tokens=1) + 2
    with pytest.raises(ValueError):
        KVPolicy("w", layout, sinks=(4, 4))
    with pytest.raises(ValueError):
        policies(model_spec("llama-3.1-8b"), window=-1)


def test_gemma3_policies_keep_the_native_window_under_a_streaming_one():
    g = model_spec("gemma-3-27b")
    full, native, streaming = policies(g, window=4096, sinks=4)
    assert native.name == "native window 1,024" and native.layout == memory.kv_layout(g)
    # global layers get 4096 + sinks, sliding ones keep their 1024 (and no sinks)
    assert {(grp.window, s) for grp, s in zip(streaming.layout.groups, streaming.sinks)} == {(4096, 4), (1024, 0)}
    # pages differ in size between layouts: compare bytes
    per_layer = 2 * 16 * 128 * 2
    assert full.sequence_bytes(g, 32768, "bf16", 16) == per_layer * 62 * 32768
    assert native.sequence_bytes(g, 32768, "bf16", 16) == per_layer * (10 * 32768 + 52 * 1024)
    assert streaming.sequence_bytes(g, 32768, "bf16", 16) == per_layer * (10 * (4096 + 16) + 52 * 1024)


def test_the_tiers_hold_what_their_bytes_allow():
    l70, h100, h200 = model_spec("llama-3.1-70b"), accelerator_spec("h100-sxm"), accelerator_spec("h200")
    r = long_context(l70, 10**6, [h100, h200], kv_dtypes=("bf16",))
    full, streaming = r.rows
    assert full.bytes_per_sequence == 327_680_000_000 and full.pages_per_sequence == 62_500
    tiers = {t.where: t for t in full.tiers}
    host, disk = tiers["host memory, 1,024 GiB"], tiers["disk, 8,000 GiB"]
    assert host.sequences == 1024 * 2**30 // 327_680_000_000 == 3 and host.load_s == pytest.approx(13.1072)
    assert disk.sequences == 26 and disk.load_s == pytest.approx(327.68 / 3)
    # H100: 4 devices hold the bf16 weights but no million-token sequence; 8 hold one
    x4, x8 = tiers["h100-sxm x4 (fewest for the weights)"], tiers["h100-sxm x8 (fewest to hold one)"]
    assert x4.sequences == 0 and not memory.memory_plan(l70, h100, tp=2).fits
    assert x8.sequences == memory.memory_plan(l70, h100, tp=8).usable_pages // 62_500 == 1
    assert tiers["h200 x2 (fewest for the weights)"].sequences == 0 and tiers["h200 x4 (fewest to hold one)"].sequences
    s = {t.where: t for t in streaming.tiers}
    assert s["h100-sxm x4 (fewest for the weights)"].sequences == memory.memory_plan(l70, h100, 4).usable_pages // 257
    assert s["host memory, 1,024 GiB"].sequences == 1024 * 2**30 // (257 * L70_PAGE)
    # a given tp, and slower disks: disk reaches the device through host memory, at the slower of the two
    r = long_context(l70, 10**6, [h100], kv_dtypes=("fp8",), window=None, tp=8,
                     tiers=Tiers(host_bytes=0, disk_bandwidth=50e9))
    (row,) = r.rows
    assert [t.where for t in row.tiers if t.tier == "device"] == ["h100-sxm x8"]
    assert [t.sequences for t in row.tiers if t.tier == "host"] == [0]
    assert [t.bandwidth for t in row.tiers if t.tier == "disk"] == [25e9]
    with pytest.raises(ValueError):
        long_context(l70, 10**6, [h100], kv_dtypes=("int4",))


def test_the_simulator_and_a_calibration_use_the_same_pages():
    g, l4 = model_spec("gemma-3-1b"), accelerator_spec("l4")
    d = Deployment(g, l4, 1, "bf16", "bf16", max_model_len=4096)
    mem = replica_memory(d, 2048)
    sim = replica_simulator(d, SchedulerConfig(max_model_len=4096))
    assert sim.kv.layout == mem.layout and sim.kv.num_pages == mem.num_blocks
    assert sim.kv.blocks_for_tokens(4096, 1) == mem.pages_per_sequence(4096)
    assert StepModel(d).kv_copy_seconds(mem.page_bytes, True) < StepModel(d).block_copy_seconds(1, 16, True)
    # a calibration file: pages of the engine's groups where it records the windows, else blocks of every layer
    cal = {"kv_pool_bytes": 1000 * 2 * 16 * 2048, "num_blocks": 1000, "block_size": 16}
    acc = AcceleratorSpec("cpu", 10**11, 1e11, 1e12, calibrated=cal)
    old = replica_memory(Deployment(g, acc), 2048)
    assert old.layout.num_groups == 1 and old.page_bytes == 2 * 16 * 2048
    windows = memory.layer_windows(g)
    new = replica_memory(Deployment(g, AcceleratorSpec("cpu", 10**11, 1e11, 1e12,
                                                       calibrated=cal | {"kv_layer_windows": windows})), 2048)
    assert new.layout == memory.kv_layout(g) and new.usable_pages == 999
    assert new.kv_bytes_per_token == old.kv_bytes_per_token * g.num_layers / new.layout.group_size


def test_plan_context_end_to_end(capsys):
    from kvserve.cli import main

    assert main(["plan", "context", "--model", "llama-3.1-70b", "--tokens", "1M"]) == 0
    out = capsys.readouterr().out
    for figure in ("327.68 GB a sequence (62,500 pages", "sinks 4 + window 4,096", "1.35 GB a sequence (257 pages",
                   "h100-sxm x8 (fewest to hold one)", "3 sequences; 13.11 s", "26 sequences; 109.23 s",
                   "fp8 KV, full attention: 163.84 GB", "past llama-3.1-70b's trained context", "assumptions"):
        assert figure in out, figure
    assert main(["plan", "context", "--model", "llama-3.1-70b", "--tokens", "1000000", "--window", "0",
                 "--kv-dtypes", "bf16", "--accelerator", "h200", "--tp", "8", "--host-gib", "2048", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["rows"]
    assert row["bytes_per_sequence"] == 327_680_000_000 and row["policy"] == "full attention"
    tiers = {t["tier"]: t for t in row["tiers"]}
    assert tiers["device"]["where"] == "h200 x8" and tiers["device"]["sequences"] >= 2
    assert tiers["host"]["sequences"] == 6 and tiers["host"]["load_s"] == pytest.approx(13.1072)
    assert doc["tiers"]["host_bandwidth"] == 25e9 and doc["tokens"] == 10**6
    assert main(["plan", "context", "--model", "gemma-3-27b", "--tokens", "32k", "--accelerator", "h100"]) == 0
    assert "native window 1,024" in capsys.readouterr().out
    assert main(["plan", "context", "--model", "llama-9-1t", "--tokens", "1M"]) == 2
    assert main(["plan", "context", "--model", "llama-3.1-70b", "--tokens", "1M", "--kv-dtypes", "int4"]) == 2
