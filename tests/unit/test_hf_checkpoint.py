"""Hugging Face safetensors checkpoints load through the same model code as GGUF files.

The test writes a real HF directory with transformers' own save_pretrained (config.json +
model.safetensors) from a tiny random model, adds tokenizer.json and tokenizer_config.json, and
checks that our loader gives the same config and weights, the same logits, and that the offline
engine serves the directory.
"""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.models.hf_reference import hf_model_from_checkpoint
from kvserve.models.loader import load_checkpoint
from tests.hf_factory import write_hf_dir
from tests.parity import PagedHarness, rel_err


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def hf_dir(request, tmp_path_factory, tiny_llama_gguf, tiny_gemma_gguf, smollm2_gguf_path):
    gguf_path = tiny_llama_gguf if request.param == "llama" else tiny_gemma_gguf
    ck = load_checkpoint(gguf_path)
    out = tmp_path_factory.mktemp(f"hf-{request.param}")
    write_hf_dir(hf_model_from_checkpoint(ck), out, smollm2_gguf_path)
    return ck, out


def test_config_and_weights_match_the_gguf(hf_dir):
    ck, path = hf_dir
    assert any(path.glob("*.safetensors"))
    hf = load_checkpoint(path)
    assert hf.format == "hf"
    for field in ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "sliding_window", "tie_word_embeddings"):
        assert getattr(hf.config, field) == getattr(ck.config, field), field
    assert hf.config.is_sliding(0) == ck.config.is_sliding(0)
    assert set(hf.tensors) == set(ck.tensors)
    for name, t in ck.dense_tensors().items():
        assert torch.equal(hf.tensors[name].float(), t), name


def test_same_logits_as_the_gguf(hf_dir):
    ck, path = hf_dir
    ids = list(range(300, 340))
    a, b = PagedHarness(ck), PagedHarness(load_checkpoint(path))
    assert rel_err(b.prefill(ids, b.new_table(len(ids))), a.prefill(ids, a.new_table(len(ids)))) == 0.0


def test_engine_serves_the_directory(hf_dir):
    ck, path = hf_dir
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", swap_space=0)
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=8,
                                                                       ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    assert out[0].prompt_token_ids[:1] == [llm.get_tokenizer().token_to_id("<|im_start|>")]
