"""Numerical parity of our paged model code with transformers on the two shipped models (float32)."""
from __future__ import annotations

import gc

import pytest
import torch

from kvserve.models.loader import load_checkpoint
from kvserve.models.tokenizer import Tokenizer
from tests.parity import PagedHarness, hf_reference, reference_logits, rel_err

pytestmark = [pytest.mark.real_model, pytest.mark.slow]
TOL = 1e-4
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Q: What is the capital of Germany?\nA: The capital of Germany is Berlin.\nQ: What is 2 + 2?\nA:",
    "Photosynthesis is the process by which",
    "In 1969, the first humans to walk on the Moon were",
    "Les fleurs du jardin sont",
    "A list of prime numbers: 2, 3, 5, 7,",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def real(request, smollm2_gguf_path, gemma3_gguf_path):
    path = smollm2_gguf_path if request.param == "smollm2" else gemma3_gguf_path
    ck = load_checkpoint(path)
    tok = Tokenizer.from_gguf(path)
    hf = hf_reference(ck)
    h = PagedHarness(ck, num_blocks=64)
    yield path, ck, tok, hf, h
    del hf, h, ck
    gc.collect()


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text)


def test_prefill_matches(real):
    _, _, tok, hf, h = real
    ids = _ids(tok, PROMPTS[5] + " " + PROMPTS[3])
    assert rel_err(h.prefill(ids, h.new_table(len(ids))), reference_logits(hf, ids)) <= TOL


def test_decode_through_paged_cache_matches(real):
    _, _, tok, hf, h = real
    ids = _ids(tok, PROMPTS[1])
    assert rel_err(h.decode_each(ids, h.new_table(len(ids))), reference_logits(hf, ids)) <= TOL


def test_uneven_chunks_match(real):
    _, _, tok, hf, h = real
    ids = _ids(tok, PROMPTS[5] + PROMPTS[6])
    sizes, left, k = [], len(ids), 0
    while left:
        n = min(left, [7, 1, 16, 3, 11][k % 5])
        sizes.append(n)
        left -= n
        k += 1
    assert rel_err(h.chunked(ids, h.new_table(len(ids)), sizes), reference_logits(hf, ids)) <= TOL


def test_mixed_batch_matches(real):
    _, _, tok, hf, h = real
    prompts = [_ids(tok, p) for p in PROMPTS[:5]]
    for ours, ids in zip(h.mixed_batch(prompts), prompts):
        assert rel_err(ours, reference_logits(hf, ids)) <= TOL


def test_greedy_continuations_match_transformers_generate(real):
    from kvserve import LLM, SamplingParams

    path, ck, tok, hf, _ = real
    prompts = [_ids(tok, p) for p in PROMPTS]
    llm = LLM(str(path), dtype="float32", seed=0)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    # One left-padded batch for the reference: 32 steps instead of 320 sequential ones.
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = hf.generate(input_ids, attention_mask=mask, max_new_tokens=32, do_sample=False)[:, width:].tolist()
    same = sum(out.outputs[0].token_ids == r for out, r in zip(outs, ref))
    assert same >= 9, f"only {same}/10 greedy continuations match transformers"
