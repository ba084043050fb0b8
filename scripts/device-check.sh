#!/usr/bin/env bash
# The CUDA engine on a lent GPU in one call of the device tool, in under 8 minutes (time left for a rerun):
# a random-weight model in Llama-3.1-8B's shape built directly in GPU memory (no model file, no package
# registry: the machine's own torch with CUDA and Triton, and this working tree), its decode steps at batch 1,
# 16, 64 and 256 over 1K and 4K contexts and a mixed batch (mean 1K, max 8K), a 2048-token prefill, each on the
# torch reference attention and on Triton's paged kernels; the kernel against the reference; a profiler split;
# the HBM floor, CUDA graphs against eager, FP8 weights (benchmarks/gpu_decode.py says what each figure is); then,
# on a machine with two GPUs or more, the model split over two (benchmarks/gpu_tp.py: same tokens, step times).
#   bash scripts/device-check.sh [OUT_DIR]          (the device tool: OUT_DIR defaults to $OUT)
#   PY=python3 bash scripts/device-check.sh          (the interpreter with CUDA torch: default .venv's, else python3)
# Writes OUT_DIR/gpu_decode.json, OUT_DIR/gpu_decode.md (the table), gpu_tp.json/.md, nvidia-smi.txt and device.txt.
# Smoke run without a GPU: python -m benchmarks.gpu_decode --device cpu --tiny (Triton's interpreter).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-cuda-check}}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    PY=.venv/bin/python
  else
    PY=python3
  fi
fi
mkdir -p "$OUT"

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/device.txt" || exit 1
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"
import triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name(0))
PYEOF
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

timeout 360 "$PY" -m benchmarks.gpu_decode --json "$OUT/gpu_decode.json" 2>&1 | tee "$OUT/gpu_decode.log" | tail -25
status=${PIPESTATUS[0]}
# Tensor parallelism over two GPUs where the machine has them (it says "skipped" otherwise).
timeout 100 "$PY" -m benchmarks.gpu_tp --json "$OUT/gpu_tp.json" 2>&1 | tee "$OUT/gpu_tp.log" | tail -3
exit "$status"
