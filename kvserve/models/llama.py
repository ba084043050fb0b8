"""The Llama layout (SmolLM2, Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Phi-3/Phi-4-mini, and the mixtures Mixtral
and Qwen3-MoE): pre-norm, SwiGLU, GQA, RoPE; Qwen2 adds a bias to the Q, K and V projections, Qwen3 an RMSNorm
over each head of q and k before RoPE, Phi-4-mini RoPE on part of each head (and Phi-3 LongRoPE: layers.Rotary),
the mixtures a routed MLP of experts in place of the dense one (ModelConfig)."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.models.base import CausalLM
from kvserve.models.layers import GatedMLP, RMSNorm, Rotary, SelfAttention
from kvserve.models.moe import SparseMoE


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                                       scale=config.head_dim ** -0.5, rotary=rotary,
                                       sliding_window=config.layer_window(index), sinks=config.layer_sinks(index),
                                       bias=config.attention_bias,
                                       qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
                                       qk_norm_unit_offset=False)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                             config.experts_per_token, config.norm_topk_prob) if config.is_moe_layer(index) \
            else GatedMLP(config.hidden_size, config.intermediate_size, "silu")

    def norm_roles(self) -> dict[str, RMSNorm]:
        """The norms by their place in the layer (models/native_decoder.py runs the layer from these)."""
        return {"attn_in": self.input_layernorm, "mlp_in": self.post_attention_layernorm}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, kv_cache,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(branch, residual) -> (mlp branch, residual): the stream is residual + branch, and each add is
        fused into the norm that reads it (the last one into the model's final norm)."""
        x, residual = self.input_layernorm.add_forward(x, residual)
        x, residual = self.post_attention_layernorm.add_forward(self.self_attn(x, positions, kv_cache, meta), residual)
        return self.mlp(x), residual


class LlamaForCausalLM(CausalLM):
    def make_rotary(self) -> Rotary:
        c = self.config
        return Rotary(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling, c.rotary_dim)

    def make_layer(self, index: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, index, self.rotary)
