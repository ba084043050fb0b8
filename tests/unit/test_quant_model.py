"""The `weights` setting end to end: what the loader keeps, what the engine reports and serves, and that the
quantized model computes with the file's own weights (against the float32 reference of those weights)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import ConfigError
from kvserve.kernels import cpu as cpu_kernels
from kvserve.models import quant
from kvserve.models.loader import (build_model, checkpoint_header, describe_forms, load_checkpoint, plan_for,
                                   weights_label)
from kvserve.models.quant import QuantizedMatrix
from tests.parity import PagedHarness, rel_err

native = cpu_kernels.load()
needs_packed_gemm = pytest.mark.skipif(native is None or not native.fused,
                                       reason="quantized weights run on the fused decoder's kernels (AMX or AVX2)")


@pytest.mark.parametrize("weights,bits", [("auto", 8), ("int8", 8), ("int4", 4), ("bf16", 0)])
def test_the_loader_keeps_each_matrix_in_the_form_asked(tiny_llama_gguf, weights, bits):
    ck = load_checkpoint(tiny_llama_gguf, weights)  # a Q8_0 file: auto keeps 8 bits
    matrices = {name: t for name, t in ck.tensors.items() if name.endswith("proj.weight") or "embed" in name}
    assert matrices
    if bits:
        assert all(isinstance(t, QuantizedMatrix) and t.bits == bits for t in matrices.values())
    else:
        assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in matrices.values())
    assert all(t.dtype == torch.float32 and t.dim() == 1 for n, t in ck.tensors.items() if n.endswith("norm.weight"))
    (kind, form, exact), count = next(iter(ck.forms.items()))
    assert kind == "Q8_0" and form == (f"int{bits}" if bits else "dense") and exact == (bits != 4)
    assert count == len(matrices)


def test_labels_say_what_is_computed_from(tiny_llama_gguf):
    ck = load_checkpoint(tiny_llama_gguf, "int4")
    assert weights_label(ck, True, torch.bfloat16) == "int4"
    assert weights_label(ck, False, torch.float32) == "float32"  # dequantized where the kernels do not run
    assert describe_forms(ck.forms) == f"{sum(ck.forms.values())} Q8_0 requantized to int4"
    assert weights_label(load_checkpoint(tiny_llama_gguf, "bf16"), True, torch.bfloat16) == "bfloat16"


def test_a_header_is_read_without_the_weights(tiny_llama_gguf):
    config, names = checkpoint_header(tiny_llama_gguf)
    ck = load_checkpoint(tiny_llama_gguf)
    assert config == ck.config and names == set(ck.tensors)


def test_an_engine_build_consumes_its_checkpoint(tiny_llama_gguf):
    """The engine's load gives the model the checkpoint's tensors, so each unpacked matrix can be freed as it
    is packed (the weights are never held twice)."""
    ck = load_checkpoint(tiny_llama_gguf)
    build_model(ck, plan_for(ck, torch.float32), 256, consume=True)
    assert ck.tensors == {}


def test_an_unknown_setting_is_refused(tiny_llama_gguf):
    with pytest.raises(ConfigError, match="weights"):
        LLM(str(tiny_llama_gguf), weights="int3")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):  # a float KV cache is in the model's dtype
        LLM(str(tiny_llama_gguf), dtype="float32", kv_cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(str(tiny_llama_gguf), kv_cache_dtype="int4")
    LLM(str(tiny_llama_gguf), dtype="float32", kv_cache_dtype="float32", kv_cache_memory="16MiB", swap_space=0)


@needs_packed_gemm
@pytest.mark.parametrize("weights", ["auto", "int4"])
def test_a_quantized_model_matches_the_float32_reference_of_its_weights(tiny_llama_gguf, weights):
    """bf16 with quantized weights (fused and per op) against float32 on the same weights, dequantized: as
    close as the dense bf16 model is to its own float32 reference."""
    ck = load_checkpoint(tiny_llama_gguf, weights)
    dense = load_checkpoint(tiny_llama_gguf, "bf16") if weights == "auto" else None
    ids = list(range(300, 345))
    fused = PagedHarness(ck, dtype=torch.bfloat16)
    per_op = PagedHarness(ck, dtype=torch.bfloat16)
    per_op.model.native_decoder = None
    reference = PagedHarness(ck, dtype=torch.float32).prefill(ids, list(range(1, 5)))
    errs = [rel_err(h.prefill(ids, h.new_table(len(ids))), reference) for h in (fused, per_op)]
    assert max(errs) <= 3e-2
    if dense is not None:  # Q8_0 as int8 is exactly the file's weights: the dense float32 reference is the same
        assert torch.equal(PagedHarness(dense, dtype=torch.float32).prefill(ids, list(range(1, 5))), reference)


@needs_packed_gemm
def test_the_engine_reports_and_serves_its_weights(tiny_llama_gguf):
    llm = LLM(str(tiny_llama_gguf), weights="int4", kv_cache_memory="64MiB", swap_space=0)
    assert llm.engine.weights == "int4"
    model = llm.engine.runner.model
    assert model.weight_bytes() < sum(t.numel() for t in load_checkpoint(tiny_llama_gguf, "bf16").tensors.values()) * 2
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8
    assert LLM(str(tiny_llama_gguf), dtype="float32", weights="int4", kv_cache_memory="64MiB",
               swap_space=0).engine.weights == "float32"


def test_the_hf_loader_quantizes_when_asked(tiny_llama_gguf, tmp_path):
    from kvserve.models.hf_reference import hf_model_from_checkpoint

    hf_model_from_checkpoint(load_checkpoint(tiny_llama_gguf)).save_pretrained(tmp_path, safe_serialization=True)
    ck = load_checkpoint(tmp_path, "int8")
    assert all(isinstance(t, QuantizedMatrix) and t.bits == 8 for n, t in ck.tensors.items() if n.endswith("proj.weight"))
    assert list(ck.forms) == [("float32", "int8", False)]
    assert all(isinstance(t, torch.Tensor) for t in load_checkpoint(tmp_path).tensors.values())
    assert quant.weight_bits(quant.F32, "auto") == 0
