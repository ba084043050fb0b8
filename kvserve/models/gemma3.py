"""Gemma 3 text decoder: 5 sliding-window layers to 1 global, QK-norm, pre and post norms, GeGLU,
scaled embeddings, separate RoPE bases for local and global layers."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.models.base import CausalLM
from kvserve.models.layers import GatedMLP, RMSNorm, Rotary, SelfAttention


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, rotary: Rotary):
        super().__init__()
        eps, hidden = config.rms_norm_eps, config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.self_attn = SelfAttention(hidden, config.num_heads, config.num_kv_heads, config.head_dim,
                                       scale=(config.query_pre_attn_scalar or config.head_dim) ** -0.5,
                                       rotary=rotary, sliding_window=config.layer_window(index),
                                       sinks=config.layer_sinks(index), qk_norm_eps=eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)
        self.mlp = GatedMLP(hidden, config.intermediate_size, "gelu_tanh")
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, unit_offset=True)

    def norm_roles(self) -> dict[str, RMSNorm]:
        """The norms by their place in the layer (models/native_decoder.py runs the layer from these)."""
        return {"attn_in": self.input_layernorm, "attn_out": self.post_attention_layernorm,
                "mlp_in": self.pre_feedforward_layernorm, "mlp_out": self.post_feedforward_layernorm}

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, kv_cache,
                meta) -> tuple[torch.Tensor, torch.Tensor]:
        """(branch, residual) -> (post-normed mlp branch, residual), as the Llama layer: each residual add is
        fused into the pre-norm that follows it."""
        x, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.post_attention_layernorm(self.self_attn(x, positions, kv_cache, meta))
        x, residual = self.pre_feedforward_layernorm.add_forward(attn, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(CausalLM):
    norm_unit_offset = True

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.embedding_scale = config.hidden_size ** 0.5

    def make_rotary(self) -> nn.ModuleDict:
        c = self.config
        return nn.ModuleDict({
            "global": Rotary(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling),
            "local": Rotary(c.head_dim, c.max_position_embeddings, c.rope_local_theta or 10000.0),
        })

    def make_layer(self, index: int) -> nn.Module:
        kind = "local" if self.config.is_sliding(index) else "global"
        return Gemma3DecoderLayer(self.config, index, self.rotary[kind])
