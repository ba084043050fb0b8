"""Weights kept quantized: 8-bit and 4-bit values with an fp16 scale and minimum per 32 inputs of a row.

A decode step on a CPU is bound by reading the weights, so the fused decoder's GEMMs can read these
instead of bfloat16 (kernels/decoder_cpu.cpp, QWeight): w = scale * q + minimum, q int8 or 0..15. The
group is 32 inputs, as GGUF's Q8_0, Q4_0 and Q4_1 blocks, so those map onto it with exactly the weights
the file holds (`from_gguf`); any other matrix is quantized here (`quantize`), which loses accuracy.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # GGMLQuantizationType values mapped exactly
BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedMatrix:
    """A [N, K] weight as values, fp16 scales and fp16 minimums [N, K / 32]. values: int8 [N, K] (bits 8)
    or uint8 [N, K / 2] of two 0..15 values a byte, element 2j in the low nibble (bits 4)."""

    bits: int
    values: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor

    def __post_init__(self):
        n, groups = self.scales.shape
        per_row = groups * GROUP if self.bits == 8 else groups * GROUP // 2
        if self.bits not in BITS or tuple(self.values.shape) != (n, per_row) \
                or self.scales.dtype != torch.float16 or self.minimums.shape != self.scales.shape \
                or self.values.dtype != (torch.int8 if self.bits == 8 else torch.uint8):
            raise ValueError(f"inconsistent {self.bits}-bit matrix: values {self.values.dtype} "
                             f"{tuple(self.values.shape)}, scales {tuple(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * GROUP

    def q(self) -> torch.Tensor:
        """The values as int32 [N, K]."""
        if self.bits == 8:
            return self.values.to(torch.int32)
        v = self.values.to(torch.int32)
        return torch.stack([v & 0x0F, v >> 4], dim=-1).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: scale * q + minimum, the weights the kernels compute with."""
        n, k = self.shape
        q = self.q().view(n, k // GROUP, GROUP).float()
        w = self.scales.float()[..., None] * q + self.minimums.float()[..., None]
        return w.reshape(n, k)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """int [N, K] of 0..15 -> uint8 [N, K / 2], element 2j in the low nibble of byte j."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def quantize(w: torch.Tensor, bits: int) -> QuantizedMatrix:
    """Round a float [N, K] matrix to `bits`: 8 symmetric (scale max|w| / 127, no minimum); 4 asymmetric
    (scale (max - min) / 15, minimum min), per 32 inputs, the fp16 scale used for the rounding."""
    n, k = w.shape
    if k % GROUP:
        raise ValueError(f"quantize needs K % {GROUP} == 0, got {k}")
    g = w.float().reshape(n, k // GROUP, GROUP)
    if bits == 8:
        scale = (g.abs().amax(-1) / 127).to(torch.float16)
        minimum = torch.zeros_like(scale)
        s = scale.float()[..., None]
        q = torch.where(s > 0, torch.round(g / torch.where(s > 0, s, 1)), 0).clamp(-127, 127)
        return QuantizedMatrix(8, q.reshape(n, k).to(torch.int8), scale, minimum)
    if bits == 4:
        lo, hi = g.amin(-1), g.amax(-1)
        scale = ((hi - lo) / 15).to(torch.float16)
        minimum = lo.to(torch.float16)
        s = scale.float()[..., None]
        q = torch.where(s > 0, torch.round((g - minimum.float()[..., None]) / torch.where(s > 0, s, 1)), 0)
        return QuantizedMatrix(4, pack_nibbles(q.clamp(0, 15).reshape(n, k)), scale, minimum)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def exact_gguf_bits(qtype: int) -> int | None:
    """The bits a GGUF matrix of this type keeps exactly (None: it has to be quantized again)."""
    return {Q4_0: 4, Q4_1: 4, Q8_0: 8}.get(qtype)


def from_gguf(raw: np.ndarray, qtype: int) -> QuantizedMatrix:
    """raw: uint8 [N, bytes per row] of Q8_0 (34 B / 32 weights: fp16 d, int8 q; w = d q), Q4_0 (18 B:
    d, 16 B of nibbles; w = d (q - 8)) or Q4_1 (20 B: d, m, nibbles; w = d q + m) blocks; the nibbles of
    a block hold elements 0-15 low and 16-31 high."""
    n = raw.shape[0]
    if qtype == Q8_0:
        blocks = raw.reshape(n, -1, 34)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, -1)
        return QuantizedMatrix(8, torch.from_numpy(q), torch.from_numpy(d), torch.zeros(d.shape, dtype=torch.float16))
    if qtype not in (Q4_0, Q4_1):
        raise ValueError(f"GGUF type {qtype} has no exact mapping")
    blocks = raw.reshape(n, -1, 18 if qtype == Q4_0 else 20)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == Q4_1:
        m, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0], blocks[..., 4:]
    else:
        m, qs = (d.astype(np.float32) * -8).astype(np.float16), blocks[..., 2:]  # exact: a power of two
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1)
    return QuantizedMatrix(4, pack_nibbles(torch.from_numpy(q.astype(np.uint8))), torch.from_numpy(d),
                           torch.from_numpy(m))
