"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral-style configs): pre-norm, SwiGLU, GQA, RoPE."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.models.base import CausalLM
from kvserve.models.layers import GatedMLP, RMSNorm, Rotary, SelfAttention


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: Rotary):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                                       scale=config.head_dim ** -0.5, rotary=rotary,
                                       sliding_window=config.sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, "silu")

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache, meta) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, kv_cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(CausalLM):
    def make_rotary(self) -> Rotary:
        c = self.config
        return Rotary(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling)

    def make_layer(self, index: int) -> nn.Module:
        return LlamaDecoderLayer(self.config, self.rotary)
