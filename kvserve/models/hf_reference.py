"""transformers' own model for one of our checkpoints, with identical weights.

The numerical reference of the parity tests and the static-batching baseline of the benchmarks.
transformers is a test/bench dependency only, imported when this is called.
"""
from __future__ import annotations

import torch

from kvserve.models.loader import Checkpoint


# Our Llama-layout architectures (models/model_info.LLAMA_LAYOUT): transformers' config and model classes.
LLAMA_FAMILY = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "qwen3moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                "phi3": ("Phi3Config", "Phi3ForCausalLM")}
MIXTRAL = ("MixtralConfig", "MixtralForCausalLM")  # a `llama` checkpoint with experts


def _moe_fields(c) -> dict:
    if not c.num_experts:
        return {}
    if c.architecture == "qwen3moe":
        return dict(num_experts=c.num_experts, num_experts_per_tok=c.experts_per_token,
                    moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                    mlp_only_layers=list(c.dense_layers))
    return dict(num_local_experts=c.num_experts, num_experts_per_tok=c.experts_per_token,
                intermediate_size=c.moe_intermediate_size)


def stacked_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Our per-expert names -> transformers 5's stacked parameters (`mlp.experts.gate_up_proj` [E, 2I, H],
    `mlp.experts.down_proj` [E, H, I]), which its mixtures hold."""
    out = {n: t for n, t in tensors.items() if ".mlp.experts." not in n}
    layers = {n.split(".mlp.experts.")[0] for n in tensors if ".mlp.experts." in n}
    for layer in layers:
        e = f"{layer}.mlp.experts"
        out[f"{e}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{e}.{i}.gate_proj.weight"],
                                                           tensors[f"{e}.{i}.up_proj.weight"]]) for i in range(num_experts)])
        out[f"{e}.down_proj"] = torch.stack([tensors[f"{e}.{i}.down_proj.weight"] for i in range(num_experts)])
    return out


def hf_model_from_checkpoint(ck: Checkpoint, dtype: torch.dtype = torch.float32, attn: str | None = None):
    c = ck.config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                  num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                  max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings)
    if c.architecture in LLAMA_FAMILY:
        import transformers

        names = MIXTRAL if c.architecture == "llama" and c.num_experts else LLAMA_FAMILY[c.architecture]
        config_class, model_class = (getattr(transformers, n) for n in names)
        rope = {"rope_type": "default", **{k: list(v) if isinstance(v, tuple) else v
                                           for k, v in (c.rope_scaling or {}).items()}, "rope_theta": c.rope_theta}
        extra = {"attention_bias": c.attention_bias} if c.architecture not in ("qwen2", "phi3") \
            and names != MIXTRAL else {}
        if c.architecture == "phi3":
            rope["partial_rotary_factor"] = (c.rotary_dim or c.head_dim) / c.head_dim
            extra = {"sliding_window": c.sliding_window, "original_max_position_embeddings": rope.get(
                "original_max_position_embeddings", c.max_position_embeddings)}
        model = model_class(config_class(rope_parameters=rope, **extra, **{**common, **_moe_fields(c)}))
    elif c.architecture == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        model = Gemma3ForCausalLM(Gemma3TextConfig(
            sliding_window=c.sliding_window, query_pre_attn_scalar=int(c.query_pre_attn_scalar),
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                             "sliding_attention": {"rope_type": "default", "rope_theta": c.rope_local_theta}},
            layer_types=["sliding_attention" if c.is_sliding(i) else "full_attention" for i in range(c.num_layers)],
            **common))
    else:
        raise ValueError(f"no transformers class for architecture {c.architecture!r}")
    if attn is not None:
        model.config._attn_implementation = attn
    result = model.load_state_dict(stacked_experts(ck.dense_tensors(), c.num_experts), strict=False)
    if result.unexpected_keys or set(result.missing_keys) - {"lm_head.weight"}:
        raise RuntimeError(f"weights do not match transformers' model: {result}")
    if c.tie_word_embeddings:
        model.tie_weights()
    model.generation_config.eos_token_id = None  # generate exactly the asked-for tokens
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval()
