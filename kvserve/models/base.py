"""A decoder-only causal LM over the paged KV cache; model files supply the decoder layer."""
from __future__ import annotations

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.models.attention import AttentionMetadata
from kvserve.models.backend import TORCH
from kvserve.models.layers import (Embedding, FusedLinear, Linear, QuantizableWeight, RMSNorm, frozen, onednn_linear,
                                   partial_rotary_order,
                                   packed_linear, prepack_onednn)
from kvserve.models.moe import SparseMoE
from kvserve.models.quant import PackedPart, QuantizedMatrix

# HF checkpoint names of the projections that we fuse into one matmul (by the fused module's own name, wherever
# it sits: an attention, a dense MLP, each expert of a mixture).
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def held_bytes(root: nn.Module, seen: set[int]) -> int:
    """Bytes `root` holds in its parameters and its modules' packed and oneDNN copies (`seen`: packed data
    counted already, which tied weights share)."""
    total = sum(p.numel() * p.element_size() for p in root.parameters())
    for module in root.modules():
        for part in getattr(module, "packed", None) or []:
            if id(part.data) not in seen:
                seen.add(id(part.data))
                total += part.data.numel() * part.data.element_size()
        onednn = getattr(module, "onednn", None)
        if onednn is not None:
            total += onednn.numel() * onednn.element_size()
    return total


class CausalLM(nn.Module):
    """Embeddings -> decoder layers -> final norm; logits only for the rows the sampler needs."""

    norm_unit_offset = False
    embedding_scale: float | None = None
    backend = TORCH  # until use_backend
    lora = None  # the adapter slots (models/lora.LoRAWeights attaches itself, to the fused decoder too)

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
        self.lm_head_quant: QuantizedMatrix | None = None  # an untied, quantized LM head until it is packed
        self.lm_head_packed: PackedPart | None = None  # the LM head in the packed GEMM's layout (fp32 logits out)
        self.native_decoder = None  # runs a whole step in one native call where it applies (attach_native_decoder)
        # Vocab-parallel: the whole vocabulary's logits from this rank's rows' (models/parallel.attach), else None.
        self.gather_logits = None

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
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if interjection is not None and interjection.flag.value:
                # Stop here for another step, which runs nested (its own tokens, blocks and metadata; this
                # step's state is h and residual), then go on: at most one interjection per step.
                interjection.run()
                interjection = None
            h, residual = layer(h, residual, positions, kv_cache, meta.for_layer(i))
        return self.norm.add_forward(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [T, vocab]: the packed LM head (quantized, or bf16 for the fused decoder) writes them
        directly, each rounded to bf16 as `F.linear(hidden, lm_head).float()` rounds it. Vocab-parallel, this
        rank's rows' logits are gathered into the whole vocabulary's."""
        logits = self._logits(hidden)
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_packed is not None and hidden.dtype == torch.bfloat16 and hidden.device.type == "cpu":
            return packed_linear([self.lm_head_packed], hidden, self.backend, torch.float32)
        if self.lm_head_onednn is not None:
            return onednn_linear(hidden, self.lm_head_onednn, None).float()
        return torch.nn.functional.linear(hidden, self.lm_head).float()

    def attach_native_decoder(self, native, invariant: bool = False, int8_activations: bool = False) -> bool:
        """Pack the projections for the fused native decoder where it applies (bf16, AMX kernels: see
        models/backend.prepare); before `prepack_onednn` frees the dense weights. Returns whether it attached.
        `invariant`: with the batch-invariant numerics; `int8_activations`: see Plan.activations."""
        from kvserve.models.native_decoder import NativeDecoder

        self.native_decoder = NativeDecoder.build(self, native, invariant, int8_activations)
        return self.native_decoder is not None

    def use_backend(self, backend) -> None:
        """Every layer asks this backend for its path (models/backend.py)."""
        self.backend = backend
        for module in self.modules():
            if module is not self and hasattr(type(module), "backend"):
                module.backend = backend

    def prepack_onednn(self) -> None:
        """Reorder every dense projection (not the fp8 ones: _scaled_mm reads them as they are; and a dense LM
        head the fused decoder does not serve) into oneDNN's layout; the dense copies are freed, except the LM
        head's when it is tied to the embedding table, which lookups still read."""
        for module in self.modules():
            if isinstance(module, (FusedLinear, Linear)) and module.packed is None and not module.is_fp8:
                module.onednn = prepack_onednn(module.weight.data)
                module.weight.data = module.weight.data.new_empty(0)
        if self.lm_head_packed is None:
            self.lm_head_onednn = prepack_onednn(self.lm_head.data)
        if self.lm_head_weight is not None:
            self.lm_head_weight.data = self.lm_head_weight.data.new_empty(0)

    def qkv_row_order(self) -> torch.Tensor | None:
        """Partial rotary: the QKV projection's rows in the order arrange_rotary_dims puts them (row i is the
        loaded row order[i]), else None."""
        c = self.config
        if not c.rotary_dim or c.rotary_dim == c.head_dim:
            return None
        head = partial_rotary_order(c.head_dim, c.rotary_dim)
        rotated_heads = c.num_heads + c.num_kv_heads  # q's and k's; v's rows stay
        return torch.cat([h * c.head_dim + head for h in range(rotated_heads)]
                         + [torch.arange(rotated_heads * c.head_dim, (rotated_heads + c.num_kv_heads) * c.head_dim)])

    def arrange_rotary_dims(self) -> None:
        """Partial rotary: each q and k head's dims in the order the rotary tables rotate them
        (layers.partial_rotary_order), by permuting the QKV projection's rows once at load."""
        order = self.qkv_row_order()
        if order is None:
            return
        for layer in self.layers:
            layer.self_attn.qkv_proj.permute_rows(order)

    # ---- weights -------------------------------------------------------------------------
    def quantized_modules(self) -> list[QuantizableWeight]:
        return [m for m in self.modules() if isinstance(m, QuantizableWeight) and m.quant is not None]

    def pack_quantized(self, native, int8_acts: bool = False) -> None:
        """Every quantized matrix into the packed GEMM's layout, one at a time (each unpacked copy is freed
        as its packed one is made, so loading holds one copy of the weights); a tied LM head shares the
        embedding's. `int8_acts`: 8-bit activations will multiply them, so the 6-bit and K-quant forms stay
        (else: QuantizedMatrix.for_activations)."""
        for module in self.quantized_modules():
            module.pack_(native, int8_acts)
        if self.lm_head_quant is not None:
            self.lm_head_packed = self.lm_head_quant.for_activations(int8_acts).pack(native)
            self.lm_head_quant = None
        elif self.lm_head_weight is None and self.embed_tokens.packed is not None:
            (self.lm_head_packed,) = self.embed_tokens.packed

    def pack_dense_lm_head(self, native) -> None:
        """A dense bf16 LM head on the packed GEMM too (the fused decoder's: fp32 logits, no bf16 copy; bit for
        bit what oneDNN gives), where its vocabulary is a multiple of 16."""
        head = self.lm_head.data
        if self.lm_head_packed is None and head.numel() and head.shape[0] % 16 == 0:
            self.lm_head_packed = PackedPart(native.pack_weight(head), 0, head.shape[0])

    def to_fp8(self) -> None:
        """Every dense projection (attention, MLP, each expert's) as e4m3 with row scales, one at a time (each
        dense copy freed as its e4m3 one is made). The embeddings, the LM head (kept in the model's dtype, as
        vLLM keeps it) and a mixture's float32 router are not projections and stay as they are."""
        for module in self.modules():
            if isinstance(module, (FusedLinear, Linear)):
                module.to_fp8_()

    def dequantize_weights(self, dtype: torch.dtype, device: torch.device) -> None:
        """Every quantized matrix dense again, in `dtype` (where the kernels that read them do not run)."""
        for module in self.quantized_modules():
            module.dequantize_(dtype, device)
        if self.lm_head_quant is not None:
            self.lm_head_weight.data = self.lm_head_quant.dequantize().to(device=device, dtype=dtype)
            self.lm_head_quant = None

    def weight_bytes(self) -> int:
        """Bytes of the weights as held (packed, dense, oneDNN's copies of them, the LM head's)."""
        seen = set()
        total = held_bytes(self, seen)
        for extra in (self.lm_head_onednn, self.lm_head_packed.data if self.lm_head_packed is not None else None):
            if extra is not None and id(extra) not in seen:
                seen.add(id(extra))
                total += extra.numel() * extra.element_size()
        return total

    def token_weight_bytes(self) -> int:
        """Bytes of the weights one token's decode reads: all held, but of a mixture's experts only the k it
        uses (a batch's tokens read more: up to every expert)."""
        total = self.weight_bytes()
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                experts = sum(held_bytes(e, set()) for e in layer.mlp.experts)
                total -= round(experts * (1 - layer.mlp.top_k / len(layer.mlp.experts)))
        return total

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors (q/k/v and gate/up are fused here, with their biases). Missing or unknown names
        raise."""
        params = dict(self.named_parameters())
        pending = dict(tensors)
        loaded: set[str] = set()

        def take(name: str) -> torch.Tensor:
            try:
                return pending.pop(name)
            except KeyError:
                raise KeyError(f"checkpoint has no tensor {name!r}") from None

        for name, module in self.named_modules():
            owner, _, own = name.rpartition(".")
            if not isinstance(module, FusedLinear) or own not in _FUSED:
                continue
            parts = [f"model.{owner}.{p}" for p in _FUSED[own]]
            if f"model.{name}.weight" in pending:  # stored fused (Phi-3's qkv_proj and gate_up_proj, [gate; up])
                parts = [f"model.{name}"]
            biases = None
            if module.bias is not None:  # Qwen2's Q, K and V
                biases = [take(f"{p}.bias") for p in parts]
                loaded.add(f"{name}.bias")
            module.load([take(f"{p}.weight") for p in parts], biases)
            loaded.add(f"{name}.weight")
        self.arrange_rotary_dims()
        if "lm_head.weight" in pending:
            w = pending.pop("lm_head.weight")
            if self.lm_head_weight is not None:
                if isinstance(w, QuantizedMatrix):
                    self.lm_head_quant = w
                    self.lm_head_weight.data = self.lm_head_weight.data.new_empty(0)
                else:
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
            if isinstance(tensor, QuantizedMatrix):
                self.get_submodule(ours.rsplit(".", 1)[0]).set_quant([tensor])
            else:
                param.data = tensor.to(param.dtype)
            loaded.add(ours)
            pending.pop(name)
        missing = [n for n in params if n not in loaded]
        if missing:
            raise KeyError(f"checkpoint is missing tensors: {missing[:8]}{'...' if len(missing) > 8 else ''}")
