"""The 8-bit KV cache (`kv_cache_dtype = "int8"`, kernels/kv_quant.py): the row format, the fused decoder's
spelling of it against torch's, both paths against each other and against a bf16 cache, and the engine's
pool, prefix hits and swaps with it."""
from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels
from kvserve.kernels import kv_quant
from kvserve.models.loader import load_checkpoint
from tests.parity import PagedHarness, rel_err

native = cpu_kernels.load()
needs_fused = pytest.mark.skipif(native is None or not native.fused, reason="the fused decoder needs AMX or AVX2")


def _rows(n: int = 300, d: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.rand(n, 1, generator=g).mul(20).exp2()  # rows from 1x to 1e6x
    x[0] = 0  # a zero row: scale 0, values 0
    x[1, :] = torch.arange(d) - d / 2  # small integers: x / scale near .5 for some
    x[2, 5] = -1e4  # one large value among small ones
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("d", [64, 72, 16])  # four groups of 16; four and one of 8; one
def test_a_row_is_its_int8_values_then_an_fp16_scale_per_group_within_half_a_step(d):
    x = _rows(d=d)
    q = kv_quant.quantize(x)
    n = -(-d // 16)
    assert q.dtype == torch.uint8 and q.shape == (300, d + 2 * n) and kv_quant.head_dim_of(d + 2 * n) == d
    back = kv_quant.dequantize(q, torch.float32)
    groups = [slice(g * 16, min(d, g * 16 + 16)) for g in range(n)]
    amax = torch.stack([x[:, g].float().abs().amax(-1) for g in groups], -1)
    scale = q[:, d:].contiguous().view(torch.float16).float()
    assert torch.equal(scale, (amax / 127).half().float())
    for i, g in enumerate(groups):
        assert torch.all((back[:, g] - x[:, g].float()).abs() <= scale[:, i:i + 1] / 2 * (1 + 1e-3))
        assert torch.all(back[:, g].abs() <= 127 * scale[:, i:i + 1])
    assert torch.equal(back[0], torch.zeros(d))
    # What attention reads: q * scale in fp32, rounded once to the model's dtype.
    assert torch.equal(kv_quant.dequantize(q, torch.bfloat16), back.to(torch.bfloat16))


def test_a_scale_past_fp16s_range_saturates_and_never_turns_inf():
    x = torch.tensor([[1e7] + [1.0] * 15, [-3e38] + [0.0] * 15])
    back = kv_quant.dequantize(kv_quant.quantize(x), torch.float32)
    assert torch.isfinite(back).all()
    assert torch.equal(back[:, 0], torch.tensor([127 * 65504.0, -127 * 65504.0]))


@needs_fused
def test_the_fused_decoder_writes_and_reads_the_bytes_torch_does():
    """Either path may write a row that the other reads (a long prefill per op, its decodes fused): the
    kernel's rounding is kv_quant's, byte for byte, at every CPU level (the vector and scalar tails too)."""
    for d in (64, 72, 16):
        x = _rows(d=d, seed=d)
        x[3, 0] = 1e7  # a scale past fp16's range: saturates in both
        q = native.quantize_kv(x)
        assert torch.equal(q, kv_quant.quantize(x))
        assert torch.equal(native.dequantize_kv(q), kv_quant.dequantize(q, torch.bfloat16))


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def checkpoint(request, tiny_llama_gguf, tiny_gemma_gguf):
    return load_checkpoint(tiny_llama_gguf if request.param == "llama" else tiny_gemma_gguf, "auto")


def _mixed(ck, dtype=torch.bfloat16, kv_int8=True, fused=True) -> torch.Tensor:
    """Logits of a mixed batch (fresh prompts, chunks over cached prefixes, decodes) and of a prompt
    prefilled in uneven chunks then decoded token by token."""
    h = PagedHarness(ck, dtype=dtype, kv_int8=kv_int8)
    if fused:
        assert h.model.native_decoder is not None
    else:
        h.model.native_decoder = None
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 20000) for _ in range(n)] for n in (23, 31, 9, 40, 17)]
    mixed = torch.cat(h.mixed_batch(prompts))
    ids = [rng.randrange(3, 20000) for _ in range(60)]
    chunked = h.chunked(ids, h.new_table(60), [20, 13, 17] + [1] * 10)
    return torch.cat([mixed, chunked]).float()


@needs_fused
def test_fused_and_per_op_paths_agree_on_an_int8_cache(checkpoint):
    fused = _mixed(checkpoint)
    per_op = _mixed(checkpoint, fused=False)
    assert rel_err(fused, per_op) <= 2e-2


@needs_fused
def test_an_int8_cache_costs_little_against_bf16(checkpoint):
    """Against float32 (float cache), the 8-bit cache's logits are about as close as the bf16 cache's: the
    rounding of each row to 8 bits relative to its largest value adds little to bf16's own."""
    int8 = _mixed(checkpoint)
    bf16 = _mixed(checkpoint, kv_int8=False)
    reference = _mixed(checkpoint, dtype=torch.float32, kv_int8=False, fused=False)
    assert rel_err(int8, bf16) <= 3e-2
    assert rel_err(int8, reference) <= 2 * rel_err(bf16, reference) + 1e-2


@needs_fused
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_prefill_chunks_on_tiles_read_an_int8_cache(tmp_path, smollm2_gguf_path, arch):
    """head_dim 64: chunks attend on packed keys (AMX / AVX-512 BF16) or in row groups (AVX2), from the
    dequantized blocks; Gemma's window (40) cuts through them."""
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    spec = (TinySpec(arch="llama", heads=6, kv_heads=2, head_dim=64) if arch == "llama" else
            TinySpec(arch="gemma3", layers=6, heads=4, kv_heads=1, head_dim=64, sliding_window=40))
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, spec, str(smollm2_gguf_path))
    ck = load_checkpoint(path, "auto")
    fused = _mixed(ck)
    per_op = _mixed(ck, fused=False)
    assert rel_err(fused, per_op) <= 2e-2


def test_the_pool_holds_about_twice_the_tokens(tiny_llama_gguf):
    bf16 = LLM(str(tiny_llama_gguf), dtype="bfloat16", kv_cache_memory="8MiB", swap_space=0)
    int8 = LLM(str(tiny_llama_gguf), dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory="8MiB", swap_space=0)
    c = int8.engine.model_config
    assert int8.engine.kv_bytes_per_token == 2 * c.num_layers * c.num_kv_heads * (c.head_dim + 2 * -(-c.head_dim // 16))
    assert bf16.engine.kv_bytes_per_token == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
    ratio = int8.engine.core.kv.num_device_blocks / bf16.engine.core.kv.num_device_blocks
    assert ratio == pytest.approx(2 * c.head_dim / kv_quant.row_width(c.head_dim, True), rel=0.02)
    key_cache = int8.engine.runner.kv_caches[0][0]
    assert key_cache.dtype == torch.uint8 and key_cache.shape[-1] == kv_quant.row_width(c.head_dim, True)


def test_prefix_hits_and_swaps_carry_the_scales(tiny_llama_gguf):
    """A cached prefix is its quantized rows with their scales; a swapped-out sequence comes back with them:
    greedy text is the same as the undisturbed run's."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(str(tiny_llama_gguf), dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory="8MiB")
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids
    runner = llm.engine.runner
    before = [(k[:, 3:5].clone(), v[:, 3:5].clone()) for k, v in runner.kv_caches]
    runner.swap_out([(3, 0), (4, 1)])
    for k, v in runner.kv_caches:
        k[:, 3:5] = 0
        v[:, 3:5] = 0
    runner.swap_in([(0, 3), (1, 4)])
    for (k, v), (k0, v0) in zip(runner.kv_caches, before):
        assert torch.equal(k[:, 3:5], k0) and torch.equal(v[:, 3:5], v0)
