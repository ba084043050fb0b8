"""The KV cache stored blocks first (Plan.kv_pages_contiguous, CUDA's layout: a page of every head one run) against
heads first (the CPU's): the same logits bit for bit through the torch reference and Triton's kernels (in the
interpreter), and the same pages through writes, swaps, copies and a lower tier's reads and loads, for float,
8-bit integer and e4m3 caches."""
from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles the kernels: they run on the CPU here

import pytest  # noqa: E402
import torch  # noqa: E402

from kvserve.engine.worker.runner import BatchItem, ModelRunner  # noqa: E402
from kvserve.kernels import kv_quant  # noqa: E402
from kvserve.models.attention import new_kv_cache, pages, write_kv  # noqa: E402
from kvserve.models.backend import Backend  # noqa: E402
from kvserve.models.loader import build_model, load_checkpoint, plan_for  # noqa: E402

BLOCK = 16


def test_blocks_first_storage_is_a_view_indexed_as_heads_first():
    cache = new_kv_cache((4, 10, BLOCK, 8), torch.float32, pages_contiguous=True)
    assert cache.shape == (4, 10, BLOCK, 8) and not cache.is_contiguous()
    assert pages(cache).is_contiguous()  # a page of every head: one run of memory
    one_head = new_kv_cache((1, 10, BLOCK, 8), torch.float32, pages_contiguous=True)
    assert one_head.is_contiguous()  # one kv head: the two orders are the same memory


@pytest.mark.parametrize("kind", ["float32", "int8", "fp8"])
def test_writes_land_in_the_same_pages(kind):
    """write_kv's slots in either order: every (head, block, offset) holds the same bytes."""
    width = kv_quant.row_width(8, kind == "int8")  # int8 rows carry their fp16 scales
    dtype = {"float32": torch.float32, "int8": torch.uint8, "fp8": torch.float8_e4m3fn}[kind]
    shape = (3, 12, BLOCK, width)
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(40, 3, 8, generator=g), torch.randn(40, 3, 8, generator=g)
    slots = torch.randperm(12 * BLOCK, generator=g)[:40]
    caches = []
    for contiguous_pages in (False, True):
        k, v = (new_kv_cache(shape, dtype, pages_contiguous=contiguous_pages) for _ in "kv")
        write_kv(k, v, key, value, slots)
        caches.append((k, v))
    (k0, v0), (k1, v1) = caches
    for a, b in ((k0, k1), (v0, v1)):
        assert torch.equal(a.view(torch.uint8) if kind == "fp8" else a, b.view(torch.uint8) if kind == "fp8" else b)
        assert a.view(torch.uint8).any() if kind != "float32" else a.any()


def _runner(ck, contiguous_pages: bool, attention: str, kv_int8: bool = False, host_blocks: int = 8):
    model = build_model(ck, plan_for(ck, torch.float32), max_positions=512)
    model.use_backend(Backend("cpu-torch", attention=attention))
    return ModelRunner(model, ck.config, 48, host_blocks, BLOCK, torch.float32, torch.device("cpu"), kv_int8=kv_int8,
                       pages_contiguous=contiguous_pages)


@pytest.mark.parametrize("attention,kv_int8", [("torch", False), ("triton", False), ("torch", True)])
def test_a_model_gives_the_same_bits_over_either_storage(tiny_llama_gguf, attention, kv_int8):
    """A prompt in two chunks, a second sequence beside it, then decodes: every logit equal; then the block moves
    (swap out and back in elsewhere, a copy, a lower tier's read and load) give the same pages and logits."""
    ck = load_checkpoint(tiny_llama_gguf)
    runners = [_runner(ck, c, attention, kv_int8) for c in (False, True)]
    a_ids, b_ids = list(range(40, 77)), list(range(100, 121))
    a_table, b_table = [9, 3, 14], [20, 7]
    outs = []
    for r in runners:
        logits = [r.forward([BatchItem(a_ids[:20], 0, a_table)], all_logits=True),
                  r.forward([BatchItem(a_ids[20:], 20, a_table), BatchItem(b_ids, 0, b_table)], all_logits=True),
                  r.forward([BatchItem(a_ids[-1:], 37, a_table), BatchItem(b_ids[-1:], 21, b_table)])]
        r.swap_out([(9, 0), (3, 1)])
        r.swap_in([(0, 30), (1, 31)])
        r.copy_blocks([(14, 32)])
        r.load(list(zip([40, 41], r.read_pages([20, 7]))))
        logits.append(r.forward([BatchItem([5], 38, [30, 31, 32]), BatchItem([6], 22, [40, 41])]))
        outs.append((logits, r.read_pages([30, 31, 32, 40, 41, 9, 3, 14, 20, 7])))
    (heads_first, heads_pages), (blocks_first, blocks_pages) = outs
    for x, y in zip(heads_first, blocks_first):
        assert torch.equal(x, y)
    assert heads_pages == blocks_pages  # the lower tier's bytes: one format whichever the storage
    assert heads_pages[0] == heads_pages[5]  # the swapped-in page is the one swapped out
    assert heads_pages[3] == heads_pages[8]  # the loaded page is the one read
