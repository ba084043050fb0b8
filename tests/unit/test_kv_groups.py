"""KV groups' arithmetic (engine/kv/groups.py), pure: layouts by attention kind and the blocks a group holds."""
from __future__ import annotations

import pytest

from kvserve.engine.kv.groups import KVGroup, KVLayout


def gemma3_windows(layers: int, window: int = 512, pattern: int = 6) -> list[int | None]:
    return [None if (i + 1) % pattern == 0 else window for i in range(layers)]


def test_one_kind_is_one_group_of_every_layer():
    layout = KVLayout.for_windows([None] * 30)
    assert layout.num_groups == 1 and layout.group_size == 30 and not layout.sliding and layout.reserved_pages == 0
    assert layout.pages_held(100, 16) == 7
    windowed = KVLayout.for_windows([4096] * 32)  # every layer sliding (Mistral 7B v0.1)
    assert windowed.num_groups == 1 and windowed.reserved_pages == 1
    assert windowed.pages_held(100_000, 16, new_tokens=1) == 4096 // 16  # aligned: the window is 256 blocks
    assert windowed.pages_held(100_001, 16, new_tokens=1) == 4096 // 16 + 1


def test_gemma3_groups_have_equal_sizes_and_cover_every_layer_once():
    for layers, size, groups in ((18, 3, 6), (26, 2, 13), (34, 1, 34), (62, 2, 31)):
        layout = KVLayout.for_windows(gemma3_windows(layers))
        assert (layout.group_size, layout.num_groups) == (size, groups)
        placed = sorted(layer for g in layout.groups for layer in g.layers)
        assert placed == list(range(layers))
        assert all(len(g.layers) == size for g in layout.groups)
        assert layout.groups[0].window is None  # full attention first
        assert {layout.placement(layer)[1] for layer in range(layers)} == set(range(size))
    assert KVLayout.for_windows(gemma3_windows(18), split=False).num_groups == 1


def test_a_sliding_group_holds_its_window_and_the_chunk():
    g = KVGroup((0,), 512)
    assert g.first_needed_block(511, 16) == 0
    assert g.first_needed_block(512, 16) == 0  # position 512 reads keys 1..512: block 0 is still read
    assert g.first_needed_block(528, 16) == 1  # keys 17..: block 0 passed
    assert g.blocks_held(32768, 16, new_tokens=1) == 2048 - (32767 - 511) // 16
    assert g.blocks_held(1000, 16) == 63  # computed at once: everything
    assert KVGroup((0,), None).blocks_held(32768, 16, new_tokens=1) == 2048


def test_gemma3_at_32k_holds_under_a_quarter_of_the_bytes():
    layout = KVLayout.for_windows(gemma3_windows(18))
    classic = KVLayout.for_windows(gemma3_windows(18), split=False)
    for new in (1, 2048):  # decoding, and the last chunk of the default budget
        grouped = layout.pages_held(32768, 16, new) * layout.group_size
        every = classic.pages_held(32768, 16, new) * classic.group_size  # in layer-blocks, so bytes compare
        assert grouped <= 0.25 * every, (new, grouped, every)


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError):
        KVLayout.for_windows([])
    with pytest.raises(ValueError):
        KVGroup((), None)
    with pytest.raises(ValueError):
        KVGroup((0,), 0)


def test_sinks_keep_their_blocks_and_the_window_the_rest():
    g = KVGroup((0,), 512, sinks=4)
    assert g.sink_blocks(16) == 1
    assert g.first_needed_block(100, 16) == 1  # the window has not passed the sinks' block
    assert g.kept(10_000, 625, 16) == [0, *range((10_000 - 511) // 16, 625)]
    assert g.blocks_held(10_000, 16, new_tokens=1) == 1 + 625 - (9_999 - 511) // 16
    assert g.blocks_held(20, 16) == 2
    layout = KVLayout.for_windows([2048] * 30, sinks=[4] * 30)  # SmolLM2 under the policy
    assert layout.num_groups == 1 and layout.groups[0].sinks == 4
    with pytest.raises(ValueError):
        KVGroup((0,), None, sinks=4)
