"""FP8 on the CPU (models/fp8.py; torch._scaled_mm runs here as torch's reference): the e4m3 rounding of rows with
their scales, the scaled GEMM against the product of the rounded operands and of the dense ones, whole models with
fp8 projections (a mixture's router and the LM head kept as they were) and with an e4m3 KV cache against the
dense ones, the engine generating with both, and where the plan refuses them."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams
from kvserve.config import CacheConfig, ConfigError, EngineConfig
from kvserve.kernels import cpu as cpu_kernels
from kvserve.models import attention, backend, fp8
from kvserve.models.layers import Embedding, FusedLinear, Linear
from kvserve.models.loader import describe_forms, load_checkpoint, plan_for, weights_label
from kvserve.models.moe import SparseMoE
from tests.hf_factory import tiny_model, write_gguf
from tests.parity import PagedHarness

# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most half a unit in the last place,
# 2^-4 of it. Below the smallest normal (2^-6) the codes are evenly spaced 2^-9 apart: half of that, absolute.
U = 2.0 ** -4
SUBNORMAL = 2.0 ** -10
# Whole models with fp8 projections (or an fp8 cache) against the same weights dense in float32: the positions'
# logits point the same way, on average over a prompt. It holds on these tiny models with a margin, and scales a
# quarter off fall far below it (test_the_bound_fails_where_the_scales_are_wrong). A mixture's is looser: where
# fp8's rounding moves a token's router logits across a tie, the token takes another expert.
MEAN_COSINE = 0.98
MIXTURE_MEAN_COSINE = 0.97

native = cpu_kernels.load()


def _cosines(ours: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(ours.float(), reference.float(), dim=-1)


def _projections(model) -> list:
    return [m for m in model.modules() if isinstance(m, (FusedLinear, Linear))]


# ---- the rounding and the GEMM ------------------------------------------------------------------------

def test_rows_round_to_e4m3_within_half_a_unit_of_their_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g) * torch.logspace(-4, 3, 64)[:, None]  # rows of many magnitudes
    w[5] = 0.0
    w[9, 3] = 1e4  # one large value: the rest of its row falls to few codes, some subnormal
    q, scale = fp8.quantize_weight(w)
    assert q.dtype == fp8.DTYPE and q.is_contiguous() and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (64,) and bool((scale > 0).all())
    back = fp8.dequantize_rows(q, scale)
    bound = (U + 1e-6) * w.abs() + SUBNORMAL * scale[:, None]
    assert bool(((back - w).abs() <= bound).all())
    assert bool((back[5] == 0).all())
    live = torch.arange(64) != 5
    assert bool((q.float().abs().amax(-1)[live] == fp8.E4M3_MAX).all())  # each row's amax on the largest code


def test_activation_rows_keep_their_batch_shape():
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    q, scale = fp8.quantize_rows(x)
    assert q.shape == x.shape and scale.shape == (3, 5, 1)
    assert bool(((fp8.dequantize_rows(q, scale) - x.float()).abs() <= U * x.float().abs() + SUBNORMAL * scale).all())
    assert torch.equal(fp8.to_e4m3(torch.tensor([1e6, -1e6])).float(), torch.tensor([448.0, -448.0]))  # saturated


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_scaled_gemm_is_the_product_of_the_rounded_operands(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=g).to(dtype)
    w, bias = torch.randn(48, 96, generator=g) / math.sqrt(96), torch.randn(48, generator=g)
    wq, ws = fp8.quantize_weight(w)
    out = fp8.fp8_linear(x, wq, ws, bias.to(dtype))
    assert out.dtype == dtype and out.shape == (7, 48)
    xq, xs = fp8.quantize_rows(x)
    want = F.linear(fp8.dequantize_rows(xq, xs), fp8.dequantize_rows(wq, ws)) + bias
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the product and the bias add rounded to 8 bits
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)
    assert fp8.fp8_linear(x[:0], wq, ws).shape == (0, 48)  # a step without rows for it
    assert fp8.fp8_linear(x.view(7, 1, 96), wq, ws).shape == (7, 1, 48)


def test_the_scaled_gemm_is_within_e4m3s_rounding_of_the_dense_product():
    """|xq wq - x w| <= (2u + u^2) |x| |w| per element (each operand within u of itself, relative), plus the
    subnormals' absolute share and float32's summation."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(16, 128, generator=g) * 3, torch.randn(64, 128, generator=g) / math.sqrt(128)
    wq, ws = fp8.quantize_weight(w)
    _, xs = fp8.quantize_rows(x)
    err = (fp8.fp8_linear(x, wq, ws) - F.linear(x, w)).abs()
    subnormals = SUBNORMAL * 2 * (xs * w.abs().sum(-1) + x.abs().sum(-1, keepdim=True) * ws)
    bound = (2 * U + U * U) * (x.abs() @ w.abs().T) + subnormals + 1e-5
    assert bool((err <= bound).all())
    assert err.norm() / F.linear(x, w).norm() < 0.06  # typical: about half of 2u, the errors' signs mixed


# ---- the plan -------------------------------------------------------------------------------------------

def test_fp8_weights_need_a_gpu_with_fp8_tensor_cores(tiny_llama_gguf):
    config = load_checkpoint(tiny_llama_gguf, "bf16").config
    cuda = torch.device("cuda")
    for capability in ((7, 0), (8, 0), (8, 6)):  # Volta, A100, Ampere consumer: no FP8
        with pytest.raises(ConfigError, match="compute capability 8.9"):
            backend.check_fp8_weights(cuda, torch.bfloat16, config, capability=capability)
    for capability in ((8, 9), (9, 0), (10, 0)):  # Ada, Hopper, Blackwell
        backend.check_fp8_weights(cuda, torch.bfloat16, config, capability=capability)
    with pytest.raises(ConfigError, match="multiples of 16"):
        backend.check_fp8_weights(cuda, torch.bfloat16, replace(config, intermediate_size=120), capability=(9, 0))
    with pytest.raises(ConfigError, match="bfloat16 or float32"):
        backend.check_fp8_weights(torch.device("cpu"), torch.float16)
    backend.check_fp8_weights(torch.device("cpu"), torch.float32)  # the CPU runs it (to check the path)


def test_fp8_keeps_the_steps_off_the_fused_decoder(tiny_llama_gguf):
    ck = load_checkpoint(tiny_llama_gguf, "fp8")
    for settings in (dict(weights="fp8"), dict(kv_cache_dtype="fp8")):
        the_plan = plan_for(ck, torch.bfloat16, **settings)
        assert the_plan.path != "cpu-fused"
        assert the_plan.fp8_weights == ("weights" in settings) and the_plan.kv_fp8 == ("kv_cache_dtype" in settings)
    assert not plan_for(ck, torch.bfloat16).fp8_weights


def test_bad_settings_are_refused(tiny_llama_gguf):
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(ConfigError, match="weights"):
        EngineConfig(model="m", weights="fp8_e5m2")
    with pytest.raises(ConfigError, match="bfloat16 or float32"):
        LLM(str(tiny_llama_gguf), weights="fp8", dtype="float16")


# ---- models with fp8 projections -------------------------------------------------------------------------

def test_the_loader_and_the_labels_say_fp8(tiny_llama_gguf):
    ck = load_checkpoint(tiny_llama_gguf, "fp8")
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in ck.tensors.values())  # dense
    assert weights_label(ck, False, torch.bfloat16) == "fp8+bfloat16"  # e4m3 projections, bf16 embeddings
    projections = sum(1 for name in ck.tensors if name.endswith("_proj.weight"))
    assert describe_forms(ck.forms) == f"{projections} Q8_0 requantized to fp8, 1 Q8_0 dense"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_with_fp8_projections_follows_the_dense_one(tiny_llama_gguf, dtype):
    ids = list(range(300, 364))
    dense = PagedHarness(load_checkpoint(tiny_llama_gguf, "bf16"))
    want = dense.prefill(ids, dense.new_table(len(ids)))
    h = PagedHarness(load_checkpoint(tiny_llama_gguf, "fp8", dtype), dtype=dtype, weights="fp8")
    model = h.model
    assert all(m.is_fp8 and m.weight.shape[0] == m.weight_scale.shape[0] and m.weight_scale.dtype == torch.float32
               and m.onednn is None for m in _projections(model))
    assert model.embed_tokens.weight.dtype == model.lm_head.dtype == dtype  # not projections: as they were
    assert model.native_decoder is None
    assert _cosines(h.prefill(ids, h.new_table(len(ids))), want).mean() > MEAN_COSINE
    assert _cosines(h.decode_each(ids, h.new_table(len(ids))), want).mean() > MEAN_COSINE


def test_the_bound_fails_where_the_scales_are_wrong(tiny_llama_gguf):
    """The logits bound above is tight enough to see scales a quarter off (a wrong amax, a wrong E4M3_MAX)."""
    ids = list(range(300, 364))
    dense = PagedHarness(load_checkpoint(tiny_llama_gguf, "bf16"))
    want = dense.prefill(ids, dense.new_table(len(ids)))
    h = PagedHarness(load_checkpoint(tiny_llama_gguf, "fp8"), weights="fp8")
    for module in _projections(h.model):
        module.weight_scale.data *= 1.25
    assert _cosines(h.prefill(ids, h.new_table(len(ids))), want).mean() < MEAN_COSINE


@pytest.fixture(scope="module")
def tiny_family_ggufs(tmp_path_factory, smollm2_gguf_path):
    """Float32 GGUFs of a mixture (Qwen3-MoE: its router) and of Qwen2 (QKV biases, an untied LM head)."""
    out = tmp_path_factory.mktemp("fp8-families")
    return {name: write_gguf(tiny_model(name, seed=3), out / f"{name}.gguf", str(smollm2_gguf_path))
            for name in ("qwen3moe", "qwen2")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3moe", "qwen2"])
def test_routers_embeddings_and_the_lm_head_stay_as_they_were(tiny_family_ggufs, family, dtype):
    path = tiny_family_ggufs[family]
    ids = list(range(300, 340))
    dense = PagedHarness(load_checkpoint(path, "bf16"))
    want = dense.prefill(ids, dense.new_table(len(ids)))
    h = PagedHarness(load_checkpoint(path, "fp8", dtype), dtype=dtype, weights="fp8")
    model = h.model
    assert all(m.is_fp8 for m in _projections(model))
    assert not any(m.is_fp8 for m in model.modules() if isinstance(m, Embedding))
    mixtures = [m for m in model.modules() if isinstance(m, SparseMoE)]
    if family == "qwen3moe":
        assert mixtures and all(m.router.dtype == torch.float32 for m in mixtures)
        assert all(e.gate_up_proj.is_fp8 and e.down_proj.is_fp8 for m in mixtures for e in m.experts)
    else:
        assert model.lm_head_weight is not None and model.lm_head_weight.dtype == dtype  # untied
        assert model.layers[0].self_attn.qkv_proj.bias is not None
    bound = MIXTURE_MEAN_COSINE if family == "qwen3moe" else MEAN_COSINE
    assert _cosines(h.prefill(ids, h.new_table(len(ids))), want).mean() > bound


def test_the_engine_generates_with_fp8_weights(tiny_llama_gguf):
    llm = LLM(str(tiny_llama_gguf), weights="fp8", dtype="float32", kv_cache_memory="16MiB", swap_space=0)
    assert llm.engine.weights == "fp8+float32" and llm.engine.plan.fp8_weights
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


# ---- the e4m3 KV cache -----------------------------------------------------------------------------------

def test_an_fp8_cache_is_written_saturated_and_read_in_the_querys_dtype():
    cache = torch.zeros(2, 4, 4, 8, dtype=fp8.DTYPE)
    key = torch.randn(3, 2, 8) * 100
    key[0, 0, 0] = 1e4
    attention.write_kv(cache, cache.clone(), key, key, torch.tensor([1, 6, 13]))
    got = attention._gather(cache, torch.tensor([0, 1, 3]), torch.bfloat16)
    assert got.dtype == torch.bfloat16
    rows = got.view(2, 3, 4, 8)[:, [0, 1, 2], [1, 2, 1]].transpose(0, 1).float()  # slots 1, 6, 13
    want = fp8.to_e4m3(key).float()
    assert torch.equal(rows, want) and float(rows[0, 0, 0]) == fp8.E4M3_MAX
    assert attention.kv_cache_dtype(torch.bfloat16, kv_fp8=True) == fp8.DTYPE
    assert attention.kv_cache_dtype(torch.bfloat16, kv_int8=True) == torch.uint8
    assert attention.kv_cache_dtype(torch.float32) == torch.float32


def test_triton_serves_an_fp8_cache():
    """Its kernels widen what they load (tests/unit/test_triton_attention.py holds them to the reference)."""
    query, cache = torch.zeros(1, 4, 16), torch.zeros(2, 4, 16, 16, dtype=fp8.DTYPE)
    if not attention._triton_installed():
        pytest.skip("Triton is not installed")
    assert attention._triton_serves(query, cache, "triton")
    assert not attention._triton_serves(query, cache, "auto")  # the CPU: torch's code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_over_an_fp8_cache_follows_the_float_cache(tiny_llama_gguf, dtype):
    ck = load_checkpoint(tiny_llama_gguf, "bf16", dtype)
    ids = list(range(300, 364))
    reference = PagedHarness(ck, dtype=dtype)
    want = reference.prefill(ids, reference.new_table(len(ids)))
    h = PagedHarness(ck, dtype=dtype, kv_fp8=True)
    assert all(k.dtype == v.dtype == fp8.DTYPE for k, v in h.runner.kv_caches)
    assert _cosines(h.prefill(ids, h.new_table(len(ids))), want).mean() > MEAN_COSINE
    decoded = h.decode_each(ids, h.new_table(len(ids)))
    assert _cosines(decoded, want).mean() > MEAN_COSINE
    if dtype == torch.float32:  # a prompt attends to its rows as cached, as its decodes and a recompute will
        for sizes in ([64], [40, 24]):
            ours = h.chunked(ids, h.new_table(len(ids)), sizes)
            torch.testing.assert_close(ours, decoded, rtol=1e-4, atol=1e-4)


def test_blocks_of_an_fp8_cache_copy_and_swap(tiny_llama_gguf):
    h = PagedHarness(load_checkpoint(tiny_llama_gguf, "bf16"), kv_fp8=True)
    key = h.runner.kv_slots[0][0]
    key[:, 3] = torch.randn(key[:, 3].shape).to(fp8.DTYPE)
    h.runner.copy_blocks([(3, 5)])
    assert torch.equal(key[:, 5].view(torch.uint8), key[:, 3].view(torch.uint8))
    page = h.runner.read_pages([3])
    h.runner.load([(7, page[0])])
    assert torch.equal(key[:, 7].view(torch.uint8), key[:, 3].view(torch.uint8))


def test_the_engine_generates_over_an_fp8_cache(tiny_llama_gguf):
    llm = LLM(str(tiny_llama_gguf), kv_cache_dtype="fp8", kv_cache_memory="16MiB", swap_space=0)
    engine = llm.engine
    assert all(k.dtype == fp8.DTYPE for k, _ in engine.runner.kv_caches)
    assert engine.kv_bytes_per_token == engine.model_config.kv_bytes_per_token_per_element  # one byte an element
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = "The capital of France is Paris, and the capital of Italy is Rome. " * 3
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(first) == 8
    # Again from the prefix cache: a fresh prompt attended to its rows as cached, so the hit sees the same.
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == first


@pytest.mark.skipif(native is None or not native.fused, reason="the fused decoder's kernels do not run here")
def test_the_fused_decoder_does_not_take_an_fp8_cache(tiny_llama_gguf):
    h = PagedHarness(load_checkpoint(tiny_llama_gguf), dtype=torch.bfloat16)
    decoder = h.model.native_decoder
    assert decoder is not None
    meta = attention.AttentionMetadata(slot_mapping=torch.zeros(1, dtype=torch.int64), num_decode_tokens=1,
                                       decode_block_tables=torch.zeros(1, 1, dtype=torch.int64),
                                       decode_context_lens=torch.ones(1, dtype=torch.int64))
    h_in = torch.zeros(1, h.model.config.hidden_size, dtype=torch.bfloat16)
    caches = [(k.to(fp8.DTYPE), v.to(fp8.DTYPE)) for k, v in h.runner.kv_caches]
    assert decoder.applies(h_in, meta, h.runner.kv_caches) and not decoder.applies(h_in, meta, caches)
