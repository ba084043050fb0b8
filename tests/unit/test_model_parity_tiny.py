"""Tiny random Llama and Gemma 3 (written as GGUF) against transformers, through the paged cache."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvserve.models.loader import hf_name_for_gguf, load_checkpoint, unpermute_rope_rows
from tests.gguf_factory import permute_rope_rows
from tests.parity import PagedHarness, hf_reference, reference_logits, rel_err

TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def tiny(request, tiny_llama_gguf, tiny_gemma_gguf):
    path = tiny_llama_gguf if request.param == "llama" else tiny_gemma_gguf
    ck = load_checkpoint(path)
    return ck, hf_reference(ck), PagedHarness(ck)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def test_unpermute_inverts_llama_cpp_permutation():
    w = np.random.default_rng(0).standard_normal((12 * 16, 40)).astype(np.float32)
    for heads in (12, 3):
        back = unpermute_rope_rows(torch.from_numpy(permute_rope_rows(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))


def test_gguf_names_map_to_hf():
    assert hf_name_for_gguf("blk.3.ffn_norm.weight", "llama") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_name_for_gguf("blk.3.ffn_norm.weight", "gemma3") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert hf_name_for_gguf("token_embd.weight", "gemma3") == "model.embed_tokens.weight"


def test_whole_prefill(tiny):
    ck, hf, h = tiny
    ids = _prompt(40, 1)  # longer than the tiny Gemma's 8-token window
    assert rel_err(h.prefill(ids, h.new_table(len(ids))), reference_logits(hf, ids)) <= TOL


def test_token_by_token_decode(tiny):
    ck, hf, h = tiny
    ids = _prompt(37, 2)
    assert rel_err(h.decode_each(ids, h.new_table(len(ids))), reference_logits(hf, ids)) <= TOL


def test_uneven_chunks(tiny):
    ck, hf, h = tiny
    ids = _prompt(45, 3)
    ours = h.chunked(ids, h.new_table(len(ids)), [5, 1, 13, 2, 17, 7])
    assert rel_err(ours, reference_logits(hf, ids)) <= TOL


def test_mixed_flattened_batch(tiny):
    ck, hf, h = tiny
    prompts = [_prompt(n, 10 + n) for n in (23, 9, 31, 17, 12)]
    for ours, ids in zip(h.mixed_batch(prompts), prompts):
        assert rel_err(ours, reference_logits(hf, ids)) <= TOL


def test_bfloat16_runs_close_to_float32(tiny):
    ck, hf, _ = tiny
    h16 = PagedHarness(ck, dtype=torch.bfloat16)
    ids = _prompt(20, 4)
    ours = h16.prefill(ids, h16.new_table(len(ids)))
    assert ours.dtype == torch.float32  # logits always come back in float32
    assert rel_err(ours, reference_logits(hf, ids)) < 0.1
