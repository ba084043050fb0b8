"""The fused native decoder (models/native_decoder.py, kernels/decoder_cpu.cpp) against the per-op path,
on tiny random Llama and Gemma 3 models written as GGUF, in bfloat16 through the paged cache."""
from __future__ import annotations

import ctypes
import random

import pytest
import torch

from kvserve.engine.worker.runner import BatchItem
from kvserve.kernels import cpu as cpu_kernels
from kvserve.engine.interjection import Interjection
from kvserve.models.attention import AttentionMetadata, PrefillChunk
from kvserve.models import quant
from kvserve.models.loader import load_checkpoint
from kvserve.models.native_decoder import NativeDecoder
from tests.parity import PagedHarness, rel_err

native = cpu_kernels.load()
needs_fused = pytest.mark.skipif(native is None or not native.fused, reason="the fused decoder needs AMX or AVX2")
needs_int8 = pytest.mark.skipif(native is None or not native.int8_activations,
                                reason="8-bit activations need AVX-512 BF16 and VNNI")
needs_tiles = pytest.mark.skipif(native is None or not native.tile_attention,
                                 reason="prefill attention on packed keys needs AMX or AVX-512 BF16")


@pytest.fixture(scope="module", params=[("llama", "auto"), ("gemma3", "auto"), ("llama", "bf16"), ("gemma3", "bf16")],
                ids=lambda p: "-".join(p))
def checkpoint(request, tiny_llama_gguf, tiny_gemma_gguf):
    """The tiny models' Q8_0 matrices kept as int8 (weights auto: the fused decoder's quantized GEMMs) and
    dense (bf16: its bf16 GEMMs)."""
    arch, weights = request.param
    return load_checkpoint(tiny_llama_gguf if arch == "llama" else tiny_gemma_gguf, weights)


class CountingDecoder(NativeDecoder):
    calls = 0

    def __call__(self, *args):
        self.calls += 1
        return super().__call__(*args)


def _decode_run(ck, dtype, fused: bool, batch: int, steps: int = 4, seed: int = 0):
    """Prefill `batch` prompts one by one, then `steps` decode-only steps of the whole batch; returns the
    decode logits [steps, batch, vocab], the harness, and how many forward passes the fused decoder ran."""
    h = PagedHarness(ck, num_blocks=64 + batch * 8, dtype=dtype)
    decoder = h.model.native_decoder
    if fused:
        assert decoder is not None, "bf16 on an AMX or AVX2 CPU: the fused decoder must attach"
        decoder.__class__ = CountingDecoder
    else:
        h.model.native_decoder = None
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 20000) for _ in range(rng.randrange(3, 40))] for _ in range(batch)]
    tables = [h.new_table(len(p) + steps) for p in prompts]
    for p, t in zip(prompts, tables):
        h.runner.forward([BatchItem(p, 0, t)])
    logits = []
    for s in range(steps):
        items = [BatchItem([rng.randrange(3, 20000)], len(p) + s, t) for p, t in zip(prompts, tables)]
        logits.append(h.runner.forward(items, all_logits=True).float())
    return torch.stack(logits), h, decoder.calls if fused else 0


@needs_fused
@pytest.mark.parametrize("batch", [1, 18, 37])  # one tile row block, a partial second one, two blocks of 32
def test_fused_decode_matches_the_per_op_path(checkpoint, batch):
    fused, hf, calls = _decode_run(checkpoint, torch.bfloat16, True, batch)
    per_op, hp, _ = _decode_run(checkpoint, torch.bfloat16, False, batch)
    reference, _, _ = _decode_run(checkpoint, torch.float32, False, batch)
    assert calls == batch + 4, "the short prefills and every decode step go through the fused decoder"
    assert rel_err(fused, per_op) <= 2e-2
    # As accurate as the per-op bf16 path against float32: they differ in accumulation order (and, on AVX2,
    # in rounding the attention probabilities), so either may land nearer on a given batch; measured ratios
    # over seeds and batches run 0.8-1.3x.
    assert rel_err(fused, reference) <= 1.5 * rel_err(per_op, reference) + 1e-3
    # The K/V it wrote into the cache are the per-op path's.
    for (kf, vf), (kp, vp) in zip(hf.runner.kv_caches, hp.runner.kv_caches):
        assert rel_err(kf, kp.float()) <= 2e-2 and rel_err(vf, vp.float()) <= 2e-2


@needs_fused
def test_mixed_step_with_chunks_and_a_prefix_matches_the_per_op_path(checkpoint):
    """One flattened step mixing decodes, continued chunks (attending to cached tokens) and a fresh prompt."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 20000) for _ in range(n)] for n in (23, 31, 9, 40, 17)]
    fused = PagedHarness(checkpoint, dtype=torch.bfloat16)
    fused.model.native_decoder.__class__ = CountingDecoder
    per_op = PagedHarness(checkpoint, dtype=torch.bfloat16)
    per_op.model.native_decoder = None
    reference = PagedHarness(checkpoint, dtype=torch.float32)
    a, b, r = (torch.cat(h.mixed_batch(prompts)) for h in (fused, per_op, reference))
    assert fused.model.native_decoder.calls > 0
    assert rel_err(a, b.float()) <= 2e-2
    assert rel_err(a, r) <= 1.5 * rel_err(b, r) + 1e-3


@needs_int8
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int8_activations_on_the_fused_decoder_match_the_per_op_path(arch, tiny_llama_gguf, tiny_gemma_gguf):
    """With 8-bit activations (Plan.activations = "int8") the fused decoder and the per-op path multiply the
    same 8-bit rows; against float32 they stay within twice the bf16 activations' error (measured here at
    1.3-1.4x on these models)."""
    ck = load_checkpoint(tiny_llama_gguf if arch == "llama" else tiny_gemma_gguf, "auto")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 20000) for _ in range(n)] for n in (23, 31, 9, 40, 17)]
    fused = PagedHarness(ck, dtype=torch.bfloat16, activations="int8")
    fused.model.native_decoder.__class__ = CountingDecoder
    per_op = PagedHarness(ck, dtype=torch.bfloat16, activations="int8")
    per_op.model.native_decoder = None
    bf16 = PagedHarness(ck, dtype=torch.bfloat16, activations="bf16")
    a, b, c = (torch.cat(h.mixed_batch(prompts)).float() for h in (fused, per_op, bf16))
    r = torch.cat(PagedHarness(ck, dtype=torch.float32).mixed_batch(prompts))
    assert fused.model.native_decoder.calls > 0
    assert rel_err(a, b) <= 3e-2
    assert rel_err(a, r) <= 1.5 * rel_err(b, r) + 1e-3
    assert rel_err(a, r) <= 2 * rel_err(c, r) + 1e-3


@needs_int8
@pytest.mark.parametrize("kind,bits", [("Q6_K", 6), ("Q4_K", 4)])
def test_k_quant_matrices_keep_their_form_under_8_bit_activations(tmp_path, smollm2_gguf_path, kind, bits):
    """A Q6_K or Q4_K file's matrices keep their K-quant form (the file's own factors) where 8-bit activations
    multiply them, and the plain form where bf16 ones do (Q6_K at 8 bits, quantized again); both decode
    within twice the other's error against float32."""
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    path = tmp_path / f"tiny-{kind}.gguf"
    write_tiny_gguf(path, TinySpec(hidden=256, intermediate=512, head_dim=64, quant=kind), str(smollm2_gguf_path))
    kept = load_checkpoint(path, "auto", int8_acts=True)
    assert {form for _, form, _ in kept.forms} == {f"int{bits}"} and all(exact for _, _, exact in kept.forms)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 20000) for _ in range(n)] for n in (23, 9, 40)]
    hk = PagedHarness(kept, dtype=torch.bfloat16, activations="int8")
    code = bits | quant.SUPER
    assert {p.bits for p in hk.model.layers[0].mlp.down_proj.packed} == {code} and hk.model.lm_head_packed.bits == code
    hp = PagedHarness(load_checkpoint(path, "auto"), dtype=torch.bfloat16, activations="bf16")
    assert hp.model.lm_head_packed.bits == (8 if bits == 6 else 4)
    a, b = (torch.cat(h.mixed_batch(prompts)).float() for h in (hk, hp))
    r = torch.cat(PagedHarness(load_checkpoint(path, "bf16"), dtype=torch.float32).mixed_batch(prompts))
    assert rel_err(a, r) <= 2 * rel_err(b, r) + 1e-3 and rel_err(b, r) <= 2 * rel_err(a, r) + 1e-3


@needs_fused
def test_which_steps_take_the_fused_path(checkpoint):
    h = PagedHarness(checkpoint, dtype=torch.bfloat16)
    decoder = h.model.native_decoder
    caches = h.runner.kv_caches
    x = torch.zeros(3, checkpoint.config.hidden_size, dtype=torch.bfloat16)
    decode = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.int64), num_decode_tokens=3)
    mixed = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.int64), num_decode_tokens=1,
                              prefills=[PrefillChunk(1, 2, 600, torch.zeros(38, dtype=torch.int64))])
    assert decoder.applies(x, decode, caches) and decoder.applies(x, mixed, caches)
    decoder.max_attention_keys = 1000  # the chunk's 2 tokens attend to 599 + 600 keys
    assert not decoder.applies(x, mixed, caches) and decoder.applies(x, decode, caches)
    decoder.max_tokens = 2
    assert not decoder.applies(x, decode, caches)
    h.runner.kv_caches = [(k.float(), v.float()) for k, v in caches]
    decoder.max_tokens = 1024
    assert not decoder.applies(x, decode, h.runner.kv_caches)  # the kernel reads bf16 caches only


@needs_fused
def test_a_step_suspended_for_another_gives_both_the_same_logits(checkpoint):
    """A step stops between layers when its flag is raised, runs another step through the same runner
    (the engine's interjection), then finishes its layers: every logit is what it is without the stop."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 20000) for _ in range(n)] for n in (19, 33, 12)]
    late = [rng.randrange(3, 20000) for _ in range(27)]

    def run(interject: bool):
        h = PagedHarness(checkpoint, dtype=torch.bfloat16)
        tables = [h.new_table(len(p) + 1) for p in prompts]
        late_table = h.new_table(len(late))
        for p, t in zip(prompts, tables):
            h.runner.forward([BatchItem(p, 0, t)])
        decodes = [BatchItem([rng_tok], len(p), t) for rng_tok, p, t in zip((5, 6, 7), prompts, tables)]
        inner: list[torch.Tensor] = []
        if not interject:
            outer = h.runner.forward(decodes, all_logits=True)
            inner.append(h.runner.forward([BatchItem(late, 0, late_table)], all_logits=True))
            return outer, inner[0], 0
        flag = ctypes.c_int32(1)
        calls = []

        def run_inner():
            calls.append(flag.value)
            flag.value = 0
            inner.append(h.runner.forward([BatchItem(late, 0, late_table)], all_logits=True))

        outer = h.runner.forward(decodes, all_logits=True, interjection=Interjection(flag, run_inner))
        return outer, inner[0], calls

    outer, inner, calls = run(True)
    plain_outer, plain_inner, _ = run(False)
    assert calls == [1], "stopped once, at the first layer boundary, and finished after"
    assert torch.equal(outer, plain_outer) and torch.equal(inner, plain_inner)


@needs_fused
def test_the_kernel_stops_at_the_first_boundary_that_sees_the_flag(checkpoint):
    h = PagedHarness(checkpoint, dtype=torch.bfloat16)
    decoder = h.model.native_decoder
    layers = decoder.params.num_layers
    t = torch.tensor([[1]], dtype=torch.int64)
    x = torch.randn(1, checkpoint.config.hidden_size).bfloat16()
    one = torch.ones(1, dtype=torch.int64)
    args = (decoder.params, decoder._layer_table(h.runner.kv_caches), x.clone(), torch.zeros(1, dtype=torch.int64),
            torch.full((1,), 16, dtype=torch.int64), t, one)
    state = torch.empty(2, *x.shape, dtype=torch.bfloat16)
    raised = ctypes.c_int32(1)
    assert native.forward(*args, state=state, stop=raised) == 1  # at least one layer per call
    assert native.forward(*args, first_layer=1, state=state, stop=raised) == 2
    assert native.forward(*args, first_layer=2, state=state) == layers  # no flag: to the end
    assert native.forward(*args, stop=raised) == layers  # no state to keep: the flag is ignored


@needs_fused
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_the_packed_gemm_lm_head_gives_torchs_bf16_logits(rows):
    """On AMX tiles bit for bit (the same tile products as oneDNN's); on vector units the fp32 sums run in
    another order, so each logit is torch's or a bf16 neighbour of it."""
    torch.manual_seed(rows)
    w = (torch.randn(96, 64) * 0.3).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    got = native.linear_quant(x, native.pack_weight(w), 0, 96, torch.float32)
    want = torch.nn.functional.linear(x, w).float()
    assert got.dtype == torch.float32 and torch.equal(got, got.bfloat16().float())  # rounded to bf16
    if native.amx:
        assert torch.equal(got, want)
    exact, scale = x.double() @ w.double().T, x.double().abs() @ w.double().abs().T
    assert torch.all((got.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5 * scale)


@needs_fused
def test_the_model_takes_its_logits_from_the_packed_head(checkpoint):
    h = PagedHarness(checkpoint, dtype=torch.bfloat16)
    head = h.model.lm_head_packed
    assert head is not None and h.model.lm_head_onednn is None  # one packed copy, not two
    if checkpoint.weights == "auto":  # tied and quantized: the embedding's own packed table
        assert head.bits == 8 and head is h.model.embed_tokens.packed[0]
    hidden = torch.randn(3, checkpoint.config.hidden_size).bfloat16()
    calls = []
    real = native.linear_quant
    native.linear_quant = lambda *a: calls.append(a[2]) or real(*a)
    try:
        logits = h.model.compute_logits(hidden)
    finally:
        native.linear_quant = real
    assert calls == [head.bits] and logits.shape == (3, checkpoint.config.vocab_size) and logits.dtype == torch.float32


def test_falls_back_to_the_per_op_path_without_the_kernel_or_bf16(checkpoint, monkeypatch):
    assert PagedHarness(checkpoint, dtype=torch.float32).model.native_decoder is None
    if native is not None:
        monkeypatch.setattr(native, "fused", False)
    assert PagedHarness(checkpoint, dtype=torch.bfloat16).model.native_decoder is None


@needs_fused
def test_pack_weight_checks_the_tile_shape():
    with pytest.raises(ValueError):
        native.pack_weight(torch.zeros(24, 64, dtype=torch.bfloat16))  # N % 16 != 0
    with pytest.raises(ValueError):
        native.pack_weight(torch.zeros(32, 48, dtype=torch.bfloat16))  # K % 32 != 0
    w = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).bfloat16()
    if native.pair_layout:
        packed = native.pack_weight(w).view(2, 2, 16, 16, 2)  # [N/16, K/32, pair rows, cols, 2]
        assert packed[1, 0, 3, 5, 1] == w[16 + 5, 2 * 3 + 1] and packed[0, 1, 0, 2, 0] == w[2, 32]
    else:
        packed = native.pack_weight(w).view(2, 64, 16)  # [N/16, K, cols]: AVX2's k-major blocks
        assert packed[1, 7, 5] == w[16 + 5, 7] and packed[0, 32, 2] == w[2, 32]


@needs_fused
@pytest.mark.parametrize("quant,bits", [("Q4_1", 4), ("Q5_0", 8)])
def test_a_quantized_checkpoint_is_held_once_in_its_own_bits(tmp_path, smollm2_gguf_path, quant, bits):
    """weights auto keeps a 4-bit file's matrices at 4 bits and a 5-bit one's at 8, packed for the fused
    decoder's GEMMs, which the per-op path reads too: no dense, oneDNN or second packed copy."""
    from kvserve.models.loader import build_model, plan_for
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    path = tmp_path / f"tiny-{quant}.gguf"
    write_tiny_gguf(path, TinySpec(arch="llama", quant=quant, layers=2), str(smollm2_gguf_path))
    ck = load_checkpoint(path)
    model = build_model(ck, plan_for(ck, torch.bfloat16), 512)
    assert model.native_decoder is not None and not model.native_decoder._packed
    projections = [m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                          layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(m.packed is not None and [p.bits for p in m.packed] == [bits] for m in projections)
    assert all(m.weight.numel() == 0 and m.onednn is None and m.quant is None for m in projections)
    assert model.lm_head_packed is model.embed_tokens.packed[0] and model.lm_head_onednn is None


@needs_fused
def test_mixed_bits_in_one_projection_keep_each_part(tmp_path, checkpoint):
    """Q4_K_M stores some V projections at 6 bits (kept at 8) beside 4-bit Q and K: the fused QKV weight keeps
    its two kinds (the kernel's tail) instead of widening Q and K, and both paths give the same logits."""
    if checkpoint.weights != "auto" or checkpoint.config.architecture != "llama":
        pytest.skip("one quantized model is enough")
    from dataclasses import replace

    from kvserve.models import quant

    tensors = dict(checkpoint.tensors)
    for i in range(checkpoint.config.num_layers):
        for name in ("q_proj", "k_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            tensors[key] = quant.quantize(tensors[key].dequantize(), 4)
    mixed = replace(checkpoint, tensors=tensors)
    h = PagedHarness(mixed, dtype=torch.bfloat16)
    qkv = h.model.layers[0].self_attn.qkv_proj
    assert [p.bits for p in qkv.packed] == [4, 8]
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 20000) for _ in range(n)] for n in (23, 9, 31)]
    per_op = PagedHarness(mixed, dtype=torch.bfloat16)
    per_op.model.native_decoder = None
    reference = PagedHarness(mixed, dtype=torch.float32)
    a, b, r = (torch.cat(x.mixed_batch(prompts)).float() for x in (h, per_op, reference))
    assert rel_err(a, b) <= 2e-2 and rel_err(a, r) <= 1.5 * rel_err(b, r) + 1e-3


@needs_fused
def test_phase_clocks_and_the_profile_table(tiny_llama_gguf):
    from benchmarks import profile

    result = profile.run(str(tiny_llama_gguf), prompts=6, input_len=20, output_len=5, max_seqs=4)
    parts = {row["part"]: row["ms_per_step"] for row in result["rows"]}
    assert result["fused_decoder"] and result["steps"] >= 5
    phases = [parts[f"fused: {name}"] for name in profile.PHASES]
    assert all(ms >= 0 for ms in phases) and sum(phases) > 0
    assert parts["fused: call overhead outside the kernel's phases"] >= 0  # the fused calls were timed
    # The parts add up to the step: nothing large is left out or counted twice.
    accounted = sum(ms for name, ms in parts.items() if name != "step (wall)")
    assert 0.7 * parts["step (wall)"] <= accounted <= 1.05 * parts["step (wall)"]
    assert "| QKV GEMM |" in profile.markdown(result).replace("fused: ", "")


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def wide_head_checkpoint(request, tmp_path_factory, smollm2_gguf_path):
    """head_dim 64, so prefill chunks attend on tiles; Gemma's window (40) cuts through 16-row tiles."""
    from tests.gguf_factory import TinySpec, write_tiny_gguf

    spec = (TinySpec(arch="llama", heads=6, kv_heads=2, head_dim=64) if request.param == "llama" else
            TinySpec(arch="gemma3", layers=6, heads=4, kv_heads=1, head_dim=64, sliding_window=40))
    path = tmp_path_factory.mktemp("wide-head") / f"{request.param}.gguf"
    write_tiny_gguf(path, spec, str(smollm2_gguf_path))
    return load_checkpoint(path, weights="bf16")  # the attention paths are the point: dense projections


def _tile_run(ck, dtype, fused: bool, tile_min_rows: int = NativeDecoder.tile_min_rows) -> torch.Tensor:
    """Logits of a mixed batch (fresh prompts, chunks over cached prefixes, decodes) and of a 140-token
    prompt prefilled in uneven chunks (13 to 50 rows: partial tiles, chunks starting mid-block). The tiles'
    shared pass is the fast numerics' (batch_invariant attends every row as a decode does, or where a tile
    gives the same bits, as on AVX2, equal to the rows by design)."""
    h = PagedHarness(ck, dtype=dtype, numerics="fast")
    if fused:
        assert h.model.native_decoder.tile_attention
        h.model.native_decoder.tile_min_rows = tile_min_rows
    else:
        h.model.native_decoder = None
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 20000) for _ in range(n)] for n in (70, 93, 33, 140, 57)]
    mixed = torch.cat(h.mixed_batch(prompts))
    chunked = h.chunked(prompts[3], h.new_table(140), [37, 50, 13, 40])
    return torch.cat([mixed, chunked]).float()


@needs_tiles
def test_prefill_chunks_attended_on_tiles_match_the_per_op_path(wide_head_checkpoint):
    tiles = _tile_run(wide_head_checkpoint, torch.bfloat16, True)
    rows = _tile_run(wide_head_checkpoint, torch.bfloat16, True, tile_min_rows=10**9)
    per_op = _tile_run(wide_head_checkpoint, torch.bfloat16, False)
    reference = _tile_run(wide_head_checkpoint, torch.float32, False)
    if "avx512_bf16" not in native.compiled_isa:  # AVX2's row groups sum each query's keys as a decode does
        assert torch.equal(tiles, rows)
    else:
        assert not torch.equal(tiles, rows), "the chunks must have taken the tile path"
    assert rel_err(tiles, per_op) <= 2e-2
    assert rel_err(tiles, reference) <= 1.25 * rel_err(per_op, reference) + 1e-3


@needs_tiles
def test_invariant_chunks_attend_as_their_rows_would_decode(wide_head_checkpoint):
    """Under the batch-invariant numerics a prefill chunk's rows attend together (row groups) and still get the
    bits each would get as a decode: uneven chunks, partial groups, odd key counts, and (Gemma, window 40)
    groups a window passes through, against the same tokens decoded one by one."""
    rng = random.Random(2)
    prompt = [rng.randrange(3, 20000) for _ in range(140)]
    chunked = PagedHarness(wide_head_checkpoint, dtype=torch.bfloat16)
    assert chunked.model.native_decoder.tile_attention  # the chunks are passed to be attended together
    alone = PagedHarness(wide_head_checkpoint, dtype=torch.bfloat16)
    a = chunked.chunked(prompt, chunked.new_table(140), [37, 50, 13, 40])
    b = alone.decode_each(prompt, alone.new_table(140))
    assert torch.equal(a, b)


@needs_tiles
def test_chunks_on_tiles_do_not_count_against_the_row_attention_limit(wide_head_checkpoint):
    h = PagedHarness(wide_head_checkpoint, dtype=torch.bfloat16, numerics="fast")
    decoder = h.model.native_decoder
    x = torch.zeros(65, wide_head_checkpoint.config.hidden_size, dtype=torch.bfloat16)
    table = torch.zeros(37, dtype=torch.int64)
    hit = AttentionMetadata(slot_mapping=torch.zeros(65, dtype=torch.int64), num_decode_tokens=1,
                            prefills=[PrefillChunk(1, 64, 576, table)])  # 64 new tokens over a 512-token prefix
    decoder.max_attention_keys = 1000
    assert decoder.applies(x, hit, h.runner.kv_caches)
    decoder.tile_min_rows = 65
    assert not decoder.applies(x, hit, h.runner.kv_caches)


def test_auto_dtype_is_bf16_where_the_fused_decoder_will_serve(checkpoint, monkeypatch):
    """On a CPU without bf16 arithmetic, "auto" is bfloat16 only for a model the fused decoder will run
    (its GEMMs widen bf16 weights in registers); anything else stays float32, torch's faster CPU dtype there."""
    from dataclasses import replace

    from kvserve.kernels import isa
    from kvserve.models.backend import fused_decoder_would_serve, plan, resolve_dtype

    cpu = torch.device("cpu")
    monkeypatch.setattr(isa, "native_bf16", lambda: False)
    assert resolve_dtype("auto", cpu, fused=True) == torch.bfloat16
    assert resolve_dtype("auto", cpu, fused=False) == torch.float32
    assert resolve_dtype("float32", cpu, fused=True) == torch.float32  # an explicit choice wins
    config, names = checkpoint.config, set(checkpoint.tensors)
    fused = native is not None and native.fused
    assert fused_decoder_would_serve(config, names) == fused
    assert not fused_decoder_would_serve(replace(config, intermediate_size=config.intermediate_size + 8), names)
    assert not fused_decoder_would_serve(config, names | {"model.layers.0.self_attn.o_proj.bias"})
    assert fused_decoder_would_serve(config, names | {"model.layers.0.self_attn.q_proj.bias"}) == fused  # Qwen2's
    # the plan makes that choice once, with the path it implies
    the_plan = plan(config, names, device="cpu")
    assert (the_plan.dtype, the_plan.path) == ((torch.bfloat16, "cpu-fused") if fused else (torch.float32, the_plan.path))
    assert plan(config, names, device="cpu", native_decoder=False).path != "cpu-fused"


def test_the_numerics_in_force_are_planned_once_and_said(checkpoint, caplog):
    """batch_invariant (the default) holds on the fused decoder; where the path cannot give it (float32 per op)
    the plan says fast and the log says why; fast is the fused decoder without it; an unknown value is refused."""
    from kvserve.config import ConfigError, EngineConfig
    from kvserve.models.loader import plan_for

    if native is not None and native.fused:
        h = PagedHarness(checkpoint, dtype=torch.bfloat16)
        assert h.model.backend.invariant and h.model.native_decoder.invariant and h.model.native_decoder.params.invariant
        assert plan_for(checkpoint, torch.bfloat16).numerics == "batch_invariant"
        fast = plan_for(checkpoint, torch.bfloat16, numerics="fast")
        assert fast.numerics == "fast" and fast.fused
    with caplog.at_level("WARNING", logger="kvserve.models.backend"):
        assert plan_for(checkpoint, torch.float32).numerics == "fast"
    assert "numerics = batch_invariant is not available on the cpu-native path" in caplog.text
    with pytest.raises(ConfigError, match="numerics"):
        EngineConfig(model="m", numerics="exact")
