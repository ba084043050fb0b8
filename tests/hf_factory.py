"""Tiny random models of each family from transformers' own config classes, written twice from the same
weights: as a Hugging Face directory (save_pretrained's config.json and model.safetensors, with SmolLM2's
tokenizer) and as a GGUF file the way llama.cpp's converter writes the family (gguf-py's tensor names and
metadata keys; Q and K rows permuted for `llama` only, whose GGUF RoPE is interleaved; Llama 3.1's RoPE
scaling as a `rope_freqs` tensor). Both loading paths then run on identical weights, and transformers'
model is the reference.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from tests.gguf_factory import _copy_tokenizer_fields, permute_rope_rows, write_shape

VOCAB = 49152  # SmolLM2's tokenizer, which every tiny model borrows
# family -> (transformers config class, model class, GGUF architecture, its own config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama", {"rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 10000.0}}),
    "llama3.1": ("LlamaConfig", "LlamaForCausalLM", "llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", "llama", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", {"rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 1_000_000.0},
                                                            "tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", {"rope_parameters": {"rope_type": "default",
                                                                                "rope_theta": 1_000_000.0}}),
    # Mixtures of experts: more experts than a token uses, so a step reads some and not others.
    "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "qwen3moe", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, "num_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "llama", {
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": None}),
}
# Phi-3 (its projections stored fused) and Phi-4-mini's partial rotary with LongRoPE (an original context of 256
# positions in a 512 one: the attention factor is not 1; prompts stay below 256, where the short factors hold).
FAMILIES.update({
    "phi3": ("Phi3Config", "Phi3ForCausalLM", "phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                                       "tie_word_embeddings": False, "sliding_window": None}),
    "phi4mini": ("Phi3Config", "Phi3ForCausalLM", "phi3", {
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 8.0],
                            "original_max_position_embeddings": 256},
        "original_max_position_embeddings": 256, "sliding_window": None}),
})
MOE_FAMILIES = ("qwen3moe", "mixtral")


def tiny_config(family: str, **overrides):
    """transformers' config of a tiny model of the family (2 layers, 4 query heads over 2 kv heads)."""
    import transformers

    config_class, _, _, own = FAMILIES[family]
    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)
    fields.update(own)
    fields.update(overrides)
    return getattr(transformers, config_class)(**fields)


@torch.no_grad()
def tiny_model(family: str, seed: int = 0, **overrides):
    """transformers' model of the family with random weights at scales that keep the logits apart (fan-in
    scaled matrices, norms near 1, small biases), float32, eval."""
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(tiny_config(family, **overrides)).float().eval()
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.5 * torch.randn_like(p))
        elif "embed_tokens" in name:
            p.copy_(0.5 * torch.randn_like(p))
        elif name.endswith("mlp.gate.weight"):
            # A router whose logits lie units apart, so bf16's rounding of the hidden state (about 1%) does not
            # move a token's top k: the bf16 paths then choose the experts float32 chooses.
            p.copy_(8.0 * torch.randn_like(p) / math.sqrt(p.shape[-1]))
        else:
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def write_tokenizer_files(out: Path, tokenizer_gguf: str) -> None:
    """SmolLM2's tokenizer as a Hugging Face directory holds it (tokenizer.json, tokenizer_config.json)."""
    from kvserve.models.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(tokenizer_gguf)
    tok.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": tok.chat_template}))


def write_hf_dir(model, out: Path, tokenizer_gguf: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    write_tokenizer_files(out, tokenizer_gguf)
    return out


def _llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's converter (LlamaModel.generate_extra_tensors): Llama 3.1's scaling as a factor per frequency."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


_EXPERT_STACKS = {"gate": gguf.MODEL_TENSOR.FFN_GATE_EXP, "up": gguf.MODEL_TENSOR.FFN_UP_EXP,
                  "down_proj": gguf.MODEL_TENSOR.FFN_DOWN_EXP}  # _gguf_order's stacks


def _gguf_order(state: dict[str, torch.Tensor]):
    """The state dict with transformers 5's stacked gate_up_proj [E, 2I, H] split into the gate and up stacks
    llama.cpp's converter writes (`...mlp.experts.gate` / `.up`, [E, I, H] each)."""
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            yield name.removesuffix("gate_up_proj") + "gate", gate
            yield name.removesuffix("gate_up_proj") + "up", up
        else:
            yield name, t


def _moe_name(name: str, tensor) -> str:
    """A layer's router or expert stack (`model.layers.{i}.mlp...`) under gguf-py's name for `tensor`."""
    return gguf.TENSOR_NAMES[tensor].format(bid=int(name.split(".")[2])) + ".weight"


def write_gguf(model, path: Path, tokenizer_gguf: str, quant: str = "F32") -> Path:
    """The model as llama.cpp's converter writes its family; `quant`: F32, or a type every matrix is quantized
    to (gguf-py's quantizer: Q8_0, Q4_0, ...; norms and biases stay F32)."""
    from gguf import GGMLQuantizationType as T, quants

    c = model.config
    family = next(f for f, spec in FAMILIES.items() if spec[1] == type(model).__name__)
    arch = FAMILIES[family][2]
    rope = c.rope_parameters
    rotated = int(c.head_dim * rope.get("partial_rotary_factor", 1.0))
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     c.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    vocab = _copy_tokenizer_fields(writer, tokenizer_gguf)
    assert vocab == c.vocab_size
    write_shape(writer, f"tiny-{family}", c.num_hidden_layers, c.max_position_embeddings, c.hidden_size,
                c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, vocab)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", 0)
    if experts:  # llama.cpp's converter: the mixture's keys (Mixtral: a `llama` file with these)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(rotated)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, c.head_dim))
    if rope.get("rope_type") == "longrope":  # llama.cpp's converter (Phi3MiniModel): the factors, their context, scale
        original = rope["original_max_position_embeddings"]
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    qtype = T[quant]
    for name, tensor in _gguf_order(model.state_dict()):
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            w = permute_rope_rows(w, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if name.endswith("mlp.gate.weight"):  # the router: llama-quantize leaves it F32, and so do we
            writer.add_tensor(_moe_name(name, gguf.MODEL_TENSOR.FFN_GATE_INP), np.ascontiguousarray(w))
            continue
        gguf_name = _moe_name(name, _EXPERT_STACKS[name.rsplit(".", 1)[1]]) if ".mlp.experts." in name \
            else names.get_name(name, try_suffixes=(".weight", ".bias"))
        if w.ndim >= 2 and qtype != T.F32:
            writer.add_tensor(gguf_name, quants.quantize(w, qtype),
                              raw_shape=quants.quant_shape_to_byte_shape(w.shape, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
