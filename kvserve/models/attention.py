"""Paged attention over a block-structured KV cache.

Cache layout per layer: key and value tensors indexed [num_kv_heads, num_blocks, block_size, head_dim]. On the CPU
they are stored so (heads first: a gather over block tables lands as [heads, seqs, keys, dim] and the batched
matmuls read it through strided views, with no transposing copies; the native kernels read each head's pages as
one run); on CUDA stored blocks first (`new_kv_cache`), so a page of every head is one run that swaps, copies and
lower tiers move whole, and the shape above is a view. A token's slot is block_id * block_size + offset;
`slot_mapping` says where each new token's K/V go.

One forward pass carries a flattened batch: the first `num_decode_tokens` tokens are single-token
decodes (one per sequence), the rest are prefill chunks, one contiguous run per sequence. Decodes are
attended in one batched gather + matmul over their block tables; each prefill chunk is one SDPA call
over its gathered context (a handful per step, never a per-token loop).

On the CPU, decode attention and the K/V writes go through the native kernels of
`kvserve.kernels.cpu` when the model's backend has them, and on CUDA decode attention goes through Triton's
paged kernel (`kvserve.kernels.triton_attention`): both read the cache through the block tables in place
instead of gathering a dense copy per layer; the torch code below is the reference and the fallback.

A cache is in the model's dtype, 8-bit integer rows with scales (kernels/kv_quant.py), or e4m3 (models/fp8.py:
`kv_cache_dtype = "fp8"`), which the torch code casts to the query's dtype as it reads it and Triton's decode
kernel reads on GPUs with FP8 (compute capability 8.9 or later); the native CPU kernels do not read it.
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import kv_quant
from kvserve.models import fp8

if TYPE_CHECKING:
    from kvserve.engine.interjection import Interjection


@dataclass
class PrefillChunk:
    """One sequence's prefill chunk inside the flattened batch."""

    query_start: int  # index of the chunk's first token in the flattened batch
    query_len: int
    context_len: int  # tokens attended to after this chunk = cached + query_len
    block_table: torch.Tensor  # [blocks covering context_len] int64

    @property
    def start_pos(self) -> int:
        return self.context_len - self.query_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [D, max_blocks] int64 (padded with block 0)
    decode_context_lens: torch.Tensor | None = None  # [D] int64, includes the new token
    decode_max_context: int = 0
    decode_min_context: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    interjection: "Interjection | None" = None  # where this step may stop for another (engine/interjection.py)
    # Built once per forward pass and shared by all layers: masks keyed by (keys, offset, window),
    # rotary cos/sin keyed by table.
    cache: dict = field(default_factory=dict, repr=False)
    # KV groups (engine/kv/groups.py): every group's metadata (slots and block tables; this one is group 0's)
    # and each layer's group. Empty where the layers share one group.
    groups: list["AttentionMetadata"] = field(default_factory=list, repr=False)
    layer_groups: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> "AttentionMetadata":
        """The metadata a layer attends with: its KV group's."""
        return self.groups[self.layer_groups[layer]] if self.groups else self

    @staticmethod
    def of_groups(metas: list["AttentionMetadata"], layer_groups: tuple[int, ...]) -> "AttentionMetadata":
        """One forward's metadata from each KV group's (`layer_groups`: each layer's group): group 0's, carrying
        the others where there are several, all with group 0's cache (masks and rotary tables: the same for
        every group)."""
        first = metas[0]
        for m in metas[1:]:
            m.cache = first.cache
        if len(metas) > 1:
            first.groups, first.layer_groups = metas, layer_groups
        return first


_MASKED_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   quantized: bool = False) -> tuple[int, ...]:
    """A layer's key (or value) cache: int8 rows with their scales when `quantized` (kernels/kv_quant.py)."""
    return (num_kv_heads, num_blocks, block_size, kv_quant.row_width(head_dim, quantized))


def new_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu",
                 pages_contiguous: bool = False, pin_memory: bool = False) -> torch.Tensor:
    """A zero-filled layer cache of `shape` ([kv_heads, blocks, block_size, width], as every reader indexes it),
    stored heads first (each head's pages one run: the CPU kernels' layout) or, with `pages_contiguous`, blocks
    first (Plan.kv_pages_contiguous: each page of every head one run, which a swap, a copy or a lower tier moves
    as one piece; a view the Triton kernels read through its strides)."""
    if not pages_contiguous:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    h, n, bs, w = shape
    return torch.zeros((n, h, bs, w), dtype=dtype, device=device, pin_memory=pin_memory).transpose(0, 1)


def pages(cache: torch.Tensor) -> torch.Tensor:
    """The cache with its blocks first ([blocks, kv_heads, block_size, width], a view): a page is one index of
    dim 0, in the byte order of a lower tier's page whichever way the cache is stored."""
    return cache.transpose(0, 1)


def kv_cache_dtype(model_dtype: torch.dtype, kv_int8: bool = False, kv_fp8: bool = False) -> torch.dtype:
    """The element type of a layer's cache tensors (Plan.kv_int8, Plan.kv_fp8): uint8 for 8-bit rows with their
    scales, float8 e4m3, else the model's dtype."""
    return torch.uint8 if kv_int8 else fp8.DTYPE if kv_fp8 else model_dtype


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An e4m3 cache seen as its bytes (uint8), for the copies torch's CPU kernels lack for float8 (index_copy_:
    K/V writes, block copies, swaps, pages loaded); any other cache as it is."""
    return cache.view(torch.uint8) if cache.dtype == fp8.DTYPE else cache


def write_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter new tokens' K/V ([T, Hkv, D]) into their cache slots (a 2-D row scatter, as _gather),
    quantized first into an 8-bit cache, saturated and rounded into an e4m3 one."""
    h, nb, bs, w = key_cache.shape
    if key_cache.is_contiguous():  # heads first: a head's row for a slot is h * (nb * bs) + slot
        rows = (torch.arange(h, device=key.device)[:, None] * (nb * bs) + slot_mapping[None, :]).reshape(-1)
    else:  # blocks first: (block * h + head) * bs + offset
        heads = torch.arange(h, device=key.device)[:, None] * bs
        rows = ((slot_mapping // bs * (h * bs) + slot_mapping % bs)[None, :] + heads).reshape(-1)
    for src, cache in ((key, key_cache), (value, value_cache)):
        src = src.transpose(0, 1).reshape(-1, src.shape[-1])
        if kv_quant.is_quantized(cache):
            src = kv_quant.quantize(src)
        elif cache.dtype == fp8.DTYPE:
            src = fp8.to_e4m3(src)
        else:
            src = src.to(cache.dtype)
        stored = cache if cache.is_contiguous() else pages(cache)  # the storage's own order, contiguous
        cache_bytes(stored).view(h * nb * bs, w).index_copy_(0, rows, cache_bytes(src))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[H, N, bs, D] gathered at block_ids [k] -> [H, k * bs, D] in `dtype` (an 8-bit cache's rows dequantized,
    an e4m3 cache's values cast).

    Done as a row gather on the [H * N, bs * D] view (one contiguous block of one head per row):
    torch's 2-D row index_select runs at copy speed, about twice the 4-D gather along dim 1.
    """
    h, n, bs, w = cache.shape
    if cache.is_contiguous():
        rows = (torch.arange(h, device=cache.device)[:, None] * n + block_ids[None, :]).reshape(-1)
        out = cache.view(h * n, bs * w).index_select(0, rows).view(h, -1, w)
    else:  # blocks first: whole pages gathered, then heads first (one more copy: the reference path only)
        out = pages(cache).index_select(0, block_ids).transpose(0, 1).reshape(h, -1, w)
    if kv_quant.is_quantized(cache):
        return kv_quant.dequantize(out, dtype)
    return out.to(dtype) if cache.dtype == fp8.DTYPE else out


def _decode_mask(meta: AttentionMetadata, num_keys: int, key_offset: int, window: int | None,
                 device: torch.device, sinks: int = 0) -> torch.Tensor:
    """Additive float mask [D, 1, S] (broadcast over heads): -inf beyond each context and outside the window
    (but for the first `sinks` keys)."""
    cache_key = ("mask", num_keys, key_offset, window, sinks)
    mask = meta.cache.get(cache_key)
    if mask is None:
        pos = torch.arange(key_offset, key_offset + num_keys, device=device)
        lens = meta.decode_context_lens[:, None]
        invalid = pos[None, :] >= lens
        if window is not None:
            invalid |= (pos[None, :] <= lens - 1 - window) & (pos[None, :] >= sinks)
        mask = torch.zeros(invalid.shape, dtype=torch.float32, device=device).masked_fill_(invalid, float("-inf"))
        mask = mask[:, None, :]
        meta.cache[cache_key] = mask
    return mask


def _decode_attention(native: "cpu_kernels.NativeKernels | None", query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      window: int | None, sinks: int = 0, kernels: str = "auto") -> torch.Tensor:
    """The decodes' attention [D, Hq, hd]: the native CPU kernel (without sinks, which it does not attend to),
    Triton's (`_triton_serves`), else the torch reference."""
    if native is not None and not sinks:
        return native.decode_attention(query[:meta.num_decode_tokens], key_cache, value_cache,
                                       meta.decode_block_tables, meta.decode_context_lens, scale, window)
    if _triton_serves(query, key_cache, kernels):
        from kvserve.kernels.triton_attention import paged_decode_attention

        return paged_decode_attention(query[:meta.num_decode_tokens], key_cache, value_cache,
                                      meta.decode_block_tables, meta.decode_context_lens, scale, window, sinks,
                                      max_context=meta.decode_max_context)
    return _decode_attention_torch(query, key_cache, value_cache, meta, scale, window, sinks)


def _triton_serves(query: torch.Tensor, key_cache: torch.Tensor, kernels: str) -> bool:
    """Triton's paged kernels (kernels/triton_attention.py) serve: on CUDA, or anywhere asked for (Backend.attention:
    "triton"), where Triton is installed (torch's CUDA builds ship it), the cache holds floats and its pages are a
    power of two; an e4m3 cache on CUDA only where the GPU converts e4m3 (`_cuda_fp8`)."""
    page = key_cache.shape[2]
    wanted = kernels == "triton" or (kernels == "auto" and query.device.type == "cuda")
    if key_cache.dtype == fp8.DTYPE and query.device.type == "cuda" and not _cuda_fp8(query.device):
        return False
    return wanted and _triton_installed() and not kv_quant.is_quantized(key_cache) and page & (page - 1) == 0


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _cuda_fp8(device: torch.device) -> bool:
    """Triton converts e4m3 (its fp8e4nv) on GPUs of compute capability 8.9 or later only."""
    return torch.cuda.get_device_capability(device) >= fp8.MIN_CAPABILITY


def _decode_attention_torch(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            meta: AttentionMetadata, scale: float, window: int | None,
                            sinks: int = 0) -> torch.Tensor:
    """One gather over the block tables, then masked batched matmuls (any device)."""
    d = meta.num_decode_tokens
    num_kv_heads, _, bs, _ = key_cache.shape
    head_dim = query.shape[-1]
    group = query.shape[1] // num_kv_heads
    tables = meta.decode_block_tables
    first_block = 0
    if window is not None and not sinks and meta.decode_min_context > window + bs:
        # Every sequence's window starts past these blocks: skip gathering them.
        first_block = (meta.decode_min_context - window) // bs
        tables = tables[:, first_block:]
    num_keys = tables.shape[1] * bs
    flat = tables.reshape(-1)
    # Batch dims stay (Hkv, D) throughout: the gathered K/V are read in place, only q and the output move.
    k = _gather(key_cache, flat, query.dtype).view(num_kv_heads, d, num_keys, head_dim)
    v = _gather(value_cache, flat, query.dtype).view(num_kv_heads, d, num_keys, head_dim)
    q = query[:d].view(d, num_kv_heads, group, head_dim).transpose(0, 1)  # [Hkv, D, G, hd]
    scores = torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)  # [Hkv, D, G, S]
    scores += _decode_mask(meta, num_keys, first_block * bs, window, query.device, sinks)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(d, num_kv_heads * group, head_dim)


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, chunk: PrefillChunk, scale: float,
                       window: int | None, sinks: int = 0) -> torch.Tensor:
    s, n = chunk.query_start, chunk.query_len
    group = query.shape[1] // key.shape[1]
    # SDPA inputs are 4-D ([1, heads, tokens, D]): with 3-D inputs torch's CPU dispatcher skips its flash
    # kernel for the math path, many times slower on prompts of hundreds to thousands of tokens.
    q = query[s:s + n].transpose(0, 1)[None]
    if chunk.start_pos == 0 and (window is None or n <= window) and not kv_quant.is_quantized(key_cache) \
            and key_cache.dtype != fp8.DTYPE:
        # A fresh prompt sees only its own tokens: attend to this step's K/V, no gather needed. (An 8-bit or
        # e4m3 cache's prompt attends to its rows as cached, as every later step and a recompute will.)
        k = key[s:s + n].transpose(0, 1)[None]
        v = value[s:s + n].transpose(0, 1)[None]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=group > 1)[0]
    k = _gather(key_cache, chunk.block_table, query.dtype)[None, :, :chunk.context_len]
    v = _gather(value_cache, chunk.block_table, query.dtype)[None, :, :chunk.context_len]
    qpos = torch.arange(chunk.start_pos, chunk.context_len, device=query.device)[:, None]
    kpos = torch.arange(chunk.context_len, device=query.device)[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= (kpos > qpos - window) | (kpos < sinks)
    if query.device.type == "cuda":
        # Not cuDNN's SDPA: with a mask it planned its graph anew on many calls (about 7 ms of CPU each on an
        # H200), where the efficient and flash kernels take the mask at no such cost.
        with sdpa_kernel(_MASKED_SDPA):
            return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed, scale=scale,
                                                  enable_gqa=group > 1)[0]
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed, scale=scale,
                                          enable_gqa=group > 1)[0]


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int | None = None, kv_written: bool = False,
                    native: "cpu_kernels.NativeKernels | None" = None, sinks: int = 0,
                    kernels: str = "auto") -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D] (this step's new tokens) -> output [T, Hq, D].

    Writes the new K/V into the cache first (unless the caller's fused kernel did: `kv_written`), then
    attends through the block tables: with `native` (the model's backend: contiguous CPU caches in the
    model's dtype), the writes and the decodes' attention run in the native kernels; `kernels`
    (Backend.attention) says where Triton's serve; else torch's reference.
    """
    if not kv_written:
        if native is not None:
            native.write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
        else:
            write_kv(key_cache, value_cache, key, value, meta.slot_mapping)
    d = meta.num_decode_tokens
    if d and not meta.prefills:
        return _decode_attention(native, query, key_cache, value_cache, meta, scale, sliding_window, sinks, kernels)
    out = torch.empty_like(query)
    if d:
        out[:d] = _decode_attention(native, query, key_cache, value_cache, meta, scale, sliding_window, sinks,
                                    kernels)
    if _triton_serves(query, key_cache, kernels):  # every chunk in one launch
        from kvserve.kernels.triton_attention import paged_prefill_attention, prefill_batch

        key = ("triton_prefill", id(meta.prefills))  # one per KV group's chunks, built by the step's first layer
        batch = meta.cache.get(key)
        if batch is None:
            batch = meta.cache[key] = prefill_batch(meta.prefills, query.device)
        return paged_prefill_attention(query, key_cache, value_cache, meta.prefills, scale, sliding_window, sinks,
                                       out=out, batch=batch)
    for chunk in meta.prefills:
        o = _prefill_attention(query, key, value, key_cache, value_cache, chunk, scale, sliding_window, sinks)
        out[chunk.query_start:chunk.query_start + chunk.query_len] = o.transpose(0, 1)
    return out
