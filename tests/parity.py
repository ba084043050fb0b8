"""Parity harness: build transformers' reference model from our checkpoint's tensors and compare logits
for whole prefills, token-by-token decodes, uneven chunks and mixed batches through the paged cache."""
from __future__ import annotations

import torch

from kvserve.engine.worker.runner import BatchItem, ModelRunner
from kvserve.models.hf_reference import hf_model_from_checkpoint
from kvserve.models.loader import Checkpoint, build_model, plan_for

BLOCK = 16


def hf_reference(ck: Checkpoint):
    """transformers' model for the same architecture with identical weights, float32, eager."""
    return hf_model_from_checkpoint(ck, torch.float32, attn="eager")


@torch.no_grad()
def reference_logits(hf, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref).abs().max() / ref.abs().max())


class PagedHarness:
    """Our model behind a ModelRunner, with a trivial block allocator (fresh blocks per sequence)."""

    def __init__(self, ck: Checkpoint, num_blocks: int = 256, dtype=torch.float32, kv_int8: bool = False,
                 numerics: str = "batch_invariant", activations: str = "bf16", weights: str = "auto",
                 kv_fp8: bool = False):
        self.model = build_model(ck, plan_for(ck, dtype, numerics=numerics, activations=activations, weights=weights,
                                              kv_cache_dtype="fp8" if kv_fp8 else "auto"),
                                 max_positions=4096)
        self.runner = ModelRunner(self.model, ck.config, num_blocks, 0, BLOCK, dtype, torch.device("cpu"),
                                  kv_int8=kv_int8, kv_fp8=kv_fp8)
        self.next_block = 1  # block 0 stays unused so padding never aliases real data

    def new_table(self, num_tokens: int) -> list[int]:
        n = (num_tokens + BLOCK - 1) // BLOCK
        table = list(range(self.next_block, self.next_block + n))[::-1]  # non-contiguous order on purpose
        self.next_block += n
        return table

    def prefill(self, ids: list[int], table: list[int]) -> torch.Tensor:
        return self.runner.forward([BatchItem(ids, 0, table)], all_logits=True)

    def chunked(self, ids: list[int], table: list[int], sizes: list[int]) -> torch.Tensor:
        out, start = [], 0
        for n in sizes:
            out.append(self.runner.forward([BatchItem(ids[start:start + n], start, table)], all_logits=True))
            start += n
        assert start == len(ids)
        return torch.cat(out)

    def decode_each(self, ids: list[int], table: list[int]) -> torch.Tensor:
        return self.chunked(ids, table, [1] * len(ids))

    def mixed_batch(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Seqs 0..k: prefill all but the last few tokens alone, then one flattened step mixing a decode,
        uneven chunks and a fresh whole prefill; logits for every token of every sequence."""
        tables = [self.new_table(len(p)) for p in prompts]
        logits: list[list[torch.Tensor]] = [[] for _ in prompts]
        done = [0] * len(prompts)
        # Warm-up: bring sequences to different depths (the last one starts fresh in the mixed step).
        for i, p in enumerate(prompts[:-1]):
            n = max(1, len(p) - 1 - 3 * i)
            logits[i].append(self.runner.forward([BatchItem(p[:n], 0, tables[i])], all_logits=True))
            done[i] = n
        while any(d < len(p) for d, p in zip(done, prompts)):
            items, who = [], []
            for i, p in enumerate(prompts):
                if done[i] < len(p):
                    n = 1 if i % 2 == 0 else min(5, len(p) - done[i])
                    if i == len(prompts) - 1 and done[i] == 0:
                        n = len(p)
                    n = min(n, len(p) - done[i])
                    items.append(BatchItem(p[done[i]:done[i] + n], done[i], tables[i]))
                    who.append((i, n))
            out = self.runner.forward(items, all_logits=True)
            offset = 0
            for i, n in who:
                logits[i].append(out[offset:offset + n])
                offset += n
                done[i] += n
        return [torch.cat(x) for x in logits]
