"""Decode steps replayed from CUDA graphs: the host launches one graph instead of a step's thousands of kernels.

A graph is captured per batch-size bucket (`capture_sizes`) over persistent input buffers: token ids, positions,
each KV group's slots and block tables, context lengths. A decode-only step of n sequences fills the first n rows
of a pinned host staging buffer, copies it to the device in one transfer and replays the smallest bucket that
holds n. The bucket's other rows are padding that cannot touch a real row: each attends to one token of a scratch
block no sequence owns (the runner holds it past the pool the KV manager hands out) and writes its K/V there, and
every op of the forward treats rows independently. Mixed prefill/decode steps, drafts being verified, prompt
logprobs and models whose forward reads tensors back to the host (a mixture's expert counts) run eagerly.

The grid of the Triton decode kernel depends on the bucket only (its page splits are chosen for the longest
context the tables can hold; each row divides its own pages among them: kernels/triton_attention.py), so one
capture serves any contexts. A replay gives the bits an eager forward over the same buffers gives
(`replay_eagerly` is that forward, and the CPU's stand-in for capture in the tests).
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvserve.models.attention import AttentionMetadata

log = logging.getLogger(__name__)

# (the forward over the buffers) -> (replay, the forward's output tensor, which each replay rewrites)
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured for, up to `max_batch` (the scheduler's max_num_seqs): 1, 2, 4, 8, then
    every multiple of 8 (vLLM's ladder): a step pads at most 7 rows past 8, under 50% below it."""
    top = min(max_batch, MAX_CAPTURE_SIZE)
    sizes = [s for s in (1, 2, 4) if s < top] + list(range(8, top + 1, 8))
    if not sizes or sizes[-1] < top:
        sizes.append(top)
    return tuple(sizes)


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds n rows; None when none does (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def replay_eagerly(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """A Capture that records nothing: each replay runs the forward again over the buffers and writes its output
    where a graph would (the tests' stand-in on the CPU, and the eager side of the device check's comparison)."""
    out = forward()

    def replay() -> None:
        out.copy_(forward())

    return replay, out


def capture_cuda_graph(pool) -> Capture:
    """Capture on CUDA into one memory pool shared by every bucket's graph (their intermediates are dead between
    replays, and replays never overlap), after a warm-up run on a side stream (Triton's compilation, cuBLAS's
    workspaces: nothing of that may happen during capture)."""
    def capture(forward: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = forward()
        return graph.replay, out

    return capture


@dataclass(frozen=True)
class GraphPlan:
    """What a runner needs to replay its decode steps: how to capture, the largest batch, the longest sequence."""

    capture: Capture
    max_batch: int
    max_model_len: int


class DecodeGraphs:
    """The persistent inputs, their pinned staging, and a captured forward per bucket (captured at first use)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list, layer_groups: tuple[int, ...], num_groups: int,
                 block_size: int, max_blocks: int, max_batch: int, scratch_block: int, device: torch.device,
                 capture: Capture):
        """`max_blocks`: the block-table width (the longest sequence's pages); `scratch_block`: the block the
        padding rows attend to and write, owned by no sequence."""
        self.model, self.kv_caches, self.layer_groups = model, kv_caches, layer_groups
        self.num_groups, self.block_size, self.max_blocks = num_groups, block_size, max_blocks
        self.sizes = capture_sizes(max_batch)
        self.scratch_block = scratch_block
        self.capture = capture
        b, g, w = self.sizes[-1], num_groups, max_blocks
        # One int64 buffer carved into the inputs, on the host (pinned where the device is a GPU) and on the
        # device: a step's inputs are one copy. Layout: ids [B], positions [B], lens [B], slots [G, B], tables
        # [G, B, W].
        total = 3 * b + g * b + g * b * w
        self._host = torch.zeros(total, dtype=torch.long, pin_memory=device.type == "cuda")
        self._device = torch.zeros(total, dtype=torch.long, device=device)
        self._host_np = self._host.numpy()
        self._views = [self._carve(self._host_np, b, g, w), self._carve(self._device, b, g, w)]
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        # Set once the last step's inputs left the staging buffer: the next step may not overwrite it before.
        self._staged = torch.cuda.Event() if device.type == "cuda" else None

    @staticmethod
    def _carve(buffer, b: int, g: int, w: int):
        """(ids, positions, lens, slots [G, B], tables [G, B, W]) as views of `buffer`."""
        ids, positions, lens = buffer[:b], buffer[b:2 * b], buffer[2 * b:3 * b]
        slots = buffer[3 * b:3 * b + g * b].reshape(g, b)
        tables = buffer[3 * b + g * b:].reshape(g, b, w)
        return ids, positions, lens, slots, tables

    def takes(self, num_rows: int, max_context: int) -> bool:
        """Whether a decode-only step of `num_rows` sequences, the longest `max_context` tokens, replays a graph."""
        return bucket_for(num_rows, self.sizes) is not None and max_context <= self.max_blocks * self.block_size

    def run(self, token_ids: Sequence[int], starts: Sequence[int], tables: Sequence[Sequence[Sequence[int]]]
            ) -> torch.Tensor:
        """Final hidden states [n, hidden] of n decodes (row i: token_ids[i] at position starts[i], its KV groups'
        block tables tables[i]), from the bucket's graph (captured now if it is the bucket's first step)."""
        n = len(token_ids)
        size = bucket_for(n, self.sizes)
        if self._staged is not None:
            self._staged.synchronize()
        self._stage(token_ids, starts, tables, size)
        self._device.copy_(self._host, non_blocking=True)
        if self._staged is not None:
            self._staged.record()
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        replay, hidden = self._graphs[size]
        replay()
        return hidden[:n]

    def _stage(self, token_ids, starts, tables, size: int) -> None:
        """Rows 0..n-1 of the host buffers from the step, rows n..size-1 padding (one token of the scratch block);
        table columns past a row's pages are left as they were (the kernel reads a row's own pages only)."""
        ids, positions, lens, slots, tabs = self._views[0]
        n, bs = len(token_ids), self.block_size
        ids[:n] = token_ids
        positions[:n] = starts
        lens[:n] = starts
        lens[:n] += 1
        for i, (start, row_tables) in enumerate(zip(starts, tables)):
            last = start // bs
            for g, table in enumerate(row_tables):
                tabs[g, i, :last + 1] = table[:last + 1]
                slots[g, i] = table[last] * bs + start % bs
        ids[n:size] = 0
        positions[n:size] = 0
        lens[n:size] = 1
        slots[:, n:size] = self.scratch_block * bs
        tabs[:, n:size, 0] = self.scratch_block

    def _metadata(self, size: int) -> AttentionMetadata:
        """The bucket's attention metadata: views of the device buffers, its longest context the tables' (the
        kernel's grid then depends on the bucket alone)."""
        _, _, lens, slots, tables = self._views[1]
        return AttentionMetadata.of_groups(
            [AttentionMetadata(slot_mapping=slots[g, :size], num_decode_tokens=size,
                               decode_block_tables=tables[g, :size], decode_context_lens=lens[:size],
                               decode_max_context=self.max_blocks * self.block_size, decode_min_context=0)
             for g in range(self.num_groups)], self.layer_groups)

    def _capture(self, size: int) -> tuple[Callable[[], None], torch.Tensor]:
        ids, positions = self._views[1][0][:size], self._views[1][1][:size]

        def forward() -> torch.Tensor:
            return self.model(ids, positions, self.kv_caches, self._metadata(size))

        log.info("capturing the decode graph for batches of %d", size)
        return self.capture(forward)
