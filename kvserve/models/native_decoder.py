"""A step's whole decoder stack as one native call (kernels/decoder_cpu.cpp): on AMX tiles, or on the
vector units of CPUs without AMX (AVX-512 BF16's pair dot products, or AVX2 widening bf16 to fp32).

On the CPU the decode steps are bound by reading the weights and the KV cache, but driven op by op
from Python each small op started with cold caches after the previous op's weight stream, and the
dispatch around ~300 ops per step cost about as much as the memory traffic. `NativeDecoder` packs the
projection weights once into the kernel's tile layout and runs every layer of a step in one call.

Every token is a row, so decode, prefill and mixed steps run the same kernel. A decode (or a short
chunk) attends to its prefix alone, through its sequence's block table, with vector dot products. A
prefill chunk of `tile_min_rows` tokens or more attends on tiles: its visible keys are packed once
per layer and kv head, and 16 query tokens at a time share them in S = Q K^T and O = P V tile
products. That is what makes prefix-cache hits cheap: 64 new tokens over a 576-token prefix read the
prefix once per 16 tokens, not once per token. Without AMX the same packed keys and values are
multiplied with AVX-512 BF16's pair dot products (the vector GEMM's micro kernels). On AVX2 a chunk's
rows attend in groups (with every query head of a kv head, up to 12 query vectors) that share each
key and value row as it is widened to fp32; under the batch-invariant numerics they do so on AVX-512
BF16 and AMX too (up to 16 query vectors, each summed as a decode's: the tiles sum in another order).
Where head_dim % 32 != 0 every row attends alone, and a
step whose row-by-row attention exceeds
`max_attention_keys`, or whose batch is too big for the simple tile loops (`max_tokens`), keeps the
per-op path: SDPA prefill and oneDNN projections.

LoRA adapters' rows (models/lora.py) stay fused: the kernel adds each adapter row's delta after the projection
(kernels/lora_cpu.h), the step's rows grouped by adapter so each adapter's weights are read once per step.

An 8-bit KV cache (kernels/kv_quant.py) is written as each row is quantized; rows attending alone read
its int8 rows as they are, and a tiled chunk's blocks are dequantized once a layer into a copy its
tiles are packed from (`shadow_blocks`).

It serves bfloat16 Llama-layout (Llama, Mistral, Qwen2 with its QKV bias, Qwen3 with its QK norm) and Gemma 3
layers on CPUs with AMX (and a kernel that grants it) or AVX2;
`build` returns None for anything else, and the model keeps its per-op path, which stays the reference:
tests compare the two.
"""
from __future__ import annotations

import ctypes

import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import kv_quant
from kvserve.models import backend
from kvserve.models.attention import AttentionMetadata
from kvserve.models.layers import interleave_gate_up
from kvserve.models.moe import SparseMoE
from kvserve.models.quant import PackedPart

_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# The kernel's phases, in the order of its optional per-phase clocks (enable_profile).
PHASES = ("attention-in RMSNorm (+ residual add)", "QKV GEMM", "QK-norm, rotary, KV-cache write", "attention",
          "O GEMM (+ post-norm)", "MLP-in RMSNorm (+ residual add)", "gate/up GEMM + activation",
          "down GEMM (+ post-norm)", "final RMSNorm")


def _qweight(module, native: cpu_kernels.NativeKernels, keep: list) -> dict:
    """A projection's QWeight fields (kernels/gemm_quant_layout.h): its quantized segments as packed at load
    (gate/up interleaved already), or its dense bf16 weight packed here (gate/up interleaved here)."""
    parts = module.packed
    if parts is None:
        dense = module.weight.data
        parts = [PackedPart(native.pack_weight(interleave_gate_up(dense) if module.gate_up else dense), 0,
                            dense.shape[0])]
        keep.append(parts)
    head, *tail = parts
    fields = {"data": head.data.data_ptr(), "bits": head.bits}
    if tail:
        (rest,) = tail
        fields.update({"tail": rest.data.data_ptr(), "tail_bits": rest.bits, "tail_from": head.rows // 16})
    return fields


def _weight_fields(name: str, module, native: cpu_kernels.NativeKernels, keep: list) -> dict:
    """The QWeight fields as LayerParams embeds them (prefixed by the projection's name)."""
    return {name if k == "data" else f"{name}_{k}": v for k, v in _qweight(module, native, keep).items()}


def _expert_fields(moe: SparseMoE, native: cpu_kernels.NativeKernels, keep: list) -> dict:
    """A mixture's LayerParams fields: its float32 router and an array of E QWeights per projection."""
    arrays = {}
    for role in ("gate_up_proj", "down_proj"):
        array = (cpu_kernels.QWeight * len(moe.experts))(
            *[cpu_kernels.QWeight(**_qweight(getattr(e, role), native, keep)) for e in moe.experts])
        keep.append(array)
        arrays[f"expert_{role.removesuffix('_proj')}"] = ctypes.addressof(array)
    return dict(router=moe.router.data_ptr(), num_experts=len(moe.experts), **arrays)


class NativeDecoder:
    """Packed weights and the per-layer parameter table for `NativeKernels.forward`.

    The table holds addresses taken at attach time (norm weights, rotary tables, packed weights): the
    model is not moved or cast after `CausalLM.attach_native_decoder`, which build_model calls last
    but for the oneDNN reorder (that replaces only the projection weights, packed here already).
    """

    # Rows per step. With prefill attention on tiles, W1's 2048-token prefill steps run faster fused than
    # per op (SDPA and oneDNN, each op dispatched alone over data that left the caches), so they stay fused.
    max_tokens = 4096
    max_attention_keys = 1 << 16  # over rows attending alone: the sum of the keys each attends to
    tile_min_rows = 8  # a chunk this long attends on tiles (below it, packing its keys costs more than it saves)

    def __init__(self, model, native: cpu_kernels.NativeKernels, invariant: bool = False,
                 int8_activations: bool = False):
        self.native = native
        self.invariant = invariant
        self.model = model
        config = model.config
        first = model.layers[0]
        norm = first.norm_roles()["attn_in"]  # `supports` checked that every norm shares eps and convention
        self.params = cpu_kernels.ModelParams(
            num_layers=len(model.layers), hidden=config.hidden_size, q_heads=config.num_heads,
            kv_heads=config.num_kv_heads, head_dim=config.head_dim, intermediate=config.intermediate_size,
            act=_ACTIVATIONS[first.mlp.activation], eps=norm.eps, norm_unit_offset=int(norm.unit_offset),
            final_norm=model.norm.weight.data_ptr(), invariant=int(invariant),
            int8_acts=int(int8_activations), experts_per_token=config.experts_per_token,
            expert_inter=config.moe_intermediate_size, norm_topk=int(config.norm_topk_prob), max_loras=0)
        self._packed = []  # keeps the dense weights' packed copies alive; the table holds their addresses
        self._layers = cpu_kernels.LayerParams * len(model.layers)
        self._static = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            roles = layer.norm_roles()
            fields = _expert_fields(mlp, native, self._packed) if isinstance(mlp, SparseMoE) else {}
            dense = (("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)) if not fields else ()
            for name, module in (("qkv", attn.qkv_proj), ("o", attn.o_proj), *dense):
                fields.update(_weight_fields(name, module, native, self._packed))
            for role in ("attn_in", "attn_out", "mlp_in", "mlp_out"):
                fields[f"{role}_norm"] = roles[role].weight.data_ptr() if role in roles else None
            for name in ("q_norm", "k_norm"):
                norm = getattr(attn, name)
                fields[name] = norm.weight.data_ptr() if norm is not None else None
            fields.update(cos=attn.rotary.cos.data_ptr(), sin=attn.rotary.sin.data_ptr(),
                          window=attn.sliding_window or 0, scale=attn.scale,
                          qkv_bias=attn.qkv_proj.bias.data_ptr() if attn.qkv_proj.bias is not None else None)
            self._static.append(fields)
        self.tile_attention = native.tile_attention and config.head_dim % 32 == 0
        if invariant:
            # Batch-invariant numerics: the kernels attend a prefill chunk's rows in row groups, each query
            # summed as a decode's (the packed-key tiles are off), or alone; and every step stays fused,
            # whatever its attention costs (the per-op path rounds otherwise).
            self.max_attention_keys = self.max_tokens ** 2
        if not native.amx:
            # Rows attending alone (decodes, short chunks) stay fused however many keys they read: on these
            # CPUs the per-op path is no faster at attention and its bf16 projections are slower.
            self.max_attention_keys = self.max_tokens ** 2
        self._rotaries = list({id(layer.self_attn.rotary): layer.self_attn.rotary for layer in model.layers}.values())
        self._table_key = None
        self._table = None
        self.lora = None  # the model's LoRA slots, once attached (attach_lora)

    def attach_lora(self, lora) -> None:
        """Read LoRA adapters' slots (models/lora.LoRAWeights, which calls this) in every step that has adapter
        rows: each adapted projection's A, B^T and parts' rows, by address (allocated once; loads copy into them)."""
        for layer, fields in zip(self.model.layers, self._static):
            for name in ("qkv", "o", "gate_up", "down"):
                module = getattr(layer.self_attn if name in ("qkv", "o") else layer.mlp, f"{name}_proj", None)
                slots = getattr(module, "lora", None)
                if slots is None:
                    continue
                if slots.a.dtype != torch.bfloat16 or slots.a.device.type != "cpu":
                    raise ValueError(f"{slots.path}: the fused decoder reads bf16 LoRA slots on the CPU")
                ends = slots.part_end + [0] * (3 - len(slots.part_end))
                fields[f"lora_{name}"] = cpu_kernels.LoraModule(
                    a=slots.a.data_ptr(), bt=slots.bt.data_ptr(), part_rows=slots.part_rows.data_ptr(),
                    capacity=slots.capacity, parts=len(slots.part_end), part_end=(ctypes.c_int64 * 3)(*ends),
                    interleaved=int(name == "gate_up" and module.interleaved))
        self.params.max_loras = lora.max_loras
        self.lora = lora
        self._table_key = None  # rebuilt with the slots' addresses

    def enable_profile(self) -> torch.Tensor:
        """Seconds spent in each of PHASES, accumulated by the kernel from now on (benchmarks/profile.py)."""
        self.phase_seconds = torch.zeros(len(PHASES), dtype=torch.float64)
        self.params.phase_seconds = self.phase_seconds.data_ptr()
        return self.phase_seconds

    @classmethod
    def build(cls, model, native: cpu_kernels.NativeKernels | None,
              invariant: bool = False, int8_activations: bool = False) -> "NativeDecoder | None":
        """The fused decoder for this model on these kernels, or None where it does not apply (see the
        module docstring). `invariant`: the batch-invariant numerics (engine setting `numerics`);
        `int8_activations`: quantized matrices multiply 8-bit activations (Plan.activations)."""
        if native is None or not native.fused or not cls.supports(model):
            return None
        return cls(model, native, invariant, int8_activations)

    @classmethod
    def supports(cls, model) -> bool:
        c = model.config
        routers = {id(layer.mlp.router) for layer in model.layers if isinstance(layer.mlp, SparseMoE)}  # float32
        params = [p for p in model.parameters() if id(p) not in routers]
        if not params or any(p.device.type != "cpu" or p.dtype != torch.bfloat16 for p in params):
            return False
        if not backend.fused_shapes_fit(c):
            return False
        norms: set[tuple[float, bool]] = {(model.norm.eps, model.norm.unit_offset)}
        for layer in model.layers:
            if not hasattr(layer, "norm_roles"):
                return False
            attn, mlp = layer.self_attn, layer.mlp
            mlps = mlp.experts if isinstance(mlp, SparseMoE) else [mlp]
            projections = (attn.qkv_proj, attn.o_proj, *(p for e in mlps for p in (e.gate_up_proj, e.down_proj)))
            if attn.o_proj.bias is not None or mlp.activation not in _ACTIVATIONS \
                    or any(p.packed is None and p.weight.numel() == 0 for p in projections) \
                    or any(p.packed is not None and (len(p.packed) > 2 or p.gate_up and not p.interleaved)
                           for p in projections):
                return False  # only QKV's bias is fused; dense weights must still be here to pack
            if attn.rotary.cos.dtype != torch.float32 or attn.sinks:
                return False  # (the kernels attend to a window without sinks)
            found = [*layer.norm_roles().values(), *(n for n in (attn.q_norm, attn.k_norm) if n is not None)]
            norms |= {(n.eps, n.unit_offset) for n in found}
        return len(norms) == 1  # the kernel takes one eps and one weight convention

    def applies(self, h: torch.Tensor, meta: AttentionMetadata, kv_caches) -> bool:
        """Whether the kernel serves this step (see the module docstring) on contiguous bf16 or 8-bit caches. It
        takes small decode batches too, where a checkpoint's 4-bit weights would otherwise serve them:
        a decode step of SmolLM2 runs faster fused than per op on the 4-bit weights, as per op it pays a
        dispatch and cold caches for every small operation of every layer."""
        m = h.shape[0]
        if m == 0 or m > self.max_tokens:
            return False
        alone = [c for c in meta.prefills if not self._tiled(c)]
        if alone and sum(c.query_len * c.context_len - c.query_len * (c.query_len - 1) // 2
                         for c in alone) > self.max_attention_keys:
            return False
        key_cache = kv_caches[0][0]
        return (key_cache.dtype in (torch.bfloat16, torch.uint8) and key_cache.is_contiguous()
                and key_cache.device.type == "cpu")

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        for rotary in self._rotaries:  # the kernel indexes the cos/sin tables unchecked
            rotary.check_positions(positions, meta.cache)
        layer_table = self._layer_table(kv_caches, meta.layer_groups)  # first: it reads the cache's form (kv_int8)
        groups = meta.groups or [meta]
        tile_chunks = None
        if meta.prefills:
            tables, lens = self._token_tables(groups), positions + 1
            tiled = [(c.query_start, c.query_len) for c in meta.prefills if self._tiled(c)]
            tile_chunks = torch.tensor(tiled, dtype=torch.int64) if tiled else None
        else:
            tables, lens = torch.stack([g.decode_block_tables for g in groups]), meta.decode_context_lens
        slots = torch.stack([g.slot_mapping for g in groups]) if meta.groups else meta.slot_mapping
        h = h.contiguous()
        extra = {}  # the 8-bit cache's shadow blocks, the LoRA rows
        if self.params.kv_int8 and tile_chunks is not None:
            # The blocks the tile chunks read in any group, once each (dequantized once a layer); their rows of
            # the shadow tables index that list (other rows' entries are never read).
            blocks = torch.unique(torch.cat([tables[g, s] for g in range(len(groups)) for s, _ in tiled]))
            extra = {"shadow_blocks": blocks, "shadow_tables": torch.searchsorted(blocks, tables)}
        args = (self.params, layer_table, h, positions, slots, tables, lens, tile_chunks)
        if self.lora is not None and self.lora.step is not None:
            extra["lora_slots"] = self.lora.step.token_slots
        interjection = meta.interjection
        if interjection is None:
            self.native.forward(*args, **extra)
            return h
        # Suspendable: the residual stream and the last branch live in `state` between the calls. Once
        # stopped, the rest runs without the flag: one interjection per step at most.
        state = torch.empty((2, *h.shape), dtype=h.dtype)
        layer = self.native.forward(*args, state=state, stop=interjection.flag, **extra)
        if layer < self.params.num_layers:
            interjection.run()
            self.native.forward(*args, first_layer=layer, state=state, **extra)
        return h

    def _tiled(self, chunk) -> bool:
        # An 8-bit cache's row groups read a dequantized copy, where a row alone reads the int8 rows: under the
        # batch-invariant numerics its rows attend alone.
        return (self.tile_attention and chunk.query_len >= self.tile_min_rows
                and not (self.invariant and self.params.kv_int8))

    @staticmethod
    def _token_tables(groups: list[AttentionMetadata]) -> torch.Tensor:
        """Each token's row of its sequence's block table in each KV group: [G, T, width] int64 (decodes
        first, then chunks)."""
        first = groups[0]
        width = max([len(c.block_table) for g in groups for c in g.prefills]
                    + ([first.decode_block_tables.shape[1]] if first.num_decode_tokens else []))
        out = []
        for meta in groups:
            rows = []
            if meta.num_decode_tokens:
                tables = meta.decode_block_tables
                rows.append(torch.nn.functional.pad(tables, (0, width - tables.shape[1])))
            for chunk in meta.prefills:
                table = torch.nn.functional.pad(chunk.block_table, (0, width - len(chunk.block_table)))
                rows.append(table.expand(chunk.query_len, width))
            out.append(torch.cat(rows))
        return torch.stack(out)

    def _layer_table(self, kv_caches, layer_groups: tuple[int, ...] = ()) -> ctypes.Array:
        """The per-layer table (and the cache geometry), rebuilt only when the caches move (they are
        allocated once per engine) or the layers' KV groups change."""
        key = (tuple((k.data_ptr(), v.data_ptr()) for k, v in kv_caches), layer_groups)
        if key != self._table_key:
            _, self.params.num_blocks, self.params.block_size, _ = kv_caches[0][0].shape
            self.params.kv_int8 = int(kv_quant.is_quantized(kv_caches[0][0]))
            groups = layer_groups or (0,) * len(kv_caches)
            self._table = self._layers(*[
                cpu_kernels.LayerParams(key_cache=k, value_cache=v, kv_group=g, **fields)
                for fields, (k, v), g in zip(self._static, key[0], groups)])
            self._table_key = key
        return self._table
