"""Build, cache and call the CPU kernels through ctypes: `paged_attention_cpu.cpp` (paged decode
attention, KV writes, and the fused RMSNorm, rotary and gated activations of a decoder layer) and
`decoder_cpu.cpp` (the entry points of the packed GEMM and of a whole step's decoder stack, on AMX tiles or
vector units; its kernels live in the headers beside it, by concern), sharing `cpu_common.h`.

The sources are compiled once per machine with the system g++ (-O3 -march=native -fopenmp) into one
library in `$KVSERVE_KERNEL_CACHE` (default ~/.cache/kvserve/kernels), keyed by a hash of the sources, the
compiler and the CPU's flags, so a cache shared between machines never loads a binary built for
another CPU. Without a compiler, or with KVSERVE_NATIVE_KERNELS=0, `load()` returns None and
the model stays on its torch ops: the kernels are a speed-up, never a requirement.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from kvserve.kernels import isa, kv_quant

log = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "paged_attention_cpu.cpp", _HERE / "decoder_cpu.cpp"]  # compiled into one library
HEADERS = sorted(_HERE.glob("*.h"))  # every header the sources may include: an edit to any rebuilds
# Never -ffast-math: linking it adds crtfastmath, which turns on flush-to-zero for the whole process.
# The instruction set comes from isa.compile_flags() (-march=native unless KVSERVE_CPU_ISA lowers it).
FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-fno-math-errno"]
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float

_lock = threading.Lock()
_library: "NativeKernels | None | bool" = False  # False: not tried yet


def enabled() -> bool:
    return os.environ.get("KVSERVE_NATIVE_KERNELS", "1") not in ("0", "false", "no", "")


def cache_dir() -> Path:
    return Path(os.environ.get("KVSERVE_KERNEL_CACHE", Path.home() / ".cache" / "kvserve" / "kernels"))


def build(compiler: str | None = None) -> Path:
    """Compile the kernels (or reuse the cached build); returns the shared library's path."""
    cxx = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler (g++) found")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [f.read_text() for f in SOURCES + HEADERS]
    flags = [*FLAGS, *isa.compile_flags()]
    key = hashlib.sha256("\0".join([*texts, version, " ".join(flags), " ".join(sorted(isa.cpu_flags()))]).encode())
    name = f"paged_attention_cpu-{key.hexdigest()[:16]}.so"
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"kvserve-kernels-{os.getuid()}"):
        target = folder / name
        if target.exists():
            return target
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:  # a read-only home: build under the temp dir instead
            continue
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([cxx, *flags, *map(str, SOURCES), "-o", str(out)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the CPU kernels failed:\n{proc.stderr[-2000:]}")
        os.replace(out, target)  # atomic: concurrent builders each land a complete file
    return target


class NativeKernels:
    """The loaded library, with typed entry points per dtype."""

    def __init__(self, path: Path):
        self._lib = ctypes.CDLL(str(path))  # CDLL calls release the GIL
        self.path = path
        self._decode = self._bind("decode_attention", [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR]
                                  + [_I64] * 7 + [_F32])
        self._write = self._bind("write_kv", [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR] + [_I64] * 4)
        self._rms_norm = self._bind("rms_norm", [_PTR] + [_I64] * 5 + [_PTR, _F32, _I64, _PTR])
        self._add_rms_norm = self._bind("add_rms_norm", [_PTR, _PTR, _I64, _I64, _PTR, _F32, _I64, _PTR])
        self._qk_rope_write = self._bind("qk_rope_write_kv", [_PTR] + [_I64] * 5 + [_PTR] * 5
                                         + [_F32, _I64, _PTR, _PTR, _PTR, _I64])
        self._rotary = self._bind("rotary", [_PTR] + [_I64] * 4 + [_PTR, _PTR, _PTR])
        self._gated_act = self._bind("gated_act", [_PTR, _I64, _I64, _I64, _PTR])
        self._lib.kvserve_amx_available.restype = _I64
        self.amx = bool(self._lib.kvserve_amx_available())  # AMX tiles compiled in and granted by the kernel
        self._lib.kvserve_fused_available.restype = _I64
        # The packed GEMM and the fused decoder run here: on AMX tiles, else on AVX2/AVX-512 vector units.
        self.fused = bool(self._lib.kvserve_fused_available())
        self._lib.kvserve_tile_attention.restype = _I64
        # A prefill chunk's rows attend together: on packed keys (AMX tiles, or AVX-512 BF16 pair dot
        # products), or in row groups that share each key and value row (AVX2; AVX-512 BF16 and AMX under the
        # batch-invariant numerics, whose queries sum as each would attending alone).
        self.tile_attention = bool(self._lib.kvserve_tile_attention())
        self._lib.kvserve_pair_layout.restype = _I64
        # pack_weight's layout: AMX's tiles (AMX or AVX-512 BF16 builds), else k-major per 16 columns (AVX2).
        self.pair_layout = bool(self._lib.kvserve_pair_layout())
        self._lib.kvserve_compiled_isa.restype = _I64
        bits = self._lib.kvserve_compiled_isa()
        # The instruction sets compiled in (isa.compile_flags), as names.
        self.compiled_isa = frozenset(name for bit, name in enumerate(("avx2", "avx512f", "avx512_bf16", "amx", "avx512_vnni"))
                                      if bits >> bit & 1)
        # Quantized matrices can multiply activations quantized to 8 bits (gemm_quant_int8: VPDPBUSD).
        self.int8_activations = {"avx512_bf16", "avx512_vnni"} <= self.compiled_isa
        self._pack = self._lib.kvserve_pack_weight_bf16
        self._pack.argtypes, self._pack.restype = [_PTR, _I64, _I64, _PTR], None
        self._pack_quant = self._lib.kvserve_pack_quant
        self._pack_quant.argtypes, self._pack_quant.restype = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR], None
        self._pack_quant_super = self._lib.kvserve_pack_quant_super
        self._pack_quant_super.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR]
        self._pack_quant_super.restype = None
        self._quant_bytes = self._lib.kvserve_quant_bytes
        self._quant_bytes.argtypes, self._quant_bytes.restype = [_I64, _I64, _I64], _I64
        self._lib.kvserve_quant_direct_rows.restype = _I64
        # Rows up to which a quantized GEMM multiplies the file's values as read; longer steps widen them to
        # a bf16 panel first (the weights then rounded to bf16, as a dense bf16 model holds them).
        self.quant_direct_rows = int(self._lib.kvserve_quant_direct_rows())
        self._quant_rows = self._lib.kvserve_quant_rows
        self._quant_rows.argtypes, self._quant_rows.restype = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR], None
        self._linear_quant = self._lib.kvserve_linear_quant
        self._linear_quant.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _I64, _I64, _I64]
        self._linear_quant.restype = None
        for name in ("kvserve_quantize_kv_rows", "kvserve_dequantize_kv_rows"):
            f = getattr(self._lib, name)
            f.argtypes, f.restype = [_PTR, _I64, _I64, _PTR], None
        self._forward = self._lib.kvserve_forward_bf16
        self._forward.argtypes = [_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR,
                                  _PTR, _I64, _PTR, _PTR]
        self._forward.restype = _I64

    def quantize_kv(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 [..., D] -> the 8-bit cache rows (uint8) the fused decoder writes (kv_quant.quantize)."""
        x = x.to(torch.bfloat16).contiguous()
        out = torch.empty((*x.shape[:-1], kv_quant.row_width(x.shape[-1], True)), dtype=torch.uint8)
        self._lib.kvserve_quantize_kv_rows(x.data_ptr(), x.numel() // x.shape[-1], x.shape[-1], out.data_ptr())
        return out

    def dequantize_kv(self, rows: torch.Tensor) -> torch.Tensor:
        """8-bit cache rows -> bf16 [..., D], as the fused decoder's attention reads them (kv_quant.dequantize)."""
        rows = rows.contiguous()
        d = kv_quant.head_dim_of(rows.shape[-1])
        out = torch.empty((*rows.shape[:-1], d), dtype=torch.bfloat16)
        self._lib.kvserve_dequantize_kv_rows(rows.data_ptr(), rows.numel() // rows.shape[-1], d, out.data_ptr())
        return out

    def _bind(self, name: str, argtypes: list) -> dict:
        """kvserve_<name>_<f32|bf16> per torch dtype, typed."""
        fns = {}
        for dtype, suffix in _SUFFIX.items():
            f = getattr(self._lib, f"kvserve_{name}_{suffix}")
            f.argtypes, f.restype = argtypes, None
            fns[dtype] = f
        return fns

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """key/value [T, Hkv, D] -> cache slots; slots are int64 and contiguous."""
        h, nb, bs, d = key_cache.shape
        key, value = _rows(key.to(key_cache.dtype)), _rows(value.to(key_cache.dtype))
        self._write[key_cache.dtype](key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0),
                                     key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
                                     key.shape[0], h, nb * bs, d)

    def decode_attention(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         window: int | None) -> torch.Tensor:
        """query [D, Hq, hd] -> [D, Hq, hd]; block_tables [D, max_blocks] and context_lens [D] int64."""
        h, nb, bs, d = key_cache.shape
        query = _rows(query.to(key_cache.dtype))
        num_seqs, num_heads = query.shape[0], query.shape[1]
        out = torch.empty((num_seqs, num_heads, d), dtype=key_cache.dtype)
        self._decode[key_cache.dtype](query.data_ptr(), query.stride(0), key_cache.data_ptr(), value_cache.data_ptr(),
                                      block_tables.data_ptr(), block_tables.stride(0), context_lens.data_ptr(),
                                      out.data_ptr(), num_seqs, num_heads, h, nb, bs, d, window or 0, scale)
        return out

    # ---- fused elementwise ops (for the models whose backend chose these kernels: CPU, fp32 or bf16) ----
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
        """RMSNorm of x [..., dim] -> a new contiguous tensor of x's shape. 2-D and 3-D inputs are read
        through their strides (rows must be contiguous); others are flattened to rows first."""
        shape = x.shape
        if x.dim() not in (2, 3):
            x = x.reshape(-1, shape[-1])
        if x.stride(-1) != 1:
            x = x.contiguous()
        weight = weight.to(x.dtype).contiguous()
        a, b = x.shape[0], (x.shape[1] if x.dim() == 3 else 1)
        sa, sb = x.stride(0), (x.stride(1) if x.dim() == 3 else 0)
        out = torch.empty(shape, dtype=x.dtype)
        self._rms_norm[x.dtype](x.data_ptr(), a, b, sa, sb, shape[-1], weight.data_ptr(), eps, int(unit_offset),
                                out.data_ptr())
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     unit_offset: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x + residual), x + residual) for [..., dim] tensors; the sum is written into `residual`
        (in place, one rounding as torch's add) unless residual is not contiguous, then into a copy."""
        if not residual.is_contiguous():
            residual = residual.contiguous()
        x = x.to(residual.dtype).contiguous()
        weight = weight.to(x.dtype).contiguous()
        dim = x.shape[-1]
        out = torch.empty(residual.shape, dtype=x.dtype)
        self._add_rms_norm[x.dtype](x.data_ptr(), residual.data_ptr(), x.numel() // dim, dim, weight.data_ptr(), eps,
                                    int(unit_offset), out.data_ptr())
        return out, residual

    def qk_rope_write_kv(self, qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                         k_norm: torch.Tensor | None, norm_eps: float, norm_unit_offset: bool,
                         key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """On qkv [T, (Hq + 2 Hkv) * D] (rows contiguous, any row stride), in place: optional per-head RMSNorm
        of q and k (weights [D]), rotary of q and k, then k and v copied into their cache slots (int64,
        < 0 skips). Callers check that the dtypes agree and the positions lie inside the cos/sin tables."""
        _, nb, bs, d = key_cache.shape
        if qkv.stride(-1) != 1 or qkv.dtype != key_cache.dtype or qkv.shape[-1] != (num_q_heads + 2 * num_kv_heads) * d:
            raise ValueError("qkv must be [T, (Hq + 2 Hkv) * D] in the cache's dtype with contiguous rows")
        norms = [None if w is None else w.to(qkv.dtype).contiguous() for w in (q_norm, k_norm)]
        self._qk_rope_write[qkv.dtype](
            qkv.data_ptr(), qkv.shape[0], qkv.stride(0), num_q_heads, num_kv_heads, d, positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), *[None if w is None else w.data_ptr() for w in norms], norm_eps,
            int(norm_unit_offset), key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(), nb * bs)

    def rotary_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half rotary in place on x [T, heads, dim] (heads contiguous); cos/sin fp32 [positions, dim]."""
        x = _rows(x)
        self._rotary[x.dtype](x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), x.shape[2], positions.data_ptr(),
                              cos.data_ptr(), sin.data_ptr())
        return x

    def gated_act(self, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up for gate_up [T, 2n] (gate first) -> [T, n]; activation 'silu' or 'gelu_tanh'."""
        gate_up = gate_up.contiguous()
        t, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((t, n), dtype=gate_up.dtype)
        self._gated_act[gate_up.dtype](gate_up.data_ptr(), t, n, 0 if activation == "silu" else 1, out.data_ptr())
        return out

    # ---- the fused decoder stack (decoder_cpu.cpp; needs `fused`) ----
    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A bf16 [N, K] weight (N % 16 == 0, K % 32 == 0) in the packed GEMM's layout (`pair_layout`), flat."""
        n, k = weight.shape
        if weight.dtype != torch.bfloat16 or n % 16 or k % 32:
            raise ValueError(f"pack_weight takes bf16 [N, K] with N % 16 == 0 and K % 32 == 0, got {weight.dtype} "
                             f"{tuple(weight.shape)}")
        weight = weight.contiguous()
        packed = torch.empty(n * k, dtype=torch.bfloat16)
        self._pack(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def pack_quant(self, values: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor, bits: int) -> torch.Tensor:
        """A quantized [N, K] weight, w = scale * q + minimum per (row, 32 columns), in the kernels' layout
        (gemm_quant_layout.h, QWeight), flat uint8. values: int8 [N, K] (bits 8) or uint8 [N, K / 2] of two
        0..15 values a byte, element 2j in the low nibble (bits 4); scales and minimums float16 [N, K / 32].
        Bits 6 (where `int8_activations`): values int8 -32..31 [N, K], scales [N, K / 16], minimums unused."""
        if bits == 6 and not self.int8_activations:
            raise ValueError("6-bit weights need a build with AVX-512 BF16 and VNNI (8-bit activations)")
        n = scales.shape[0]
        k = scales.shape[1] * (16 if bits == 6 else 32)
        want = (torch.int8, (n, k)) if bits in (6, 8) else (torch.uint8, (n, k // 2)) if bits == 4 else None
        if want is None or values.dtype != want[0] or tuple(values.shape) != want[1] or n % 16 or k % 32 \
                or scales.dtype != torch.float16 or minimums.dtype != torch.float16 \
                or tuple(minimums.shape) != tuple(scales.shape):
            raise ValueError(f"pack_quant takes int8 [N, K] (bits 8) or uint8 [N, K/2] (bits 4) values with float16 "
                             f"[N, K/32] scales and minimums, N % 16 == 0; got bits {bits}, {values.dtype} "
                             f"{tuple(values.shape)}, scales {scales.dtype} {tuple(scales.shape)}")
        values, scales, minimums = values.contiguous(), scales.contiguous(), minimums.contiguous()
        packed = torch.empty(self._quant_bytes(n, k, bits), dtype=torch.uint8)
        self._pack_quant(values.data_ptr(), scales.data_ptr(), minimums.data_ptr(), n, k, bits, packed.data_ptr())
        return packed

    def pack_quant_super(self, values: torch.Tensor, subs: torch.Tensor, mins: torch.Tensor, heads: torch.Tensor,
                         bits: int) -> torch.Tensor:
        """A [N, K] weight in a K-quant form (bits 20: Q4_K's, 22: Q6_K's; gemm_quant_layout.h), K % 256 == 0:
        values as pack_quant's at 4 or 6 bits; subs the sub-block factors, uint8 [N, K / 32] (20) or int8
        [N, K / 16] (22); mins uint8 [N, K / 32] (20; else ignored); heads float16 [N, K / 256, 2]: each
        super-block's d and -dmin. w = d * sc * q + (-dmin) * m."""
        if bits not in (20, 22) or not self.int8_activations:
            raise ValueError(f"the K-quant forms (bits 20, 22) need a build with 8-bit activations, got bits {bits}")
        n = heads.shape[0]
        k = heads.shape[1] * 256
        six = bits == 22
        ok = (values.dtype, tuple(values.shape)) == ((torch.int8, (n, k)) if six else (torch.uint8, (n, k // 2))) \
            and (subs.dtype, tuple(subs.shape)) == ((torch.int8, (n, k // 16)) if six else (torch.uint8, (n, k // 32))) \
            and (six or (mins.dtype, tuple(mins.shape)) == (torch.uint8, (n, k // 32))) \
            and heads.dtype == torch.float16 and tuple(heads.shape) == (n, k // 256, 2) and n % 16 == 0
        if not ok:
            raise ValueError(f"pack_quant_super: inconsistent {bits} form: values {values.dtype} {tuple(values.shape)}, "
                             f"subs {subs.dtype} {tuple(subs.shape)}, mins {mins.dtype} {tuple(mins.shape)}, "
                             f"heads {heads.dtype} {tuple(heads.shape)}")
        values, subs, mins, heads = values.contiguous(), subs.contiguous(), mins.contiguous(), heads.contiguous()
        packed = torch.empty(self._quant_bytes(n, k, bits), dtype=torch.uint8)
        self._pack_quant_super(values.data_ptr(), subs.data_ptr(), mins.data_ptr(), heads.data_ptr(), n, k, bits,
                               packed.data_ptr())
        return packed

    def quant_rows(self, packed: torch.Tensor, bits: int, n: int, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape, int) of an [n, K] weight packed by pack_quant -> ids.shape + [K] bf16, each
        w = scale * q + minimum rounded to bf16 (as the dense weight holds it)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= n):
            raise IndexError(f"row ids out of range [0, {n})")
        unit = 256 if bits & 16 else 32  # inputs a form's bytes grow by: a super-block, or a chunk
        k = packed.numel() * packed.element_size() // self._quant_bytes(n, unit, bits) * unit
        out = torch.empty((flat.numel(), k), dtype=torch.bfloat16)
        self._quant_rows(packed.data_ptr(), bits, n, k, flat.data_ptr(), flat.numel(), out.data_ptr())
        return out.view(*ids.shape, k)

    def linear_quant(self, x: torch.Tensor, packed: torch.Tensor, bits: int, n: int,
                     out_dtype: torch.dtype = torch.bfloat16, invariant: bool = False,
                     int8_acts: bool = False) -> torch.Tensor:
        """x [T, K] bf16 times a weight [n, K] packed by pack_quant (bits 4, 8) or pack_weight (bits 0) ->
        [T, n] in bf16, or in float32 holding the same bf16-rounded values (the LM head's logits). `invariant`:
        each row's values are the same bits whatever T (the batch-invariant numerics, gemm.h's gemm).
        `int8_acts`: a quantized weight multiplies x quantized to 8 bits per 16 inputs (where
        `int8_activations`; every T then batch-invariant)."""
        if not self.fused:
            raise RuntimeError("the packed GEMM needs AMX or AVX2")
        x = x.contiguous()
        k = x.shape[-1]
        size = n * k * 2 if bits == 0 else self._quant_bytes(n, k, bits)
        if x.dtype != torch.bfloat16 or x.dim() != 2 or k % 32 or n % 16 or packed.numel() * packed.element_size() != size:
            raise ValueError(f"linear_quant takes bf16 [T, K] and a packed [{n}, K] weight of {bits} bits")
        if (int8_acts or bits in (6, 20, 22)) and not self.int8_activations:
            raise ValueError("8-bit activations need a build with AVX-512 BF16 and VNNI")
        if bits in (6, 20, 22) and not int8_acts:
            raise ValueError("6-bit and K-quant forms are multiplied by 8-bit activations only (int8_acts)")
        out = torch.empty((x.shape[0], n), dtype=out_dtype)
        self._linear_quant(x.data_ptr(), x.shape[0], k, packed.data_ptr(), bits, n, out.data_ptr(),
                           int(out_dtype == torch.float32), int(invariant), int(int8_acts))
        return out

    def forward(self, model_params: ctypes.Structure, layer_params: ctypes.Array, hidden: torch.Tensor,
                positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, tile_chunks: torch.Tensor | None = None, first_layer: int = 0,
                state: torch.Tensor | None = None, stop: ctypes.c_int32 | None = None,
                shadow_blocks: torch.Tensor | None = None, shadow_tables: torch.Tensor | None = None,
                lora_slots: torch.Tensor | None = None) -> int:
        """hidden [T, H] bf16 embeddings -> the final-normed hidden states, in place (see decoder_cpu.cpp).
        Per token: positions, context_lens [T], and per KV group (a layer reads its LayerParams.kv_group's)
        slots [G, T] and block_tables [G, T, width] (or [T] and [T, width] for one group), all int64 and
        contiguous. tile_chunks
        [C, 2] int64: (first row, rows) of the prefill chunks whose rows attend together (packed keys, or
        AVX2 row groups: `tile_attention`, head_dim % 32 == 0; a chunk's rows are consecutive positions of one
        sequence).

        Returns the layer reached: the number of layers when done. With `stop` and `state` (bf16
        [2, T, H], kept between calls) it returns early, at the top of the layer after the first one
        that finds `stop` set (each layer reads it once); call again with first_layer = that layer.

        8-bit caches (model_params.kv_int8): rows attending alone dequantize their own keys and values; for
        the tile chunks, shadow_blocks [B] int64 lists the cache blocks they read and their rows of
        shadow_tables (block_tables' shape) index that list (each layer dequantizes those blocks once).

        lora_slots [T] int32 contiguous: each token's LoRA adapter slot (-1: the base model), whose weights the
        layer table's lora_* fields hold; None: no adapter in the step."""
        if not self.fused:
            raise RuntimeError("the fused decoder needs AMX or AVX2")
        if not hidden.is_contiguous():
            raise ValueError("the fused decoder writes hidden in place: it must be contiguous")
        if state is not None and (state.dtype != torch.bfloat16 or not state.is_contiguous()
                                  or state.numel() != 2 * hidden.numel()):
            raise ValueError("state must be a contiguous bf16 [2, T, H] tensor")
        if not (block_tables.is_contiguous() and slot_mapping.is_contiguous()):
            raise ValueError("block_tables and slot_mapping must be contiguous (a group's rows follow the last's)")
        if lora_slots is not None and (lora_slots.dtype != torch.int32 or not lora_slots.is_contiguous()
                                       or lora_slots.numel() != hidden.shape[0]):
            raise ValueError("lora_slots must be a contiguous int32 [T] tensor")
        chunks = 0 if tile_chunks is None else tile_chunks.shape[0]
        return self._forward(ctypes.byref(model_params), layer_params, hidden.data_ptr(), hidden.shape[0],
                             positions.data_ptr(), slot_mapping.data_ptr(), block_tables.data_ptr(),
                             block_tables.stride(-2), context_lens.data_ptr(),
                             tile_chunks.data_ptr() if chunks else None, chunks, first_layer,
                             state.data_ptr() if state is not None else None,
                             ctypes.addressof(stop) if stop is not None else None,  # ignored without state
                             shadow_blocks.data_ptr() if shadow_blocks is not None else None,
                             shadow_blocks.shape[0] if shadow_blocks is not None else 0,
                             shadow_tables.data_ptr() if shadow_tables is not None else None,
                             lora_slots.data_ptr() if lora_slots is not None else None)


def _qweight_fields(name: str = "") -> list[tuple[str, type]]:
    """gemm_quant_layout.h's QWeight, its fields prefixed by `name` where it is embedded flat."""
    prefix = f"{name}_" if name else ""
    return [(name or "data", _PTR), (f"{prefix}bits", _I64), (f"{prefix}tail", _PTR), (f"{prefix}tail_bits", _I64),
            (f"{prefix}tail_from", _I64)]


class QWeight(ctypes.Structure):
    """gemm_quant_layout.h's QWeight (one packed weight; a mixture's experts are arrays of these)."""

    _fields_ = _qweight_fields()


class LoraModule(ctypes.Structure):
    """lora_cpu.h's LoraModule: one projection's adapter slots (models/lora._ModuleSlots), by address."""

    _fields_ = [("a", _PTR), ("bt", _PTR), ("part_rows", _PTR), ("capacity", _I64), ("parts", _I64),
                ("part_end", _I64 * 3), ("interleaved", _I64)]


class LayerParams(ctypes.Structure):
    """decoder_step.h's LayerParams: one layer's packed weights, norms, cache and rotary tables, by address."""

    _fields_ = ([(name, _PTR) for name in ("attn_in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm", "q_norm",
                                           "k_norm")]
                + [field for name in ("qkv", "o", "gate_up", "down") for field in _qweight_fields(name)]
                + [(name, _PTR) for name in ("key_cache", "value_cache", "cos", "sin")]
                + [("window", _I64), ("scale", _F32), ("kv_group", _I64), ("qkv_bias", _PTR)]
                + [(name, _PTR) for name in ("router", "expert_gate_up", "expert_down")] + [("num_experts", _I64)]
                + [(f"lora_{name}", LoraModule) for name in ("qkv", "o", "gate_up", "down")])


class ModelParams(ctypes.Structure):
    """decoder_step.h's ModelParams."""

    _fields_ = [(name, _I64) for name in ("num_layers", "hidden", "q_heads", "kv_heads", "head_dim", "intermediate",
                                          "num_blocks", "block_size", "act")] + [
        ("eps", _F32), ("norm_unit_offset", _I64), ("final_norm", _PTR), ("phase_seconds", _PTR), ("kv_int8", _I64),
        ("invariant", _I64), ("int8_acts", _I64), ("experts_per_token", _I64), ("expert_inter", _I64),
        ("norm_topk", _I64), ("max_loras", _I64)]


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] with each token's heads contiguous (any token stride), as the kernels read it."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


def load() -> NativeKernels | None:
    """The kernels, built on first call; None (and one warning) when they cannot be built."""
    global _library
    if _library is not False:
        return _library
    with _lock:
        if _library is False:
            if not enabled():
                _library = None
            else:
                try:
                    _library = NativeKernels(build())
                except Exception as exc:  # no compiler, failed build: the torch path still serves
                    log.warning("native CPU attention kernels unavailable, using the torch path: %s", exc)
                    _library = None
    return _library
