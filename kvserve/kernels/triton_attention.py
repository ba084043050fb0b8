"""Paged attention for CUDA in Triton: each decode and prefill chunk reads its K and V through its block table in
place.

The torch reference (models/attention._decode_attention_torch) gathers every sequence's pages into a dense
tensor padded to the batch's longest context, then masks: a batch with one long context moves that context's
KV for every sequence, every layer. Here a program owns one (sequence, kv head, split of its pages): it reads
only that sequence's pages, in place, for all the query heads of its GQA group at once (a page is read once
for the group), keeping an online softmax in float32. Long contexts split their pages across programs
(split-K: a decode batch of a few sequences still fills the GPU), and a second kernel merges the splits by
their log-sum-exp. Sliding windows skip the pages before a row's window; sinks (StreamingLLM) attend to the
first keys as well. Prefill chunks (a fresh prompt, or a chunk after a cached prefix) go in one launch per step:
a program per (chunk, 16 rows, query head), flash-attention's loop over the chunk's pages up to its last row.

Caches are indexed as everywhere (models/attention.kv_cache_shape): [kv_heads, blocks, block_size, head_dim], read
through their strides, so either storage order serves (on CUDA blocks first: models/attention.new_kv_cache); a
float or e4m3 cache (an 8-bit integer cache keeps the reference path). Triton runs these on the CPU too, in its interpreter
(TRITON_INTERPRET=1, set before this module is imported): the tests hold them to the reference there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, m_ptr, l_ptr,
                         scale, window, sinks, splits,
                         stride_qt, stride_qh, stride_kh, stride_kb, stride_kt, stride_tab,
                         stride_ot, stride_os, stride_oh, stride_ms, stride_mt,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         PAGE: tl.constexpr, WINDOWED: tl.constexpr):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    context = tl.load(lens_ptr + seq)
    heads = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < GROUP
    dim_ok = dims < HEAD_DIM
    q_heads = kv_head * GROUP + heads
    q = tl.load(q_ptr + seq * stride_qt + q_heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)

    # The row's own pages (from its window's first, where sinks do not need the earlier ones) in `splits`
    # equal runs: a short row in a batch with a long one still spreads over every split, and the grid depends
    # on the batch's shape only, not on its contexts (a CUDA graph replays it for any contexts).
    num_pages = tl.cdiv(context, PAGE)
    lo = context - context  # (the type of context)
    if WINDOWED:  # pages wholly before the window (and past the sinks) hold no key this row attends to
        if sinks == 0:
            lo = tl.maximum(context - window, 0) // PAGE
    pages_per_split = tl.cdiv(num_pages - lo, splits)
    first = lo + split * pages_per_split
    last = tl.minimum(first + pages_per_split, num_pages)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    offsets = tl.arange(0, PAGE)
    for page in range(first, last):
        block = tl.load(tables_ptr + seq * stride_tab + page).to(tl.int64)
        base = kv_head * stride_kh + block * stride_kb + offsets[:, None] * stride_kt + dims[None, :]
        k = tl.load(k_ptr + base, mask=dim_ok[None, :], other=0.0).to(tl.float32)  # [PAGE, D]
        v = tl.load(v_ptr + base, mask=dim_ok[None, :], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, PAGE]
        pos = page * PAGE + offsets
        keep = pos < context
        if WINDOWED:
            keep = keep & ((pos > context - 1 - window) | (pos < sinks))
        scores = tl.where(keep[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a page with nothing kept yet: no NaN
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    mask = head_ok[:, None] & dim_ok[None, :]
    tl.store(out_ptr + seq * stride_ot + split * stride_os + q_heads[:, None] * stride_oh + dims[None, :], out,
             mask=mask)
    tl.store(m_ptr + split * stride_ms + seq * stride_mt + q_heads, m, mask=head_ok)
    tl.store(l_ptr + split * stride_ms + seq * stride_mt + q_heads, l, mask=head_ok)


@triton.jit
def _merge_splits_kernel(part_ptr, m_ptr, l_ptr, out_ptr, splits,
                         stride_pt, stride_ps, stride_ph, stride_ms, stride_mt, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    parts = tl.arange(0, BLOCK_S)
    part_ok = parts < splits
    m = tl.load(m_ptr + parts * stride_ms + seq * stride_mt + head, mask=part_ok, other=float("-inf"))
    l = tl.load(l_ptr + parts * stride_ms + seq * stride_mt + head, mask=part_ok, other=0.0)
    top = tl.max(m, axis=0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp(m - top)) * l  # each split's share of the softmax's sum
    acc = tl.load(part_ptr + seq * stride_pt + parts[:, None] * stride_ps + head * stride_ph + dims[None, :],
                  mask=part_ok[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + dims, out, mask=dims < HEAD_DIM)


def splits_for(batch: int, kv_heads: int, max_pages: int, programs: int = 264) -> int:
    """Page splits per (sequence, kv head): enough programs to fill the GPU (`programs`: about two per SM of an
    H100) when the batch alone does not, never splits of under 4 pages."""
    wanted = max(1, programs // max(1, batch * kv_heads))
    return max(1, min(wanted, max_pages // 4))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           window: int | None = None, sinks: int = 0, max_context: int | None = None,
                           splits: int | None = None) -> torch.Tensor:
    """query [D, Hq, hd] (one decode token a sequence), caches [Hkv, blocks, page, hd], block_tables
    [D, pages] int, context_lens [D] (the new token included) -> [D, Hq, hd] in the query's dtype.
    `max_context`: the batch's longest context where the caller knows it (else read from context_lens: one
    sync); `splits`: page splits per sequence (default `splits_for`)."""
    d, hq, hd = query.shape
    hkv, _, page, _ = key_cache.shape
    if d == 0:
        return query.new_empty(query.shape)
    if page & (page - 1) or hq % hkv:
        raise ValueError(f"paged decode attention needs a power-of-two page ({page}) and GQA groups ({hq}/{hkv})")
    group = hq // hkv
    if splits is None:
        longest = max_context if max_context is not None else int(context_lens.max())
        splits = splits_for(d, hkv, max(1, triton.cdiv(longest, page)))
    query = query.contiguous()
    part = torch.empty((d, splits, hq, hd), dtype=torch.float32, device=query.device)
    m = torch.empty((splits, d, hq), dtype=torch.float32, device=query.device)
    l = torch.empty_like(m)
    block_d = triton.next_power_of_2(hd)
    _decode_split_kernel[(d, hkv, splits)](
        query, key_cache, value_cache, block_tables, context_lens, part, m, l,
        scale, window or 0, sinks, splits,
        query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_tables.stride(0), part.stride(0), part.stride(1), part.stride(2), m.stride(0), m.stride(1),
        GROUP=group, BLOCK_G=max(2, triton.next_power_of_2(group)), HEAD_DIM=hd, BLOCK_D=block_d, PAGE=page,
        WINDOWED=window is not None)
    out = torch.empty((d, hq, hd), dtype=torch.float32, device=query.device)
    _merge_splits_kernel[(d, hq)](part, m, l, out, splits, part.stride(0), part.stride(1), part.stride(2),
                                  m.stride(0), m.stride(1), out.stride(0), out.stride(1),
                                  HEAD_DIM=hd, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)))
    return out.to(query.dtype)


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, starts_ptr, qlens_ptr, ctx_ptr, scale, window, sinks,
                    stride_qt, stride_qh, stride_kh, stride_kb, stride_kt, stride_tab,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    PAGE: tl.constexpr, WINDOWED: tl.constexpr, PRECISION: tl.constexpr):
    chunk, block_m, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    qlen = tl.load(qlens_ptr + chunk)
    if block_m * BLOCK_M >= qlen:
        return
    start = tl.load(starts_ptr + chunk)
    context = tl.load(ctx_ptr + chunk)
    first_pos = context - qlen  # the chunk's first token's position: the cached prefix comes before it
    rows = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < qlen
    qpos = first_pos + rows
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(q_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    kv_head = head // GROUP

    last = tl.minimum(first_pos + (block_m + 1) * BLOCK_M, context)  # keys up to the block's last row
    first_page = 0
    if WINDOWED:
        if sinks == 0:
            first_page = tl.maximum(first_pos + block_m * BLOCK_M - window + 1, 0) // PAGE
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offsets = tl.arange(0, PAGE)
    for page in range(first_page, tl.cdiv(last, PAGE)):
        block = tl.load(tables_ptr + chunk * stride_tab + page).to(tl.int64)
        base = kv_head * stride_kh + block * stride_kb + offsets[:, None] * stride_kt + dims[None, :]
        # [PAGE, D] in the query's dtype (an e4m3 cache's values widened: the dots do not take them as stored)
        k = tl.load(k_ptr + base, mask=dim_ok[None, :], other=0.0).to(q.dtype)
        v = tl.load(v_ptr + base, mask=dim_ok[None, :], other=0.0).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [M, PAGE], fp32 sums
        kpos = page * PAGE + offsets
        keep = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] < context)
        if WINDOWED:
            keep = keep & ((kpos[None, :] > qpos[:, None] - window) | (kpos[None, :] < sinks))
        scores = tl.where(keep, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + (start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@dataclass(frozen=True)
class PrefillBatch:
    """A step's prefill chunks as the kernel reads them, on the device: built once a step (`prefill_batch`) and
    shared by every layer, so no layer copies from the host (a copy from pageable memory waits for the stream)."""

    tables: torch.Tensor  # [chunks, pages] int64, each chunk's table padded with block 0
    fields: torch.Tensor  # [3, chunks] int64: starts in the batch, lengths, contexts after the chunk
    longest: int  # the longest chunk's rows


def prefill_batch(chunks: list, device: torch.device) -> PrefillBatch:
    width = max(len(c.block_table) for c in chunks)
    tables = torch.stack([torch.nn.functional.pad(c.block_table.to(device, torch.int64),
                                                  (0, width - len(c.block_table))) for c in chunks])
    fields = torch.tensor([[c.query_start for c in chunks], [c.query_len for c in chunks],
                           [c.context_len for c in chunks]], dtype=torch.int64)
    if device.type == "cuda":
        fields = fields.pin_memory()
    return PrefillBatch(tables, fields.to(device, non_blocking=True), max(c.query_len for c in chunks))


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            chunks: list, scale: float, window: int | None = None, sinks: int = 0,
                            out: torch.Tensor | None = None, batch: PrefillBatch | None = None) -> torch.Tensor:
    """Every prefill chunk of a step in one launch: query [T, Hq, hd] (the step's flattened tokens), the chunks
    (models/attention.PrefillChunk: where each starts in the batch, its length, its context after it, its block
    table) whose K/V the cache holds already (written before attention, the chunk's own included). Each program
    takes BLOCK_M rows of one chunk and one query head, and reads the chunk's pages up to its last row in place:
    causal, with the window and sinks per row. Writes the chunks' rows of `out` (default: a new [T, Hq, hd]).
    `batch`: the chunks as the kernel reads them, where the caller built them once for every layer."""
    hkv, _, page, _ = key_cache.shape
    _, hq, hd = query.shape
    out = torch.empty_like(query) if out is None else out
    if not chunks:
        return out
    batch = batch or prefill_batch(chunks, query.device)
    tables, fields, longest = batch.tables, batch.fields, batch.longest
    block_m = 16
    query = query.contiguous()
    _prefill_kernel[(len(chunks), triton.cdiv(longest, block_m), hq)](
        query, key_cache, value_cache, out, tables, fields[0], fields[1], fields[2], scale, window or 0,
        sinks, query.stride(0), query.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        tables.stride(0), GROUP=hq // hkv, HEAD_DIM=hd, BLOCK_D=max(16, triton.next_power_of_2(hd)),
        BLOCK_M=block_m, PAGE=page, WINDOWED=window is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32")  # (float32 caches: no TF32 rounding)
    return out
