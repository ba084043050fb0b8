"""The CUDA paged decode kernel (kvserve/kernels/triton_attention.py) under Triton's CPU interpreter, against the
torch reference (models/attention._decode_attention_torch) that serves where it does not: ragged contexts
over scattered pages, GQA groups of several sizes, split-K merges, sliding windows with and without sinks,
block tables padded past a row's pages, a head dim that is not a power of two, bf16, float32 and e4m3 caches."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles the kernels: they run on the CPU here

import pytest  # noqa: E402
import torch  # noqa: E402

from kvserve.kernels.triton_attention import paged_decode_attention, paged_prefill_attention, splits_for  # noqa: E402
from kvserve.models.attention import AttentionMetadata, _decode_attention_torch  # noqa: E402

PAGE = 16


def _batch(contexts: list[int], hq: int, hkv: int, hd: int, dtype: torch.dtype, seed: int = 0, pad_pages: int = 2):
    """Queries, caches whose pages are scattered over the pool, and block tables padded with block 0."""
    g = torch.Generator().manual_seed(seed)
    pages = [-(-c // PAGE) for c in contexts]
    blocks = sum(pages) + 3
    perm = torch.randperm(blocks, generator=g)
    tables = torch.zeros(len(contexts), max(pages) + pad_pages, dtype=torch.int64)
    at = 0
    for i, n in enumerate(pages):
        tables[i, :n] = perm[at:at + n]
        at += n
    key = torch.randn(hkv, blocks, PAGE, hd, generator=g).to(dtype)
    value = torch.randn(hkv, blocks, PAGE, hd, generator=g).to(dtype)
    query = torch.randn(len(contexts), hq, hd, generator=g).to(dtype)
    return query, key, value, tables, torch.tensor(contexts, dtype=torch.int64)


def _reference(query, key, value, tables, lens, scale, window=None, sinks=0):
    meta = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.int64), num_decode_tokens=len(lens),
                             decode_block_tables=tables, decode_context_lens=lens,
                             decode_max_context=int(lens.max()), decode_min_context=int(lens.min()))
    return _decode_attention_torch(query.float(), key.float(), value.float(), meta, scale, window, sinks)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("splits", [1, 3])
def test_ragged_gqa_batches_match_the_reference(hq, hkv, splits):
    contexts = [1, 17, 40, 95, 16]
    query, key, value, tables, lens = _batch(contexts, hq, hkv, 32, torch.float32, seed=hq + splits)
    out = paged_decode_attention(query, key, value, tables, lens, 0.2, splits=splits)
    torch.testing.assert_close(out, _reference(query, key, value, tables, lens, 0.2), rtol=1e-4, atol=1e-5)


def test_an_fp8_cache_is_read_as_its_values():
    """An e4m3 cache (kv_cache_dtype = "fp8"): the kernel casts what it loads, as the reference reads the values."""
    query, key, value, tables, lens = _batch([5, 33, 70], 8, 2, 32, torch.float32, seed=7)
    key, value = key.to(torch.float8_e4m3fn), value.to(torch.float8_e4m3fn)
    out = paged_decode_attention(query, key, value, tables, lens, 0.2, splits=2)
    torch.testing.assert_close(out, _reference(query, key, value, tables, lens, 0.2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window,sinks", [(24, 0), (24, 4), (5, 0), (1, 2)])
def test_windows_and_sinks_match_the_reference(window, sinks):
    contexts = [3, 30, 64, 81]
    query, key, value, tables, lens = _batch(contexts, 8, 4, 32, torch.float32, seed=window)
    for splits in (1, 4):
        out = paged_decode_attention(query, key, value, tables, lens, 0.25, window=window, sinks=sinks, splits=splits)
        torch.testing.assert_close(out, _reference(query, key, value, tables, lens, 0.25, window, sinks),
                                   rtol=1e-4, atol=1e-5)


def test_bf16_caches_and_an_odd_head_dim():
    """bf16 K/V widened to float32 in the kernel: within bf16's rounding of the output; head dim 80 (masked
    lanes of a 128-wide tile)."""
    query, key, value, tables, lens = _batch([7, 50, 33], 4, 2, 80, torch.bfloat16, seed=9)
    out = paged_decode_attention(query, key, value, tables, lens, 80 ** -0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), _reference(query, key, value, tables, lens, 80 ** -0.5),
                               rtol=2e-2, atol=2e-2)


def test_split_counts_fill_the_device_without_tiny_splits():
    assert splits_for(batch=1, kv_heads=8, max_pages=256) == 33  # one sequence: its pages over many programs
    assert splits_for(batch=64, kv_heads=8, max_pages=256) == 1  # a batch fills the GPU by itself
    assert splits_for(batch=1, kv_heads=8, max_pages=6) == 1  # never splits of under 4 pages
    empty = paged_decode_attention(torch.zeros(0, 4, 32), torch.zeros(2, 4, PAGE, 32), torch.zeros(2, 4, PAGE, 32),
                                   torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 1.0)
    assert empty.shape == (0, 4, 32)


@pytest.mark.parametrize("window,sinks,cache", [(None, 0, "float32"), (20, 0, "float32"), (20, 3, "float32"),
                                                (None, 0, "e4m3"), (20, 3, "e4m3")])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_prefill_chunks_match_the_reference(window, sinks, cache, hq, hkv):
    """One launch for a step's chunks: a fresh prompt, a chunk after a cached prefix, a one-token chunk and a
    chunk longer than a program's 16 rows, each against the reference's own attention of that chunk; float32
    caches, and e4m3 ones (kv_cache_dtype = "fp8": the kernel widens the values it loads)."""
    from kvserve.models.attention import PrefillChunk, _prefill_attention

    torch.manual_seed(hq + (window or 0) + sinks)
    hd, specs = 32, [(0, 20), (37, 13), (69, 1), (5, 40)]  # (cached prefix, chunk length)
    pages = [-(-(p + n) // PAGE) for p, n in specs]
    blocks = sum(pages) + 2
    perm = torch.randperm(blocks)
    key_cache, value_cache = torch.randn(hkv, blocks, PAGE, hd), torch.randn(hkv, blocks, PAGE, hd)
    if cache == "e4m3":
        key_cache, value_cache = key_cache.to(torch.float8_e4m3fn), value_cache.to(torch.float8_e4m3fn)
    chunks, at, start = [], 0, 0
    for (prefix, n), count in zip(specs, pages):
        chunks.append(PrefillChunk(start, n, prefix + n, perm[at:at + count].clone()))
        at, start = at + count, start + n
    query = torch.randn(start, hq, hd)
    # The step's own K/V as the cache holds them (written before attention).
    rows = []
    for c in chunks:
        pos = torch.arange(c.start_pos, c.context_len)
        rows.append((c.block_table[pos // PAGE], pos % PAGE))
    key = torch.cat([key_cache[:, b, o].transpose(0, 1) for b, o in rows]).float()
    value = torch.cat([value_cache[:, b, o].transpose(0, 1) for b, o in rows]).float()
    out = paged_prefill_attention(query, key_cache, value_cache, chunks, 0.3, window, sinks)
    for c in chunks:
        want = _prefill_attention(query, key, value, key_cache, value_cache, c, 0.3, window, sinks).transpose(0, 1)
        torch.testing.assert_close(out[c.query_start:c.query_start + c.query_len], want, rtol=1e-4, atol=1e-5)


def test_a_model_on_the_triton_kernels_gives_the_reference_logits(tiny_llama_gguf):
    """The whole CUDA attention path of a model (Backend.attention = "triton": decodes and prefill chunks through
    the kernels, in the interpreter here) against the same model on the reference: a prompt whole, then in
    chunks after a cached prefix, then token by token, and a step mixing a decode with chunks."""
    from kvserve.models.backend import Backend
    from kvserve.models.loader import load_checkpoint
    from tests.parity import PagedHarness, rel_err

    ck = load_checkpoint(tiny_llama_gguf)
    ours, reference = PagedHarness(ck), PagedHarness(ck)
    for h, kernels in ((ours, "triton"), (reference, "torch")):
        h.model.use_backend(Backend("cpu-torch", attention=kernels))  # no CPU kernels: every row on `kernels`
    ids = list(range(40, 90))
    for run in ("prefill", "chunked", "decode_each"):
        args = (ids, ours.new_table(len(ids))), (ids, reference.new_table(len(ids)))
        extra = ([20, 17, 13],) if run == "chunked" else ()
        a, b = getattr(ours, run)(*args[0], *extra), getattr(reference, run)(*args[1], *extra)
        assert rel_err(a, b) <= 1e-5, run
    prompts = [list(range(5, 5 + n)) for n in (23, 9, 31)]
    for a, b in zip(ours.mixed_batch(prompts), reference.mixed_batch(prompts)):
        assert rel_err(a, b) <= 1e-5
