"""Each Llama-layout family (Llama, Llama 3.1's RoPE scaling, Mistral, Qwen2 with its QKV bias, Qwen3 with its
QK norm) from a tiny random model of transformers' own classes, written as a safetensors directory and as a
GGUF file (tests/hf_factory.py): both load to the same config and logits, which are transformers' in float32
(through the paged cache: whole prefills, token by token, mixed steps; 64 greedy tokens through the engine),
and the fused bf16 decoder stays within bf16's distance of them."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels
from kvserve.models.loader import load_checkpoint
from kvserve.models.model_info import read_model_info
from tests.hf_factory import FAMILIES, MOE_FAMILIES, tiny_model, write_gguf, write_hf_dir
from tests.parity import PagedHarness, reference_logits, rel_err

TOL = 1e-4  # the tiny parity tests' (test_model_parity_tiny.py)
native = cpu_kernels.load()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory, smollm2_gguf_path):
    """(name, transformers' model, its safetensors directory, its F32 GGUF, its Q8_0 GGUF)."""
    name = request.param
    model = tiny_model(name, seed=len(name))
    out = tmp_path_factory.mktemp(f"family-{name}")
    hf_dir = write_hf_dir(model, out / "hf", str(smollm2_gguf_path))
    gguf32 = write_gguf(model, out / f"{name}.f32.gguf", str(smollm2_gguf_path))
    gguf8 = write_gguf(model, out / f"{name}.q8_0.gguf", str(smollm2_gguf_path), quant="Q8_0")
    return name, model, hf_dir, gguf32, gguf8


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def test_both_files_read_as_the_family(family):
    name, model, hf_dir, gguf32, _ = family
    hf, gg = load_checkpoint(hf_dir).config, load_checkpoint(gguf32).config
    assert hf.architecture == gg.architecture == FAMILIES[name][2]
    assert hf.attention_bias == gg.attention_bias == (name == "qwen2")
    assert hf.qk_norm == gg.qk_norm == name.startswith("qwen3")
    assert hf.num_experts == gg.num_experts == (0 if name not in MOE_FAMILIES else 8 if name == "qwen3moe" else 4)
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size",
                  "tie_word_embeddings", "sliding_window", "rms_norm_eps", "experts_per_token",
                  "moe_intermediate_size", "norm_topk_prob", "dense_layers", "rotary_dim"):
        assert getattr(hf, field) == getattr(gg, field), field
    assert hf.rotary_dim == (12 if name == "phi4mini" else None)
    assert hf.rope_theta == gg.rope_theta == model.config.rope_parameters["rope_theta"]
    assert (hf.rope_scaling or {}).get("rope_type") == {"llama3.1": "llama3", "phi4mini": "longrope"}.get(name)
    assert (gg.rope_scaling or {}).get("rope_type") == {"llama3.1": "factors", "phi4mini": "longrope"}.get(name)
    if name == "phi4mini":  # the same LongRoPE from config.json and from the GGUF's tensors and keys
        for key in ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"):
            assert hf.rope_scaling[key] == pytest.approx(gg.rope_scaling[key], rel=1e-6), key
        assert hf.rope_scaling["attention_factor"] > 1.0
    assert read_model_info(gguf32).config.architecture == gg.architecture  # a gateway reads it without weights


def test_gguf_and_safetensors_give_the_same_logits(family):
    _, _, hf_dir, gguf32, _ = family
    ids = _prompt(80, 1)  # past Llama 3.1's tiny original context (64), where its scaling bends the low frequencies
    a, b = PagedHarness(load_checkpoint(hf_dir)), PagedHarness(load_checkpoint(gguf32))
    assert rel_err(a.prefill(ids, a.new_table(len(ids))), b.prefill(ids, b.new_table(len(ids)))) <= 1e-6


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_float32_logits_are_transformers(family, source):
    _, model, hf_dir, gguf32, _ = family
    h = PagedHarness(load_checkpoint(hf_dir if source == "hf" else gguf32))
    ids = _prompt(80, 2)
    reference = reference_logits(model, ids)
    assert rel_err(h.prefill(ids, h.new_table(len(ids))), reference) <= TOL
    assert rel_err(h.decode_each(ids[:40], h.new_table(40)), reference[:40]) <= TOL
    prompts = [_prompt(n, 10 + n) for n in (23, 9, 31)]
    for ours, p in zip(h.mixed_batch(prompts), prompts):
        assert rel_err(ours, reference_logits(model, p)) <= TOL


def test_greedy_tokens_through_the_engine_are_transformers(family):
    _, model, _, gguf32, _ = family
    prompt = _prompt(24, 3)
    with torch.no_grad():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):]
    llm = LLM(str(gguf32), dtype="float32", kv_cache_memory="64MiB", swap_space=0)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected.tolist()


@pytest.mark.skipif(native is None or not native.fused, reason="the fused decoder needs AMX or AVX2")
@pytest.mark.parametrize("weights", ["bf16", "auto"])
def test_the_fused_bf16_decoder_stays_near_float32(family, weights):
    """Dense bf16 weights, and the Q8_0 file's kept as 8 bits, on the fused decoder: within bf16's distance of
    float32 (the tiny parity tests' bound), decoding token by token as a prefill does."""
    _, model, _, gguf32, gguf8 = family
    ck = load_checkpoint(gguf32 if weights == "bf16" else gguf8, weights)
    h = PagedHarness(ck, dtype=torch.bfloat16)
    assert h.model.native_decoder is not None, "every Llama-layout family runs fused"
    reference = PagedHarness(ck)  # the same weights in float32, op by op
    ids = _prompt(40, 4)
    want = reference.prefill(ids, reference.new_table(len(ids)))
    assert rel_err(h.prefill(ids, h.new_table(len(ids))), want) < 0.1
    assert rel_err(h.decode_each(ids, h.new_table(len(ids))), want) < 0.1


# ---- mixtures of experts ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_family(request, family):
    if family[0] not in MOE_FAMILIES:
        pytest.skip("a dense family")
    return family


def test_moe_routing_chooses_transformers_experts(moe_family):
    """Our float32 router (models/moe.route) on the hidden states transformers' router saw, layer by layer:
    the same experts for every token and the same weights."""
    from kvserve.models.moe import route

    _, model, hf_dir, _, _ = moe_family
    seen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out)))
             for layer in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([_prompt(48, 5)]))
    for h in hooks:
        h.remove()
    ck = load_checkpoint(hf_dir)
    assert len(seen) == ck.config.num_layers
    for i, (gate, hidden, (_, weights, experts)) in enumerate(seen):
        ours_w, ours_e = route(hidden.reshape(-1, hidden.shape[-1]), ck.tensors[f"model.layers.{i}.mlp.gate.weight"],
                               ck.config.experts_per_token, ck.config.norm_topk_prob)
        assert torch.equal(ours_e.sort(-1).values, experts.sort(-1).values)
        assert torch.allclose(ours_w.gather(-1, ours_e.argsort(-1)), weights.gather(-1, experts.argsort(-1)),
                              rtol=1e-5, atol=1e-6)


def test_a_quantized_mixture_loads_dense_as_it_loads_quantized(moe_family):
    """`weights = "bf16"` on a Q8_0 file: every expert of the stacked tensors dequantized, the same matrices the
    kept 8-bit form holds (and the router float32 in both)."""
    _, _, _, _, gguf8 = moe_family
    dense, kept = load_checkpoint(gguf8, "bf16").tensors, load_checkpoint(gguf8, "auto").dense_tensors()
    assert dense.keys() == kept.keys()
    for name, t in kept.items():
        assert torch.equal(dense[name].float(), t), name
    assert all(t.dtype == torch.float32 for n, t in dense.items() if n.endswith("mlp.gate.weight"))


@pytest.mark.skipif(native is None or not native.fused, reason="the fused decoder needs AMX or AVX2")
def test_fused_moe_rows_are_batch_invariant(moe_family):
    """On the fused decoder (batch-invariant numerics) a token's logits are the same bits whichever tokens share
    its step, though those change how many rows each expert's GEMM runs: a prompt in uneven chunks against the
    same tokens decoded one by one, with 8-bit and bf16 experts."""
    _, _, _, gguf32, gguf8 = moe_family
    prompt = _prompt(60, 6)
    for path, weights in ((gguf8, "auto"), (gguf32, "bf16")):
        ck = load_checkpoint(path, weights)
        chunked, alone = PagedHarness(ck, dtype=torch.bfloat16), PagedHarness(ck, dtype=torch.bfloat16)
        assert chunked.model.native_decoder is not None
        a = chunked.chunked(prompt, chunked.new_table(60), [17, 30, 13])
        b = alone.decode_each(prompt, alone.new_table(60))
        assert torch.equal(a, b)


def test_qwen3_moe_dense_layers_from_the_config(tmp_path, smollm2_gguf_path):
    """Qwen3-MoE's mlp_only_layers keep a dense MLP: read from config.json, built so, and transformers' logits."""
    model = tiny_model("qwen3moe", seed=11, num_hidden_layers=3, mlp_only_layers=[1])
    ck = load_checkpoint(write_hf_dir(model, tmp_path / "hf", str(smollm2_gguf_path)))
    assert ck.config.dense_layers == (1,)
    assert [ck.config.is_moe_layer(i) for i in range(3)] == [True, False, True]
    h = PagedHarness(ck)
    ids = _prompt(40, 7)
    assert rel_err(h.prefill(ids, h.new_table(len(ids))), reference_logits(model, ids)) <= TOL


# ---- Phi-3 / Phi-4-mini: partial rotary and LongRoPE ------------------------------------------------------

def test_longrope_tables_are_transformers_on_both_sides_of_the_original_context():
    """Our rotary table (positions below the original context: short factors; from it on: long factors; cos
    and sin of the rotated dims scaled) against transformers' Phi-3 rotary embedding at those positions, its
    rotated dims at their columns (layers.partial_rotary_order) and the passed-through columns cos 1, sin 0."""
    import transformers

    from kvserve.models.layers import Rotary
    from kvserve.models.model_info import config_from_hf

    hf_config = tiny_model("phi4mini").config
    ours = config_from_hf({**hf_config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    rotary = Rotary(ours.head_dim, ours.max_position_embeddings, ours.rope_theta, ours.rope_scaling, ours.rotary_dim)
    reference = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(hf_config)
    r, half = ours.rotary_dim // 2, ours.head_dim // 2
    for positions in (torch.arange(0, 200), torch.arange(256, 500)):  # short, then long (as a longer sequence's)
        cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions[None])
        for table, want in ((rotary.cos, cos[0]), (rotary.sin, sin[0])):
            rows = table[positions]
            torch.testing.assert_close(rows[:, :r], want[:, :r], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(rows[:, half:half + r], want[:, r:2 * r], rtol=1e-5, atol=1e-6)
        assert torch.all(rotary.cos[positions][:, r:half] == 1) and torch.all(rotary.sin[positions][:, r:half] == 0)
