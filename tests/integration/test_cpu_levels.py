"""The kernel and engine tests again at each CPU level below this machine's own (KVSERVE_CPU_ISA), so that
one machine shows what the other kinds show: an AMX machine runs them at AVX-512 and at AVX2, an AVX-512
machine at AVX2. Each level is a pytest process of its own: torch reads its dispatch ceilings once, when
it loads. On an AVX2-only machine there is no lower level; the main run is the AVX2 run.

Only what a level can change runs again: the numerics (kernels, forward passes, sampling, invariance). Tests
marked `isa_independent` check logic no level changes (bookkeeping, validation, the build cache) and run once,
in the main run; so does test_engine.py, whose scheduling, preemption and abort cases drive the same kernels the
native decoder, engine_tiny and batch-invariance tests run at the level. Parity with transformers runs again on the tiny models (test_model_parity_tiny: the same
forward code, both architectures, float32 as the real models' parity); the shipped models' parity
(test_parity_real), whose cost is transformers' own forward, runs in the main run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.kernels import isa

ROOT = Path(__file__).resolve().parents[2]
# Every family's parity at the level: float32 against transformers, the fused bf16 decoder against float32, a
# mixture's rows batch-invariant (the rest of that file does not depend on the CPU level).
FAMILY_TESTS = ("test_float32_logits_are_transformers", "test_the_fused_bf16_decoder_stays_near_float32",
                "test_fused_moe_rows_are_batch_invariant")
# In two parts of similar length, which two test workers run side by side (tests/conftest.py).
LEVEL_TESTS = {
    "kernels": ["tests/unit/test_cpu_kernels.py", "tests/unit/test_quant_kernels.py", "tests/unit/test_quant_model.py",
                "tests/unit/test_kv_int8.py", "tests/unit/test_native_decoder.py",
                "tests/unit/test_model_parity_tiny.py", "tests/unit/test_sampler.py"],
    "engine": ["tests/unit/test_engine_tiny.py", "tests/integration/test_batch_invariance.py",
               *(f"tests/unit/test_model_families.py::{t}" for t in FAMILY_TESTS)],
}


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("part", sorted(LEVEL_TESTS))
@pytest.mark.parametrize("level", ["avx512", "avx2"])
def test_kernel_and_engine_tests_pass_at_a_lower_level(level, part):
    if os.environ.get(isa.ENV, "native") != "native":
        pytest.skip(f"this run is itself at {isa.ENV}={os.environ[isa.ENV]}")
    if level not in isa.lower_levels():
        pytest.skip(f"{level} is not below this CPU's own level, or this CPU cannot run it")
    env = {k: v for k, v in os.environ.items() if k not in isa.TORCH_VARS and not k.startswith("PYTEST_XDIST")}
    env[isa.ENV] = level
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under two workers (make test): one thread
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-p", "no:cacheprovider", "-m", "not isa_independent",
                           *LEVEL_TESTS[part]],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=2300)
    tail = (proc.stdout[-8000:] + proc.stderr[-2000:]).strip()
    print(f"--- {isa.ENV}={level}:\n{tail[-3000:]}")
    assert proc.returncode == 0, f"at {isa.ENV}={level}:\n{tail}"
    assert f"kvserve CPU level: {level}" in proc.stdout  # the child ran at that level (its header; test_cpu_kernels checks torch and the build)
