"""Weights kept quantized: 8-bit and 4-bit values with an fp16 scale and minimum per 32 inputs of a row, 6-bit
values with an fp16 scale per 16, and the K-quant forms, which hold Q4_K's and Q6_K's factors as the file does.

A decode step on a CPU is bound by reading the weights, so the fused decoder's GEMMs read these instead of
bfloat16 (kernels/gemm_quant_layout.h, QWeight): w = scale * q + minimum, q int8 or 0..15. The group is 32
inputs, as GGUF's blocks and the K-quants' sub-blocks, so most of a file's matrices map onto it with the
weights the file holds (`from_gguf`): Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 exactly, Q4_K and Q5_K up to the fp16
rounding of each sub-block's scale and minimum (products of the super-block's fp16 factor and a 6-bit
integer). Where 8-bit activations multiply them (`int8_acts`: only those kernels read these forms), Q4_K and
Q6_K keep their own super-block factors instead (`supers`: the K-quant forms, exact, the file's bytes); Q6_K
elsewhere goes to 8 bits, quantized again. Any other matrix (Q2_K, Q3_K, the IQ types, float files) is
quantized here (`quantize`), which loses accuracy: the setting `weights` (`WEIGHT_MODES`) says which
matrices are kept in which form.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.config import WEIGHT_MODES

GROUP = 32
BITS = (4, 6, 8)
# GGMLQuantizationType values.
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16 = 0, 1, 2, 3, 6, 7, 8, 12, 13, 14, 30
FLOAT_TYPES = (F32, F16, BF16)
# What each GGUF type keeps exactly (4 or 8 bits); the others are quantized again at the bits of `auto`.
EXACT_BITS = {Q4_0: 4, Q4_1: 4, Q4_K: 4, Q8_0: 8, Q5_0: 8, Q5_1: 8, Q5_K: 8}
# Types kept exactly at 6 bits (16 values a scale, no minimum) where that form is allowed, and only there.
SIX_BIT_TYPES = (Q6_K,)
# Types held in a K-quant form (their super-block factors as the file has them) where 8-bit activations
# multiply them: the kernels' code for each is its bits | SUPER (gemm_quant_layout.h).
SUPER_TYPES = (Q4_K, Q6_K)
SUPER = 16
SUPER_BLOCK = 256  # inputs a super-block


def group(bits: int) -> int:
    """Inputs per scale: 16 for the 6-bit form (Q6_K's sub-blocks), else 32."""
    return 16 if bits == 6 else GROUP


@dataclass(frozen=True)
class QuantizedMatrix:
    """A [N, K] weight as values, fp16 scales and fp16 minimums [N, K / group(bits)]. values: int8 [N, K]
    (bits 8; bits 6: -32..31, minimums zero) or uint8 [N, K / 2] of two 0..15 values a byte, element 2j in
    the low nibble (bits 4). With `supers` (a K-quant form: float16 [N, K / 256, 2], each super-block's d and
    -dmin) the scales and minimums are the file's integer sub-block factors (sc, m; held exactly in fp16) and
    w = d * sc * q + (-dmin) * m."""

    bits: int
    values: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    supers: torch.Tensor | None = None

    def __post_init__(self):
        n, groups = self.scales.shape
        k = groups * group(self.bits)
        per_row = k // 2 if self.bits == 4 else k
        if self.bits not in BITS or tuple(self.values.shape) != (n, per_row) or k % GROUP \
                or self.scales.dtype != torch.float16 or self.minimums.shape != self.scales.shape \
                or self.values.dtype != (torch.uint8 if self.bits == 4 else torch.int8):
            raise ValueError(f"inconsistent {self.bits}-bit matrix: values {self.values.dtype} "
                             f"{tuple(self.values.shape)}, scales {tuple(self.scales.shape)}")
        if self.supers is not None and (self.bits == 8 or k % SUPER_BLOCK or self.supers.dtype != torch.float16
                                        or tuple(self.supers.shape) != (n, k // SUPER_BLOCK, 2)):
            raise ValueError(f"inconsistent K-quant form: {self.bits} bits, K {k}, supers "
                             f"{self.supers.dtype} {tuple(self.supers.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * group(self.bits)

    @property
    def kernel_bits(self) -> int:
        """The kernels' code for this form: 4, 6 or 8, or bits | SUPER for a K-quant form."""
        return self.bits | SUPER if self.supers is not None else self.bits

    @property
    def nbytes(self) -> int:
        parts = (self.values, self.scales, self.minimums) + ((self.supers,) if self.supers is not None else ())
        return sum(t.numel() * t.element_size() for t in parts)

    def q(self) -> torch.Tensor:
        """The values as int32 [N, K]."""
        if self.bits != 4:
            return self.values.to(torch.int32)
        v = self.values.to(torch.int32)
        return torch.stack([v & 0x0F, v >> 4], dim=-1).reshape(self.shape)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 scales and minimums [N, groups] as the kernels apply them (a K-quant form's products with
        its super-block factors, exact in fp32)."""
        if self.supers is None:
            return self.scales.float(), self.minimums.float()
        per = SUPER_BLOCK // group(self.bits)
        d, dmin = (self.supers[..., i].float().repeat_interleave(per, dim=1) for i in (0, 1))
        return d * self.scales.float(), dmin * self.minimums.float()

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: scale * q + minimum, the weights the kernels compute with."""
        n, k = self.shape
        size = group(self.bits)
        q = self.q().view(n, k // size, size).float()
        scales, minimums = self.factors()
        w = scales[..., None] * q + minimums[..., None]
        return w.reshape(n, k)

    def plain(self) -> "QuantizedMatrix":
        """The form without super-block factors: each group's scale and minimum rounded to fp16 (for the
        kernels that do not read the K-quant forms)."""
        if self.supers is None:
            return self
        scales, minimums = self.factors()
        return QuantizedMatrix(self.bits, self.values, scales.to(torch.float16), minimums.to(torch.float16))

    def map_rows(self, fn) -> "QuantizedMatrix":
        """The same matrix with its rows rearranged by fn (a function of a tensor whose first dim is rows)."""
        return QuantizedMatrix(self.bits, fn(self.values), fn(self.scales), fn(self.minimums),
                               None if self.supers is None else fn(self.supers))

    def promote(self, bits: int) -> "QuantizedMatrix":
        """At `bits` >= its own: int4 values are int8 values of the same scale and minimum (exact); the 6-bit
        form, whose groups differ, meets another form only quantized again."""
        if bits == self.bits:
            return self
        if bits < self.bits:
            raise ValueError(f"a {self.bits}-bit matrix cannot be promoted to {bits} bits")
        if self.supers is not None:
            return self.plain().promote(bits)
        if self.bits == 4 and bits == 8:
            return QuantizedMatrix(8, self.q().to(torch.int8), self.scales, self.minimums)
        return quantize(self.dequantize(), bits)

    def for_activations(self, int8_acts: bool) -> "QuantizedMatrix":
        """The form the kernels get: the 6-bit and K-quant forms only where 8-bit activations multiply them
        (`int8_acts`); elsewhere the plain form, and 6 bits go to 8 (quantized again)."""
        if int8_acts:
            return self
        plain = self.plain()
        return plain.promote(8) if plain.bits == 6 else plain

    def pack(self, native) -> "PackedPart":
        """Into the packed GEMM's layout (kernels/cpu.py: pack_quant, or pack_quant_super for a K-quant form)."""
        if self.supers is None:
            data = native.pack_quant(self.values, self.scales, self.minimums, self.bits)
        else:
            subs = self.scales.to(torch.int8 if self.bits == 6 else torch.uint8)
            data = native.pack_quant_super(self.values, subs, self.minimums.to(torch.uint8), self.supers,
                                           self.kernel_bits)
        return PackedPart(data, self.kernel_bits, self.shape[0])

    @staticmethod
    def cat(parts: list["QuantizedMatrix"]) -> "QuantizedMatrix":
        """Rows of several matrices (fused projections): in one K-quant form where all share it, else at the
        widest of their bits."""
        if len({p.kernel_bits for p in parts}) == 1 and parts[0].supers is not None:
            return QuantizedMatrix(parts[0].bits, *(torch.cat([getattr(p, f) for p in parts])
                                                    for f in ("values", "scales", "minimums", "supers")))
        bits = max(p.bits for p in parts)
        parts = [p.plain().promote(bits) for p in parts]
        return QuantizedMatrix(bits, torch.cat([p.values for p in parts]), torch.cat([p.scales for p in parts]),
                               torch.cat([p.minimums for p in parts]))


@dataclass(frozen=True)
class PackedPart:
    """Rows of a weight in the packed GEMM's layout (kernels/cpu.py: pack_quant at bits 4 or 8; bits 0:
    pack_weight's bf16)."""

    data: torch.Tensor
    bits: int
    rows: int


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] of 0..15 -> uint8 [N, K / 2], element 2j in the low nibble of byte j."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def quantize(w: torch.Tensor, bits: int) -> QuantizedMatrix:
    """Round a float [N, K] matrix to `bits`: 8 symmetric (scale max|w| / 127, no minimum), 6 symmetric per 16
    (max|w| / 31); 4 asymmetric (scale (max - min) / 15, minimum min), per 32 inputs, the fp16 scale used
    for the rounding."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantize needs K % {GROUP} == 0, got {k}")
    g = w.float().reshape(n, k // group(bits), group(bits))
    if bits in (6, 8):
        top = 127 if bits == 8 else 31
        scale = (g.abs().amax(-1) / top).to(torch.float16)
        minimum = torch.zeros_like(scale)
        s = scale.float()[..., None]
        q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1)), 0).clamp(-top, top)
        return QuantizedMatrix(bits, q.reshape(n, k).to(torch.int8), scale, minimum)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).to(torch.float16)
        minimum = lo.to(torch.float16)
        s = scale.float()[..., None]
        q = torch.where(s > 0, torch.round((g - minimum.float()[..., None]) / torch.where(s > 0, s, 1)), 0)
        return QuantizedMatrix(4, pack_nibbles(q.clamp(0, 15).reshape(n, k)), scale, minimum)
    raise ValueError(f"bits must be 4, 6 or 8, got {bits}")


def weight_bits(qtype: int, mode: str, int8_acts: bool = False) -> int:
    """The bits a matrix stored as GGUF type `qtype` is kept at under the setting `mode` (0: dense).
    auto keeps the file's class: float types dense, 4-bit types at 4 bits, Q6_K at 6 where the 6-bit form
    is allowed (`int8_acts`: the kernels multiply 8-bit activations), every other type at 8 (5- and 6-bit
    types among them: 8 bits hold Q5's values exactly and Q6_K's closer than 4 could). bf16 and fp8 load every
    matrix dense (fp8's projections are converted once the model is built: models/backend.prepare)."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {mode!r}")
    if mode in ("bf16", "fp8"):
        return 0
    if mode == "int8":
        return 8
    if mode == "int4":
        return 4
    if qtype in FLOAT_TYPES:
        return 0
    if int8_acts and qtype in SIX_BIT_TYPES:
        return 6
    return EXACT_BITS.get(qtype, 8)


def is_exact(qtype: int, bits: int) -> bool:
    """Whether `from_gguf` keeps this type at these bits with the file's own weights (else: quantized again)."""
    if bits == 6 or qtype in SIX_BIT_TYPES:
        return bits == 6 and qtype in SIX_BIT_TYPES
    exact = EXACT_BITS.get(qtype)
    return exact is not None and exact <= bits


def from_gguf(raw: np.ndarray, qtype: int, bits: int | None = None, supers: bool = False) -> QuantizedMatrix:
    """A GGUF matrix (raw: uint8 [N, bytes per row] of its blocks) at `bits` (default: the bits its type
    keeps exactly). Where the type holds at those bits (`is_exact`) its values, scales and minimums are
    taken as they are (with `supers`, Q4_K at 4 bits and Q6_K at 6 in their K-quant forms); otherwise the
    matrix is dequantized (gguf's own numpy code) and quantized again."""
    bits = EXACT_BITS.get(qtype, 8) if bits is None else bits
    if supers and qtype in SUPER_TYPES and bits == (6 if qtype in SIX_BIT_TYPES else 4):
        return _super_blocks(raw, qtype)
    if not is_exact(qtype, bits):
        from gguf import GGMLQuantizationType, quants

        n = raw.shape[0]
        w = quants.dequantize(raw, GGMLQuantizationType(qtype)).reshape(n, -1)
        return quantize(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), bits)
    q, scale, minimum = _six_bit_blocks(raw) if bits == 6 else _blocks(raw, qtype)
    n = raw.shape[0]
    q = q.reshape(n, -1)
    # int8 values copied only where they still lie in `raw` (a file's map, closed once loaded): not copied twice
    values = pack_nibbles(torch.from_numpy(q)) if bits == 4 else \
        torch.from_numpy(q.astype(np.int8, copy=q.dtype != np.int8 or np.may_share_memory(q, raw)))
    return QuantizedMatrix(bits, values, torch.from_numpy(scale.reshape(n, -1)),
                           torch.from_numpy(minimum.reshape(n, -1)))


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at bytes [start, start + 2) of each block."""
    return blocks[..., start:start + 2].copy().view(np.float16)[..., 0]


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles first, then high (GGUF's 32-value blocks)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes of a little-endian uint32 -> [..., 32] bits, bit j for value j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes -> the 8 sub-blocks' 6-bit scales and minimums (ggml's get_scale_min_k4)."""
    sc = np.concatenate([scales[..., 0:4] & 63, (scales[..., 8:12] & 0x0F) | ((scales[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([scales[..., 4:8] & 63, (scales[..., 8:12] >> 4) | ((scales[..., 4:8] >> 6) << 4)], -1)
    return sc, m


def _super_blocks(raw: np.ndarray, qtype: int) -> QuantizedMatrix:
    """Q4_K or Q6_K in its K-quant form: the values, the integer sub-block factors and each super-block's d
    and -dmin, as the file holds them."""
    n = raw.shape[0]
    if qtype == Q6_K:
        b = raw.reshape(n, -1, 210)
        q, _, _ = _six_bit_blocks(raw)
        sc = b[..., 192:208].view(np.int8).reshape(n, -1)
        heads = np.stack([_f16(b, 208), np.zeros_like(_f16(b, 208))], axis=-1)
        return QuantizedMatrix(6, torch.from_numpy(q.reshape(n, -1).astype(np.int8)),
                               torch.from_numpy(sc.astype(np.float16)), torch.zeros(sc.shape, dtype=torch.float16),
                               torch.from_numpy(heads))
    b = raw.reshape(n, -1, 144)
    sc, m = _k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(n, -1, 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1)
    heads = np.stack([_f16(b, 0), -_f16(b, 2)], axis=-1)  # d, -dmin (a sign flip: exact)
    return QuantizedMatrix(4, pack_nibbles(torch.from_numpy(q)), torch.from_numpy(sc.reshape(n, -1).astype(np.float16)),
                           torch.from_numpy(m.reshape(n, -1).astype(np.float16)), torch.from_numpy(heads))


def _six_bit_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K (210 B per 256 values: 128 B of low nibbles, 64 B of high 2-bit pairs, 16 int8 sub-block scales,
    d) -> (values -32..31 [N, groups, 16], fp16 scales d * sc and zero minimums [N, groups]), in ggml's
    order (dequantize_row_q6_K: per 128 values, l in 0..31 gives values l, l + 32, l + 64, l + 96)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 210)
    ql = b[..., :128].reshape(n, -1, 2, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    d = _f16(b, 208).astype(np.float32)
    lo = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=3)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
    q = (lo | (hi << 4)).astype(np.int8) - 32  # [n, blocks, 2 halves, 4 quarters, 32]
    scale = (d[..., None] * sc).astype(np.float16)
    return q.reshape(n, -1, 16), scale.reshape(n, -1), np.zeros_like(scale.reshape(n, -1))


def _blocks(raw: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A matrix of one of EXACT_BITS' types -> (values uint8/int [N, groups, 32], fp16 scales and minimums
    [N, groups]): w = scale * q + minimum, q in 0..15 for the 4-bit types."""
    n = raw.shape[0]
    if qtype == Q8_0:  # 34 B: d, 32 int8
        b = raw.reshape(n, -1, 34)
        d = _f16(b, 0)
        return b[..., 2:].view(np.int8), d, np.zeros_like(d)
    if qtype in (Q4_0, Q4_1):  # 18 B: d, 16 B of nibbles (w = d (q - 8)); 20 B: d, m, nibbles (w = d q + m)
        b = raw.reshape(n, -1, 18 if qtype == Q4_0 else 20)
        d = _f16(b, 0)
        if qtype == Q4_1:
            return _nibbles(b[..., 4:]), d, _f16(b, 2)
        return _nibbles(b[..., 2:]), d, (d.astype(np.float32) * -8).astype(np.float16)  # exact: a power of two
    if qtype in (Q5_0, Q5_1):  # 22 B: d, qh, nibbles (w = d (q - 16)); 24 B: d, m, qh, nibbles (w = d q + m)
        b = raw.reshape(n, -1, 22 if qtype == Q5_0 else 24)
        d = _f16(b, 0)
        at = 2 if qtype == Q5_0 else 4
        q = _nibbles(b[..., at + 4:]) | (_high_bits(b[..., at:at + 4]) << 4)
        if qtype == Q5_1:
            return q, d, _f16(b, 2)
        return q.astype(np.int8) - 16, d, np.zeros_like(d)
    if qtype in (Q4_K, Q5_K):
        # 256 values: d, dmin, 12 B of 6-bit scales and minimums; Q5_K then 32 B of high bits; then 128 B of
        # nibbles, 32 B per 64 values (low nibbles the first 32). w = d sc q - dmin m per 32.
        size = 144 if qtype == Q4_K else 176
        b = raw.reshape(n, -1, size)
        d, dmin = _f16(b, 0).astype(np.float32), _f16(b, 2).astype(np.float32)
        sc, m = _k_scales(b[..., 4:16])
        qs = b[..., size - 128:].reshape(n, -1, 4, 32)
        q = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if qtype == Q5_K:
            qh = b[..., 16:48][:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]
            q = q | ((qh & 1) << 4)
        scale = (d[..., None] * sc).astype(np.float16)
        minimum = (-(dmin[..., None] * m)).astype(np.float16)
        return q.reshape(n, -1, 32), scale.reshape(n, -1), minimum.reshape(n, -1)
    raise ValueError(f"GGUF type {qtype} has no exact mapping")
