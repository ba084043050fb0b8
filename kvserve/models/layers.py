"""Building blocks shared by the model files: norms, rotary embeddings, fused projections."""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import cpu as cpu_kernels
from kvserve.models import fp8
from kvserve.models.backend import TORCH, Backend
from kvserve.models.quant import PackedPart, QuantizedMatrix

if TYPE_CHECKING:
    from kvserve.models.lora import _ModuleSlots


def frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma stores the weight as an offset from 1 (`unit_offset`)."""

    backend: Backend = TORCH

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.weight = frozen(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.backend.native
        if native is not None and self.weight.dtype == x.dtype:
            return native.rms_norm(x, self.weight, self.eps, self.unit_offset)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:  # Gemma: scale in float32, then cast (as the reference does)
            return (h * (1.0 + self.weight.float())).to(dtype)
        return self.weight * h.to(dtype)  # Llama: cast, then scale

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add fused with the norm that follows it
        (one native pass; the sum may be written into `residual`). residual None: (norm(x), x)."""
        if residual is None:
            return self(x), x
        native = self.backend.native
        if native is not None and self.weight.dtype == x.dtype == residual.dtype:
            return native.add_rms_norm(x, residual, self.weight, self.eps, self.unit_offset)
        residual = x + residual
        return self(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None = None, long: bool = False) -> torch.Tensor:
    """The rotated dims' frequencies (head_dim: those dims). LongRoPE's are its short factors', or with `long`
    its long factors' (Rotary splices them by position)."""
    powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / powers
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "longrope":  # (the reference's order of operations, to its last bit)
        return 1.0 / (torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32) * powers)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "factors":  # one per frequency (a GGUF's rope_freqs: Llama 3.1's scaling, computed by its converter)
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    if kind == "llama3":  # Llama 3.1: smooth interpolation between low and high frequencies
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if kind in (None, "default"):
        return inv_freq
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported")


class Rotary(nn.Module):
    """Rotate-half (NeoX layout) rotary embedding with a precomputed cos/sin table [positions, head_dim].

    The table is free per position and column, which serves the variants without another kernel: partial
    rotary (`rotary_dim` < head_dim: the model arranges q's and k's dims so the rotated pairs are (j, j + D/2)
    for j < rotary_dim / 2, `partial_rotary_order`, and the other columns get cos 1, sin 0), and LongRoPE
    (positions below its original context take the short factors' rows, the others the long factors', as the
    reference does for a sequence that grows past it; cos and sin of the rotated dims scaled by its attention
    factor)."""

    backend: Backend = TORCH

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None,
                 rotary_dim: int | None = None):
        super().__init__()
        self.rotated = rotary_dim or head_dim
        self.scaling = scaling
        self.theta = theta
        self.half = head_dim // 2
        self.inv_freq = self._padded(rope_inv_freq(self.rotated, theta, scaling))
        self.max_positions = max_positions
        cos, sin = self._tables(torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _padded(self, inv_freq: torch.Tensor) -> torch.Tensor:
        """Frequency 0 (cos 1, sin 0: passed through) for the columns past the rotated dims."""
        return torch.cat([inv_freq, inv_freq.new_zeros(self.half - inv_freq.shape[0])])

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        scaling = self.scaling or {}
        if scaling.get("rope_type") == "longrope":
            long = torch.outer(positions, self._padded(rope_inv_freq(self.rotated, self.theta, scaling, long=True)))
            freqs = torch.where(positions[:, None] >= scaling["original_max_position_embeddings"], long, freqs)
        emb = torch.cat([freqs, freqs], dim=-1).to(device)
        cos, sin = emb.cos(), emb.sin()
        factor = scaling.get("attention_factor", 1.0) if scaling.get("rope_type") == "longrope" else 1.0
        if factor != 1.0:
            rotated = torch.cat([self.inv_freq != 0] * 2).to(device)
            cos, sin = torch.where(rotated, cos * factor, cos), sin * factor
        return cos, sin

    def _apply(self, fn, recurse=True):
        """Moves follow the model; dtype casts do not: the tables stay float32 (the native kernel reads them
        so, and the torch path casts each lookup, as the reference computes cos/sin in float32 then casts)."""
        super()._apply(fn, recurse)
        if self.cos.dtype != torch.float32:
            self.cos, self.sin = self._tables(self.cos.device)
        return self

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] -> rotated, in the input dtype.

        `cache` (per forward pass) keeps the looked-up cos/sin so the layers share one lookup.
        """
        native = self.backend.native
        if native is not None and k.dtype == q.dtype:
            self.check_positions(positions, cache)
            return (native.rotary_(q, positions, self.cos, self.sin),
                    native.rotary_(k, positions, self.cos, self.sin))
        key = ("rotary", id(self))
        found = cache.get(key) if cache is not None else None
        if found is None:
            found = (self.cos.index_select(0, positions)[:, None, :].to(q.dtype),
                     self.sin.index_select(0, positions)[:, None, :].to(q.dtype))
            if cache is not None:
                cache[key] = found
        cos, sin = found
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def check_positions(self, positions: torch.Tensor, cache: dict | None) -> None:
        """The native kernels index the fp32 tables unchecked: check once per forward pass (`cache`)."""
        if cache is None or ("rotary_checked", id(self)) not in cache:
            if positions.numel() and int(positions.max()) >= self.cos.shape[0]:
                raise IndexError(f"position {int(positions.max())} beyond the rotary table ({self.cos.shape[0]})")
            if cache is not None:
                cache[("rotary_checked", id(self))] = True

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : self.half], x[..., self.half:]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """A head's dims in the order Rotary rotates them as a whole head: the rotated dims' pairs (i, i + r/2)
    moved to (j, j + D/2), the passed-through dims filling the rest. q and k are arranged so (the same order
    for both: their dot product is unchanged)."""
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    order = [*range(r), *range(rotary_dim, rotary_dim + rest), *range(r, rotary_dim),
             *range(rotary_dim + rest, head_dim)]
    return torch.tensor(order, dtype=torch.int64)


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows -> 16-row blocks alternating gate, up (the fused kernel's gated epilogue reads pairs)."""
    two_i = t.shape[0]
    return t.reshape(2, two_i // 32, 16, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


class QuantizableWeight(nn.Module):
    """A module whose `weight` [out, in] may be held quantized instead of dense: `quant` (row segments, from
    loading until the backend is chosen), then `packed` in the CPU kernels' layout, or dense again where
    the kernels do not run (models/backend.prepare). A quantized module's dense weight is empty. With
    weights = fp8 a projection's `weight` is e4m3 itself, with its rows' float32 scales in `weight_scale`."""

    weight: nn.Parameter
    backend: Backend = TORCH  # until CausalLM.use_backend: its `invariant` picks the packed GEMM's numerics
    # A row-parallel projection's all-reduce over the tensor-parallel ranks (models/parallel.attach), else None.
    reduce: "Callable[[torch.Tensor], torch.Tensor] | None" = None
    gate_up = False  # rows are [gate; up]: packed with the halves' 16-row blocks interleaved
    # The projection's LoRA slots (models/lora.LoRAWeights attaches them), else None: `linear` adds the step's deltas.
    lora: "_ModuleSlots | None" = None

    def init_quant(self) -> None:
        self.quant: list[QuantizedMatrix] | None = None
        self.packed: list[PackedPart] | None = None
        self.interleaved = False  # packed rows are gate/up blocks alternating (gate_up)
        self.weight_scale: nn.Parameter | None = None  # float32 [out]: an e4m3 weight's row scales (to_fp8_)

    def set_quant(self, parts: list[QuantizedMatrix]) -> None:
        """Hold these quantized row segments (adjacent ones of equal bits merged; gate/up as one)."""
        runs: list[list[QuantizedMatrix]] = []
        for part in parts:
            if runs and runs[-1][0].kernel_bits == part.kernel_bits:
                runs[-1].append(part)
            else:
                runs.append([part])
        # The fused kernel takes a weight in at most two kinds, and the gated epilogue pairs gate and up.
        merged = [QuantizedMatrix.cat(run) for run in runs] if len(runs) <= 2 and not self.gate_up \
            else [QuantizedMatrix.cat(parts)]
        rows = sum(q.shape[0] for q in merged)
        if (rows, merged[0].shape[1]) != tuple(self.weight.shape) and self.weight.numel():
            raise ValueError(f"quantized weight {rows}x{merged[0].shape[1]} != {tuple(self.weight.shape)}")
        self.quant = merged
        self.weight.data = self.weight.data.new_empty(0)

    def dequantize_(self, dtype: torch.dtype, device: torch.device) -> None:
        """Dense again (the kernels that read quantized weights do not run on this path)."""
        if self.quant is not None:
            self.weight.data = torch.cat([q.dequantize() for q in self.quant]).to(device=device, dtype=dtype)
            self.quant = None

    def pack_(self, native: "cpu_kernels.NativeKernels", int8_acts: bool = False) -> None:
        """Into the packed GEMM's layout (gate/up interleaved); the unpacked copy is freed. The 6-bit and
        K-quant forms stay so only where 8-bit activations multiply them (QuantizedMatrix.for_activations)."""
        if self.quant is None:
            return
        parts = [q.for_activations(int8_acts) for q in self.quant]
        if self.gate_up:
            parts = [parts[0].map_rows(interleave_gate_up)]
            self.interleaved = True
        self.packed = [q.pack(native) for q in parts]
        self.quant = None

    def to_fp8_(self) -> None:
        """The dense weight as e4m3 with a float32 scale per output row (models/fp8.py); the dense copy is
        freed. On the fp8 path (Plan.fp8_weights) instead of packing: `linear` multiplies it in _scaled_mm."""
        if self.weight.dtype == fp8.DTYPE or not self.weight.numel():
            return
        q, scale = fp8.quantize_weight(self.weight.data)
        self.weight.data = q
        self.weight_scale = frozen(scale)

    @property
    def is_fp8(self) -> bool:
        return self.weight.dtype == fp8.DTYPE

    @property
    def out_features(self) -> int:
        return sum(p.rows for p in self.packed) if self.packed else self.weight.shape[0]


class FusedLinear(QuantizableWeight):
    """One matmul for several projections that read the same input (QKV, gate+up)."""

    def __init__(self, in_features: int, out_features: list[int], bias: bool = False, gate_up: bool = False):
        super().__init__()
        self.splits = list(out_features)
        self.weight = frozen(torch.empty(sum(out_features), in_features))
        self.bias = frozen(torch.zeros(sum(out_features))) if bias else None
        self.gate_up = gate_up
        self.init_quant()
        self.onednn = None  # the weight in oneDNN's blocked layout (prepack_onednn)

    def load(self, parts: list["torch.Tensor | QuantizedMatrix"], biases: list[torch.Tensor] | None = None) -> None:
        """The projections' weights, fused: quantized when every part is, else dense."""
        if all(isinstance(p, QuantizedMatrix) for p in parts):
            self.set_quant(parts)
        else:
            dense = [p.dequantize() if isinstance(p, QuantizedMatrix) else p for p in parts]
            self.weight.data = torch.cat(dense, dim=0).to(self.weight.dtype).contiguous()
        if biases is not None and self.bias is not None:
            self.bias.data = torch.cat(biases, dim=0).to(self.bias.dtype)

    def permute_rows(self, order: torch.Tensor) -> None:
        """Rearrange the output rows (and bias): row i becomes row order[i]'s. A quantized weight's segments are
        rearranged each within itself (`order` must keep every row in its segment)."""
        if self.quant is not None:
            start, parts = 0, []
            for part in self.quant:
                rows = order[start:start + part.shape[0]] - start
                if rows.numel() and (rows.min() < 0 or rows.max() >= part.shape[0]):
                    raise ValueError("a row permutation across quantized segments")
                parts.append(part.map_rows(lambda t, rows=rows: t[rows]))
                start += part.shape[0]
            self.quant = parts
        else:
            self.weight.data = self.weight.data[order].contiguous()
        if self.bias is not None:
            self.bias.data = self.bias.data[order]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return linear(self, x).split(self.splits, dim=-1)


class Linear(QuantizableWeight):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = frozen(torch.empty(out_features, in_features))
        self.bias = frozen(torch.zeros(out_features)) if bias else None
        self.init_quant()
        self.onednn = None  # the weight in oneDNN's blocked layout (prepack_onednn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self, x)


def packed_linear(parts: list[PackedPart], x: torch.Tensor, backend: Backend,
                  out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [..., K] bf16 times a weight in the packed GEMM's layout (its segments side by side), with the
    backend's arithmetic: batch-invariant numerics (each row's bits whatever the other rows), 8-bit
    activations."""
    native = cpu_kernels.load()
    rows = x.reshape(-1, x.shape[-1])
    outs = [native.linear_quant(rows, p.data, p.bits, p.rows, out_dtype, backend.invariant, backend.int8_activations)
            for p in parts]
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
    return out.view(*x.shape[:-1], out.shape[-1])


def linear(module: "Linear | FusedLinear", x: torch.Tensor) -> torch.Tensor:
    """The packed quantized GEMM, oneDNN's prepacked one, FP8's scaled GEMM (models/fp8.py) or torch's; the
    bias (never quantized) after; then, in a step with LoRA adapters, each adapter's delta on its rows
    (models/lora.py). A row-parallel projection (models/parallel.py: `reduce` set) adds up its ranks' partial
    products first, then its bias once."""
    if module.reduce is not None:  # (LoRAWeights refuses a model with row-parallel projections)
        out = module.reduce(_product(module, x, None))
        return out if module.bias is None else out + module.bias
    out = _product(module, x, module.bias)
    lora = module.lora
    if lora is not None and lora.owner.step is not None:  # adapters in this step: their rows' deltas
        lora.add(x, out)
    return out


def _product(module: "Linear | FusedLinear", x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if module.packed is not None:
        out = packed_linear(module.packed, x, module.backend)
        return out if bias is None else out + bias
    if module.onednn is not None:
        return onednn_linear(x, module.onednn, bias)
    if module.weight_scale is not None:
        return fp8.fp8_linear(x, module.weight, module.weight_scale, bias)
    return F.linear(x, module.weight, bias)


def prepack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [out, in] weight reordered once into oneDNN's blocked layout (an opaque tensor).

    F.linear hands oneDNN a plain-layout weight and it reorders it on every call; with the reorder
    done at load time the projections run markedly faster at the row counts steps have, on AMX cores
    (same results: it is the same kernel). Inductor's CPU freezing pass does the same.
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def onednn_rows(m: int) -> int:
    """Rows a matmul of m rows is run at: exact up to 16, then multiples of 16.

    oneDNN builds (JIT-compiles) a kernel per distinct shape; a serving engine's token counts
    take hundreds of values, so unbucketed it spends its first minutes compiling and can overflow the
    primitive cache. The padded rows are nearly free: at these sizes the matmul is bound by reading
    the weight.
    """
    return m if m <= 16 else (m + 15) // 16 * 16


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    m = x.shape[0]
    padded = onednn_rows(m)
    if padded != m:
        x = torch.cat([x, x.new_zeros(padded - m, x.shape[1])])
    out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")[:m]
    return out.view(*shape[:-1], out.shape[-1])


class SelfAttention(nn.Module):
    """Fused QKV projection (with a bias: Qwen2), optional per-head QK norm (Gemma 3, Qwen3), rotary, paged
    attention, output projection."""

    backend: Backend = TORCH

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 rotary: "Rotary", sliding_window: int | None = None, qk_norm_eps: float | None = None,
                 bias: bool = False, sinks: int = 0, qk_norm_unit_offset: bool = True):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qkv_proj = FusedLinear(hidden, [num_heads * head_dim, num_kv_heads * head_dim,
                                             num_kv_heads * head_dim], bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden)
        self.scale = scale
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.sinks = sinks  # leading tokens attended to beside the window (the sinks + window policy)
        if qk_norm_eps is not None:  # Gemma 3's offset from 1, Qwen3's plain
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=qk_norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=qk_norm_unit_offset)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta) -> torch.Tensor:
        from kvserve.models.attention import paged_attention

        t = x.shape[0]
        qkv = linear(self.qkv_proj, x)
        key_cache, value_cache = kv_cache
        q, k, v = (part.view(t, -1, self.head_dim) for part in qkv.split(self.qkv_proj.splits, dim=-1))
        # The native per-op kernels read contiguous caches in the model's dtype (the fused decoder, 8-bit ones;
        # an fp8 cache goes the torch path).
        native = self.backend.native if key_cache.is_contiguous() and key_cache.dtype == x.dtype else None
        if native is not None and qkv.dtype == key_cache.dtype:
            # QK norm, rotary and the K/V cache writes in one pass over the new tokens.
            self.rotary.check_positions(positions, meta.cache)
            norm = self.q_norm
            native.qk_rope_write_kv(qkv, self.num_heads, self.num_kv_heads, positions, self.rotary.cos,
                                    self.rotary.sin, norm and norm.weight, self.k_norm and self.k_norm.weight,
                                    norm.eps if norm else 0.0, bool(norm and norm.unit_offset), key_cache,
                                    value_cache, meta.slot_mapping)
            written = True
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k, meta.cache)
            written = False
        o = paged_attention(q, k, v, key_cache, value_cache, meta, self.scale, self.sliding_window,
                            kv_written=written, native=native, sinks=self.sinks, kernels=self.backend.attention)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    backend: Backend = TORCH

    def __init__(self, hidden: int, intermediate: int, activation: str):
        super().__init__()
        self.gate_up_proj = FusedLinear(hidden, [intermediate, intermediate], gate_up=True)
        self.down_proj = Linear(intermediate, hidden)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.backend.native
        gate_up = linear(self.gate_up_proj, x)
        if self.gate_up_proj.interleaved:  # packed for the fused kernel: back to [gate; up]
            gate_up = gate_up.view(x.shape[0], -1, 2, 16).transpose(1, 2).reshape(x.shape[0], -1)
        if native is not None:
            return self.down_proj(native.gated_act(gate_up, self.activation))
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "silu":
            gate = F.silu(gate)
        else:
            gate = F.gelu(gate, approximate="tanh")
        return self.down_proj(gate * up)


class Embedding(QuantizableWeight):
    """Token embedding table (left uninitialised until weights load: no wasted init of a large vocab).
    Quantized, its rows are read from the packed layout, which a tied LM head multiplies too (one copy)."""

    # Vocab-parallel (models/parallel.attach): the first token id of this rank's rows; ids outside them look up
    # zeros, and `reduce` adds the ranks' lookups up.
    rows_from: int | None = None

    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.weight = frozen(torch.empty(vocab_size, hidden))
        self.init_quant()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows_from is not None:
            local = ids - self.rows_from
            outside = (local < 0) | (local >= self.weight.shape[0])
            h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside.unsqueeze(-1), 0)
            return self.reduce(h)
        if self.packed is not None:
            (part,) = self.packed
            return cpu_kernels.load().quant_rows(part.data, part.bits, part.rows, ids)
        return F.embedding(ids, self.weight)
