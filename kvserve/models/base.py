"""A decoder-only causal LM over the paged KV cache; model files supply the decoder layer."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.models.attention import AttentionMetadata
from kvserve.models.layers import Embedding, FusedLinear, Linear, RMSNorm, frozen, onednn_linear, prepack_onednn

# HF checkpoint names of the projections that we fuse into one matmul.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class CausalLM(nn.Module):
    """Embeddings -> decoder layers -> final norm; logits only for the rows the sampler needs."""

    norm_unit_offset = False
    embedding_scale: float | None = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary = self.make_rotary()
        self.layers = nn.ModuleList([self.make_layer(i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, unit_offset=self.norm_unit_offset)
        self.lm_head_weight = None if config.tie_word_embeddings else frozen(
            torch.empty(config.vocab_size, config.hidden_size))
        self.lm_head_onednn = None  # the LM head in oneDNN's blocked layout (prepack_onednn)
        self.native_decoder = None  # runs a whole step in one native call where it applies (attach_native_decoder)

    def make_rotary(self) -> nn.Module:
        """Rotary tables shared by the layers (buffers, built once)."""
        raise NotImplementedError

    def make_layer(self, index: int) -> nn.Module:
        raise NotImplementedError

    @property
    def lm_head(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head_weight is None else self.lm_head_weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """Flattened tokens of many sequences -> final hidden states [T, hidden]."""
        h = self.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            h = h * torch.tensor(self.embedding_scale, dtype=h.dtype)
        if self.native_decoder is not None and self.native_decoder.applies(h, meta, kv_caches):
            return self.native_decoder(h, positions, kv_caches, meta)
        residual = None  # the residual stream; each layer hands back its last branch unadded (see layers)
        interjection = meta.interjection
        for layer, kv_cache in zip(self.layers, kv_caches):
            if interjection is not None and interjection.flag.value:
                # Stop here for another step, which runs nested (its own tokens, blocks and metadata; this
                # step's state is h and residual), then go on: at most one interjection per step.
                interjection.run()
                interjection = None
            h, residual = layer(h, residual, positions, kv_cache, meta)
        return self.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.native_decoder is not None:
            logits = self.native_decoder.compute_logits(hidden)
            if logits is not None:
                return logits
        if self.lm_head_onednn is not None:
            return onednn_linear(hidden, self.lm_head_onednn, None).float()
        return torch.nn.functional.linear(hidden, self.lm_head).float()

    def attach_native_decoder(self, native) -> bool:
        """Pack the projections for the fused native decoder where it applies (bf16, AMX kernels: see
        models/backend.prepare); before `prepack_onednn` frees the dense weights. Returns whether it attached."""
        from kvserve.models.native_decoder import NativeDecoder

        self.native_decoder = NativeDecoder.build(self, native)
        return self.native_decoder is not None

    def use_backend(self, backend) -> None:
        """Every layer asks this backend for its path (models/backend.py)."""
        self.backend = backend
        for module in self.modules():
            if module is not self and hasattr(type(module), "backend"):
                module.backend = backend

    def prepack_onednn(self) -> None:
        """Reorder every projection (and the LM head) into oneDNN's layout; the dense copies are freed,
        except the LM head's when it is tied to the embedding table, which lookups still read."""
        for module in self.modules():
            if isinstance(module, (FusedLinear, Linear)):
                module.onednn = prepack_onednn(module.weight.data)
                module.weight.data = module.weight.data.new_empty(0)
        if self.native_decoder is None or self.native_decoder.lm_head is None:  # else packed for the tile GEMM
            self.lm_head_onednn = prepack_onednn(self.lm_head.data)
        if self.lm_head_weight is not None:
            self.lm_head_weight.data = self.lm_head_weight.data.new_empty(0)

    # ---- weights -------------------------------------------------------------------------
    def attach_int4(self, int4: dict, dtype: torch.dtype) -> int:
        """Pack the checkpoint's 4-bit matrices for small-batch decode; returns how many modules got one."""
        from kvserve.models.int4 import Int4Weight, PackedInt4

        count = 0
        for i, layer in enumerate(self.layers):
            prefix = f"model.layers.{i}."
            for module_name, module in layer.named_modules():
                if not isinstance(module, (FusedLinear, Linear)) or module.bias is not None:
                    continue
                parts = _FUSED.get(module_name, (module_name,))
                found = [int4.get(f"{prefix}{p}.weight") for p in parts]
                if all(f is not None for f in found):
                    module.packed = PackedInt4(Int4Weight.cat(found), dtype)
                    count += 1
        return count


    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors (q/k/v and gate/up are fused here). Missing or unknown names raise."""
        params = dict(self.named_parameters())
        pending = dict(tensors)
        loaded: set[str] = set()

        def take(name: str) -> torch.Tensor:
            try:
                return pending.pop(name)
            except KeyError:
                raise KeyError(f"checkpoint has no tensor {name!r}") from None

        for i, layer in enumerate(self.layers):
            for fused, parts in _FUSED.items():
                module = layer.get_submodule(fused)
                module.load([take(f"model.layers.{i}.{p}.weight") for p in parts])
                loaded.add(f"layers.{i}.{fused}.weight")
        if "lm_head.weight" in pending:
            w = pending.pop("lm_head.weight")
            if self.lm_head_weight is not None:
                self.lm_head_weight.data = w.to(self.lm_head_weight.dtype)
                loaded.add("lm_head_weight")
        for name, tensor in list(pending.items()):
            ours = name.removeprefix("model.")
            if ours not in params:
                if "rotary_emb" in name:
                    pending.pop(name)
                    continue
                raise KeyError(f"unexpected tensor {name!r} in checkpoint")
            param = params[ours]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
            param.data = tensor.to(param.dtype)
            loaded.add(ours)
            pending.pop(name)
        missing = [n for n in params if n not in loaded]
        if missing:
            raise KeyError(f"checkpoint is missing tensors: {missing[:8]}{'...' if len(missing) > 8 else ''}")
