"""The native CPU paged-attention kernels agree with the torch reference path they replace."""
from __future__ import annotations

import random
import shutil

import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.models import attention as A
from kvserve.models.backend import TORCH, Backend, choose

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler on this machine")


@pytest.fixture(scope="module")
def native():
    lib = cpu_kernels.load()
    assert lib is not None, "g++ is present, so the kernels must build"
    return lib


def test_the_cpu_level_in_force_is_what_runs(native):
    """KVSERVE_CPU_ISA lowers both the kernels' build and torch's own dispatch; unset, both are the CPU's."""
    from kvserve.kernels import isa

    level, flags = isa.current(), isa.cpu_flags()
    expected = {"avx2": {"avx2"}, "avx512": {"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}}.get(level.name)
    if expected is None:  # native: what the CPU has
        expected = {name for name in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni") if name in flags}
        expected |= {"amx"} if {"amx_tile", "amx_bf16"} <= flags else set()
        assert not native.amx or "amx" in expected
    else:
        assert torch.backends.cpu.get_cpu_capability() == level.aten.upper()
        assert not native.amx
    assert native.compiled_isa == expected
    assert isa.native_bf16() == ("avx512_bf16" in expected or "amx" in expected)
    assert native.int8_activations == ({"avx512_bf16", "avx512_vnni"} <= expected)


def _paged_setup(dtype, num_seqs, num_heads, num_kv_heads, head_dim, block_size, lens, seed=0):
    """Random caches with each sequence's blocks scattered over the pool; padded block tables as the runner makes."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max((n + block_size - 1) // block_size for n in lens)
    num_blocks = sum((n + block_size - 1) // block_size for n in lens) + 7
    shape = A.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    kc = torch.randn(shape, generator=g).to(dtype)
    vc = torch.randn(shape, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = []
    for n in lens:
        need = (n + block_size - 1) // block_size
        tables.append([free.pop() for _ in range(need)] + [0] * (max_blocks - need))
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g).to(dtype)
    meta = A.AttentionMetadata(slot_mapping=torch.zeros(num_seqs, dtype=torch.long), num_decode_tokens=num_seqs,
                               decode_block_tables=torch.tensor(tables), decode_context_lens=torch.tensor(lens),
                               decode_max_context=max(lens), decode_min_context=min(lens))
    return q, kc, vc, meta


CASES = [  # (heads, kv heads, head_dim, block size, window): SmolLM2, Gemma 3 (local and global), generic dims
    (9, 3, 64, 16, None),
    (4, 1, 256, 16, 512),
    (4, 1, 256, 16, None),
    (8, 8, 128, 8, None),
    (10, 2, 64, 16, None),  # groups of 5 and 2: every group size the vector paths take heads in (1-4)
    (4, 2, 128, 16, None),
    (6, 2, 48, 16, 20),  # head_dim not a multiple of 16: the portable path
    (2, 1, 32, 4, 7),
]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", CASES)
def test_decode_attention_matches_torch(native, dtype, heads, kv_heads, head_dim, block_size, window):
    rng = random.Random(head_dim * 31 + block_size)
    lens = [1, 2, block_size, block_size + 1] + [rng.randint(1, 700) for _ in range(8)]
    q, kc, vc, meta = _paged_setup(dtype, len(lens), heads, kv_heads, head_dim, block_size, lens)
    scale = head_dim ** -0.5
    ref = A._decode_attention_torch(q, kc, vc, meta, scale, window)
    out = native.decode_attention(q, kc, vc, meta.decode_block_tables, meta.decode_context_lens, scale, window)
    assert out.shape == ref.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # both accumulate in fp32; the torch path rounds its probabilities to bf16 before P @ V
        torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=3e-2)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_torch_from_a_fused_projection_view(native, dtype):
    heads, kv_heads, hd, bs, tokens = 9, 3, 64, 16, 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd).to(dtype)
    _, k, v = qkv.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
    k, v = k.view(tokens, kv_heads, hd), v.view(tokens, kv_heads, hd)  # strided views, as the model passes them
    slots = torch.randperm(20 * bs)[:tokens]
    shape = A.kv_cache_shape(20, bs, kv_heads, hd)
    ref_k, ref_v, nat_k, nat_v = (torch.zeros(shape, dtype=dtype) for _ in range(4))
    A.write_kv(ref_k, ref_v, k, v, slots)
    native.write_kv(nat_k, nat_v, k, v, slots)
    assert torch.equal(ref_k, nat_k) and torch.equal(ref_v, nat_v)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_same_with_and_without_native_kernels(native, dtype, monkeypatch):
    """A mixed step (decodes + a fresh prefill + a continued chunk) through both paths of paged_attention."""
    heads, kv_heads, hd, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(3)
    shape = A.kv_cache_shape(64, bs, kv_heads, hd)
    base_k, base_v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    dec_lens = [5, 40, 100]  # context incl. the new token
    tables = [list(range(0, 1)), list(range(1, 4)), list(range(4, 11))]
    prefill_table = list(range(11, 14))  # fresh prompt of 33 tokens
    cont_table = list(range(14, 18))  # 20 cached + 30 new tokens
    slots = [tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(dec_lens)]
    slots += [prefill_table[p // bs] * bs + p % bs for p in range(33)]
    slots += [cont_table[p // bs] * bs + p % bs for p in range(20, 50)]
    total = len(slots)
    q = torch.randn(total, heads, hd, generator=g).to(dtype)
    k = torch.randn(total, kv_heads, hd, generator=g).to(dtype)
    v = torch.randn(total, kv_heads, hd, generator=g).to(dtype)
    max_blocks = max(len(t) for t in tables)

    def run():
        meta = A.AttentionMetadata(
            slot_mapping=torch.tensor(slots), num_decode_tokens=3,
            decode_block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
            decode_context_lens=torch.tensor(dec_lens), decode_max_context=100, decode_min_context=5,
            prefills=[A.PrefillChunk(3, 33, 33, torch.tensor(prefill_table)),
                      A.PrefillChunk(36, 30, 50, torch.tensor(cont_table))])
        kc, vc = base_k.clone(), base_v.clone()
        out = A.paged_attention(q, k, v, kc, vc, meta, hd ** -0.5, native=kernels)
        return out, kc, vc

    kernels = native
    with_native = run()
    kernels = None  # the torch path (CUDA, no compiler)
    reference = run()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=3e-2)
    torch.testing.assert_close(with_native[0].float(), reference[0].float(), **tol)
    assert torch.equal(with_native[1], reference[1]) and torch.equal(with_native[2], reference[2])


@needs_compiler
def test_loading_the_library_keeps_denormals(native):
    """A library linked with -ffast-math would set flush-to-zero process-wide and change sampling."""
    tiny = torch.tensor([1e-38], dtype=torch.float32) / 1000
    assert tiny.item() != 0.0


@pytest.mark.isa_independent
@needs_compiler
def test_build_is_cached_per_source_and_falls_back_when_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path))
    first = cpu_kernels.build()
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    monkeypatch.setenv("KVSERVE_NATIVE_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_library", False)
    assert cpu_kernels.load() is None


def test_missing_compiler_is_an_error_that_load_turns_into_the_torch_path(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "build", lambda: (_ for _ in ()).throw(RuntimeError("no C++ compiler")))
    monkeypatch.setattr(cpu_kernels, "_library", False)
    monkeypatch.setenv("KVSERVE_NATIVE_KERNELS", "1")
    assert cpu_kernels.load() is None
    assert choose(torch.device("cpu"), torch.float32) == Backend("cpu-torch")


# ---- fused elementwise kernels against the torch code of models/layers.py ----------------------------

def _kernels(native, *modules):
    for m in modules:
        m.backend = Backend("cpu-native", native)


def _torch_path(*modules):
    for m in modules:
        m.backend = TORCH


def _close(out, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # one rounding instead of the torch path's several: within a bf16 ulp or two
        torch.testing.assert_close(out.float(), ref.float(), rtol=1.6e-2, atol=1e-2)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm_matches_torch(native, dtype, unit_offset, monkeypatch):
    from kvserve.models.layers import RMSNorm

    g = torch.Generator().manual_seed(1)
    norm = RMSNorm(72, 1e-6, unit_offset=unit_offset)
    norm.weight.data = (torch.randn(72, generator=g) * 0.3 + (0 if unit_offset else 1)).to(dtype)
    hidden = (torch.randn(13, 72, generator=g) * 3).to(dtype)  # 72: a 16-lane body and a scalar tail
    qkv = torch.randn(5, 7 * 72, generator=g).to(dtype)
    heads = qkv[:, :4 * 72].view(5, 4, 72)  # QK-norm input: a strided view of the fused projection
    deep = torch.randn(2, 3, 4, 72, generator=g).to(dtype)  # more than 3 dims: flattened to rows, shape kept
    _kernels(native, norm)  # the kernel path runs first, then the torch one
    outs = [norm(hidden), norm(heads), norm(deep)]
    _torch_path(norm)
    refs = [norm(hidden), norm(heads), norm(deep)]
    for out, ref in zip(outs, refs):
        assert out.shape == ref.shape and out.dtype == dtype
        _close(out, ref, dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_torch_in_place_on_projection_views(native, dtype, monkeypatch):
    from kvserve.models.layers import Rotary

    rot = Rotary(64, 512, 10000.0).to(dtype)  # as build_model casts the whole model
    assert rot.cos.dtype == torch.float32  # the tables the kernel reads stay float32
    g = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 1, 7, 300, 511, 42])
    qkv = torch.randn(6, (9 + 2 * 3) * 64, generator=g).to(dtype)

    def views(t):
        return t[:, :9 * 64].view(6, 9, 64), t[:, 9 * 64:12 * 64].view(6, 3, 64)

    _kernels(native, rot)
    q, k = rot(positions, *views(qkv.clone()), {})
    _torch_path(rot)
    q_ref, k_ref = rot(positions, *views(qkv.clone()), {})
    _close(q, q_ref, dtype)
    _close(k, k_ref, dtype)


@needs_compiler
def test_rotary_refuses_positions_beyond_its_table(native):
    from kvserve.models.layers import Rotary

    rot = Rotary(16, 8, 10000.0)
    _kernels(native, rot)
    q = torch.randn(2, 2, 16)
    with pytest.raises(IndexError):
        rot(torch.tensor([3, 8]), q, q.clone(), {})


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_mlp_matches_torch(native, dtype, activation, monkeypatch):
    from kvserve.models.layers import GatedMLP

    g = torch.Generator().manual_seed(4)
    mlp = GatedMLP(40, 56, activation)  # 56: not a multiple of 16
    mlp.gate_up_proj.weight.data = (torch.randn(112, 40, generator=g) * 0.5).to(dtype)
    mlp.down_proj.weight.data = (torch.randn(40, 56, generator=g) * 0.2).to(dtype)
    x = (torch.randn(9, 40, generator=g) * 2).to(dtype)
    _kernels(native, mlp)
    out = mlp(x)
    _torch_path(mlp)
    _close(out, mlp(x), dtype)


@needs_compiler
def test_a_built_model_asks_the_backend_chosen_at_load(native, tiny_llama_gguf):
    """The hardware path is decided once (models/backend.prepare) and every layer asks it."""
    from kvserve.models.layers import GatedMLP, RMSNorm, Rotary, SelfAttention
    from kvserve.models.loader import build_model, load_checkpoint, plan_for

    ck = load_checkpoint(tiny_llama_gguf)
    for dtype, kernels in [(torch.float32, True), (torch.float16, False)]:
        model = build_model(ck, plan_for(ck, dtype), 256)
        expected = Backend("cpu-native", native) if kernels else Backend("cpu-torch")
        assert model.backend == expected
        layers = [m for m in model.modules() if isinstance(m, (RMSNorm, Rotary, SelfAttention, GatedMLP))]
        assert len(layers) > 4 and all(m.backend is model.backend for m in layers)
