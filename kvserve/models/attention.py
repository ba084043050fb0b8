"""Paged attention over a block-structured KV cache.

Cache layout per layer: key and value tensors of shape [num_blocks, block_size, num_kv_heads, head_dim].
A token's slot is block_id * block_size + offset; `slot_mapping` says where each new token's K/V go.

One forward pass carries a flattened batch: the first `num_decode_tokens` tokens are single-token
decodes (one per sequence), the rest are prefill chunks, one contiguous run per sequence. Decodes
are attended in one batched gather + matmul over their block tables; each prefill chunk is one SDPA
call over its gathered context (a handful per step, never a per-token loop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the flattened batch."""

    query_start: int  # index of the chunk's first token in the flattened batch
    query_len: int
    context_len: int  # tokens attended to after this chunk = cached + query_len
    block_table: torch.Tensor  # [num_blocks_for_context] int64

    @property
    def start_pos(self) -> int:
        return self.context_len - self.query_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int64 (padded with 0)
    decode_context_lens: torch.Tensor | None = None  # [D] int64, includes the new token
    decode_max_context: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Lazily built masks shared by all layers of one forward pass (keyed by sliding window).
    _decode_masks: dict = field(default_factory=dict, repr=False)


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D]) into their cache slots."""
    nb, bs, h, d = key_cache.shape
    key_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """[len(block_table) blocks] -> [length, Hkv, D] contiguous K or V for one sequence."""
    _, bs, h, d = cache.shape
    return cache.index_select(0, block_table).view(-1, h, d)[:length]


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] (this step's new tokens) -> output [T, Hq, D].

    Writes the new K/V into the cache first, then attends through the block tables.
    """
    write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    bs = key_cache.shape[1]

    d = meta.num_decode_tokens
    if d:
        # Only the blocks that can hold attended keys: for a sliding window, the last window's worth.
        max_ctx = meta.decode_max_context
        tables = meta.decode_block_tables
        first_block = 0
        if sliding_window is not None and max_ctx > sliding_window + bs:
            # Keep the tables aligned per sequence: shift-free when all contexts are long is complex,
            # so only trim when every sequence's window starts past the trimmed blocks.
            min_ctx = int(meta.decode_context_lens.min())
            first_block = max(0, (min_ctx - sliding_window) // bs)
        tables = tables[:, first_block:]
        num_keys = tables.shape[1] * bs
        k = key_cache.index_select(0, tables.reshape(-1)).view(d, num_keys, num_kv_heads, head_dim)
        v = value_cache.index_select(0, tables.reshape(-1)).view(d, num_keys, num_kv_heads, head_dim)
        q = query[:d].view(d, num_kv_heads, group, head_dim)
        # scores [D, Hkv, G, S]
        scores = torch.matmul(q, k.permute(0, 2, 3, 1)).float() * scale
        mask = _decode_mask_offset(meta, num_keys, first_block * bs, sliding_window, query.device)
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        o = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [D, Hkv, G, hd]
        out[:d] = o.reshape(d, num_heads, head_dim)

    for chunk in meta.prefills:
        s, n = chunk.query_start, chunk.query_len
        q = query[s:s + n].transpose(0, 1)  # [Hq, n, D]
        if chunk.start_pos == 0 and (sliding_window is None or n <= sliding_window):
            # Fresh prompt: attend to this chunk's own K/V, no gather needed.
            k = key[s:s + n].transpose(0, 1).to(q.dtype)
            v = value[s:s + n].transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)
        else:
            k = _gather_context(key_cache, chunk.block_table, chunk.context_len).transpose(0, 1).to(q.dtype)
            v = _gather_context(value_cache, chunk.block_table, chunk.context_len).transpose(0, 1).to(q.dtype)
            qpos = torch.arange(chunk.start_pos, chunk.context_len, device=query.device)[:, None]
            kpos = torch.arange(chunk.context_len, device=query.device)[None, :]
            allowed = kpos <= qpos
            if sliding_window is not None:
                allowed &= kpos > qpos - sliding_window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=group > 1)
        out[s:s + n] = o.transpose(0, 1)
    return out


def _decode_mask_offset(meta: AttentionMetadata, num_keys: int, key_offset: int, window: int | None,
                        device) -> torch.Tensor:
    """Like _decode_mask, for gathered keys that start at absolute position key_offset."""
    cache_key = (num_keys, key_offset, window)
    mask = meta._decode_masks.get(cache_key)
    if mask is None:
        pos = torch.arange(key_offset, key_offset + num_keys, device=device)
        lens = meta.decode_context_lens[:, None]
        invalid = pos[None, :] >= lens
        if window is not None:
            invalid |= pos[None, :] <= lens - 1 - window
        mask = torch.zeros(invalid.shape, dtype=torch.float32, device=device).masked_fill_(invalid, float("-inf"))
        mask = mask[:, None, None, :]
        meta._decode_masks[cache_key] = mask
    return mask


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
