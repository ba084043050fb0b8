#!/usr/bin/env bash
# The CUDA path in a few minutes, on a machine with an NVIDIA GPU (the device tool lends one to some
# tasks), in under 8 minutes: the engine tests on CUDA, greedy parity with transformers, offline throughput
# (W1's shape: 64 prompts of 256 tokens, 128 out, at concurrency 32) and single-stream decode (W2's TPOT)
# for each `weights` setting and KV cache dtype (the 8-bit KV cache runs in torch there: kernels/kv_quant.py). On CUDA every setting computes from dense bf16 (the loader dequantizes: no
# torch quantized GEMM is wired in); the figures say what each setting costs there.
#   bash scripts/device-check.sh [OUT_DIR]
# It needs a CUDA build of torch 2.13.0 in $PY (default .venv/bin/python): the CPU wheel that
# `make install` pins sees no GPU. Results (the pytest log, offline.json, nvidia-smi) go to OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-cuda-check}}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
status=0

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/device.txt" || exit 1
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PYEOF
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

# device="auto" puts every engine these tests build on the GPU; the CPU-kernel tests stay on the CPU.
timeout 420 "$PY" -m pytest -q -ra -p no:cacheprovider --timeout 300 \
  tests/unit/test_engine_tiny.py tests/unit/test_sampler.py tests/integration/test_engine.py \
  tests/integration/test_parity_real.py tests/unit/test_kv_int8.py 2>&1 | tee "$OUT/pytest.log" | tail -30
status=$(( status | ${PIPESTATUS[0]} ))

timeout 300 "$PY" -m benchmarks.offline --dtype bfloat16 --runs 1 --no-hf --out "$OUT/offline.json" \
  2>&1 | tee "$OUT/offline.log" | tail -20
status=$(( status | ${PIPESTATUS[0]} ))

timeout 200 "$PY" -m benchmarks.single --models smollm2-135m,gemma3-270m --dtypes bfloat16 --weights auto,bf16 \
  --kv auto,int8 --tokens 64 --json "$OUT/single.json" 2>&1 | tee "$OUT/single.log" | tail -10
status=$(( status | ${PIPESTATUS[0]} ))
exit $status
