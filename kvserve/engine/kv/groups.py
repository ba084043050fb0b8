"""KV-cache groups: layers that attend alike share a block table, and a sliding-window group holds only
the blocks its window can still reach.

Pure arithmetic, no torch: the KV manager, the runner's cache layout and the planner all take their
rule from here. The scheme is vLLM's hybrid allocator's. Layers are sorted by attention kind (full, or a
sliding window of W tokens); with one kind (Llama) there is one group of every layer, the classic paged
cache. With several (Gemma 3: five sliding layers for every full one), the layers are cut into groups of
`group_size` = the gcd of the kinds' layer counts, so every group has the same number of layers and a
page (one block of one group: `group_size` layers' keys and values for `block_size` tokens) has one
size: all groups draw pages from one pool and each sequence holds one block table per group.

A full-attention group holds a page for every block of the sequence. A sliding group's queries at
positions >= p read keys from p - W + 1 on, so once a sequence's next chunk starts at p the group's
blocks wholly before p - W + 1 are never read again: they go back to the pool (to its prefix cache if
hashed) and the table keeps NULL_PAGE in their place, a page no sequence owns and no kernel reads (the
kernels start each query's keys at its window).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NULL_PAGE = 0  # reserved when any group slides: the table entry of a block a sliding group has let go


@dataclass(frozen=True)
class KVGroup:
    """One block table's worth of layers."""

    layers: tuple[int, ...]
    window: int | None  # tokens a query attends to (itself included); None: every earlier token
    sinks: int = 0  # leading tokens every query attends to beside its window (StreamingLLM's attention sinks)

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a KV group needs at least one layer")
        if self.window is not None and self.window <= 0:
            raise ValueError("a sliding window must be positive")
        if self.sinks < 0 or (self.sinks and self.window is None):
            raise ValueError("attention sinks need a window and are >= 0")

    def sink_blocks(self, block_size: int) -> int:
        """Leading blocks kept for the sinks whatever the window."""
        return -(-self.sinks // block_size)

    def first_needed_block(self, start: int, block_size: int) -> int:
        """The first block past the sinks' that a chunk of queries starting at position `start` (and every
        later one) reads; blocks between the sinks' and this one are never read again."""
        if self.window is None:
            return 0
        return max(max(0, start - self.window + 1) // block_size, self.sink_blocks(block_size))

    def kept(self, start: int, num_blocks: int, block_size: int) -> list[int]:
        """Which of a sequence's first `num_blocks` blocks queries from position `start` on read: the sinks'
        and those from the window's start."""
        first = self.first_needed_block(start, block_size)
        return [*range(min(self.sink_blocks(block_size), num_blocks)), *range(first, num_blocks)]

    def blocks_held(self, num_tokens: int, block_size: int, new_tokens: int | None = None) -> int:
        """Pages this group holds for a sequence of `num_tokens`, of which the last `new_tokens` (default all)
        are being computed now."""
        new = num_tokens if new_tokens is None else min(new_tokens, num_tokens)
        total = -(-num_tokens // block_size)
        first, sinks = self.first_needed_block(num_tokens - new, block_size), self.sink_blocks(block_size)
        return total if first <= sinks else sinks + total - first


@dataclass(frozen=True)
class KVLayout:
    """How a model's layers map onto groups and onto the runner's per-slot cache tensors."""

    groups: tuple[KVGroup, ...]

    @classmethod
    def for_windows(cls, windows: Sequence[int | None], split: bool = True,
                    sinks: Sequence[int] | None = None) -> "KVLayout":
        """The layout for layers with these windows (None: full attention) and attention sinks (default none).
        `split=False` keeps one group of every layer whatever the windows (every layer holds every token's
        block: the memory of a classic paged cache, for comparison)."""
        if not windows:
            raise ValueError("a model needs at least one layer")
        sinks = list(sinks) if sinks is not None else [0] * len(windows)
        kinds: dict[tuple[int | None, int], list[int]] = {}
        for layer, kind in enumerate(zip(windows, sinks)):
            kinds.setdefault(kind, []).append(layer)
        if len(kinds) == 1 or not split:
            window, sink = next(iter(kinds)) if split else (None, 0)
            return cls((KVGroup(tuple(range(len(windows))), window, sink),))
        size = math.gcd(*(len(layers) for layers in kinds.values()))
        groups = []
        for (window, sink), layers in sorted(kinds.items(), key=lambda kv: (kv[0][0] is not None, kv[0][0] or 0,
                                                                            kv[0][1])):
            groups += [KVGroup(tuple(layers[i:i + size]), window, sink) for i in range(0, len(layers), size)]
        return cls(tuple(groups))

    @classmethod
    def for_model(cls, config, split: bool = True) -> "KVLayout":
        """The layout of a ModelConfig's layers (their native windows and the sinks + window policy's)."""
        return cls.for_windows(config.layer_windows, split, config.layer_sink_counts)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def group_size(self) -> int:
        """Layers per group: the layers one page holds, and the number of cache tensors the runner keeps."""
        return len(self.groups[0].layers)

    @property
    def sliding(self) -> bool:
        return any(g.window is not None for g in self.groups)

    @property
    def reserved_pages(self) -> int:
        """Pages the pool sets aside: NULL_PAGE where a group slides."""
        return 1 if self.sliding else 0

    def placement(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a layer: its block table, and the cache tensor it shares with the other groups'
        layers of the same slot."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no group")

    def pages_held(self, num_tokens: int, block_size: int, new_tokens: int | None = None) -> int:
        """Pages one sequence holds over all groups (see KVGroup.blocks_held)."""
        return sum(g.blocks_held(num_tokens, block_size, new_tokens) for g in self.groups)

    def page_bytes(self, block_size: int, kv_bytes_per_token_layer: float) -> float:
        """Bytes of one page: `group_size` layers' K and V for `block_size` tokens."""
        return self.group_size * block_size * kv_bytes_per_token_layer
