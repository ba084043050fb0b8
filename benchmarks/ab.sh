#!/usr/bin/env bash
# A/B two commits of kvserve on this machine, interleaved: each round starts each commit's server afresh and
# drives it with the same client (this checkout's `kvserve bench serve`). Workloads (WORKLOADS, default
# "W1 W3"): W1 (random 256-token prompts, 128 out, many in flight), W2 (the same one at a time), W3's flood
# (16 batch streams + 1 interactive chat a second, 40 s). MODEL is SmolLM2 (default) or a random-weight shape
# (benchmarks.shapes, e.g. llama-1b.Q8_0: written if missing), with benchmarks.suite's request counts.
# For changes too small for a full `make bench` session: say the result as ratios of medians, with the machine.
#   [MODEL=llama-1b.Q8_0] [WORKLOADS="W1 W2"] bash benchmarks/ab.sh BASE_REV [HEAD_REV|WORKTREE] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: benchmarks/ab.sh BASE_REV [HEAD_REV] [ROUNDS]}; HEAD=${2:-WORKTREE}; ROUNDS=${3:-3}
MODEL=${MODEL:-smollm2-135m}; WORKLOADS=${WORKLOADS:-W1 W3}
PY=${PY:-$PWD/.venv/bin/python}
OUT=${OUT:-$PWD/bench_results/ab-$(date -u +%Y%m%dT%H%M%S)}; mkdir -p "$OUT"
tree() {  # a checkout of $1 (the working tree for WORKTREE); removed again at exit
  if [ "$1" = WORKTREE ]; then echo "$PWD"; return; fi
  local dir="$OUT/tree-$(git rev-parse --short "$1")"
  [ -d "$dir" ] || git worktree add -f --detach "$dir" "$1" >/dev/null
  echo "$dir"
}
BASE_TREE=$(tree "$BASE"); HEAD_TREE=$(tree "$HEAD")
cleanup() {
  for dir in "$BASE_TREE" "$HEAD_TREE"; do
    [ "$dir" = "$PWD" ] || git worktree remove --force "$dir" 2>/dev/null || true
  done
}
trap cleanup EXIT
# The model's served id, its file and its W1/W2 sizes: "<id> <source> <w1 prompts> <w1 concurrency> <w2 prompts>".
read -r MODEL_ID SOURCE W1_N W1_C W2_N < <("$PY" - "$MODEL" <<'PYEOF'
import sys
from benchmarks.suite import SIZES, SMOLLM2
from benchmarks.targets import SMOLLM2_SOURCE
from benchmarks import shapes
name = sys.argv[1]
if name == SMOLLM2:
    model_id, source, sizes = SMOLLM2, SMOLLM2_SOURCE, SIZES[SMOLLM2]
else:
    model = shapes.ShapeModel.parse(name)
    model_id, sizes = model.model_id, SIZES[model.shape]
    source = shapes.make(model.shape, model.quant, log=lambda m: print(m, file=sys.stderr))
print(model_id, source, sizes.w1_prompts, sizes.w1_concurrency, sizes.w2_prompts)
PYEOF
)
# A shape's 256-token prefill on 2 cores outlasts the default queue bounds: no request is refused in a W1/W2 run.
cat > "$OUT/models.toml" <<TOML
[server]
host = "127.0.0.1"
[[models]]
id = "$MODEL_ID"
source = "$SOURCE"
role = "fast"
interactive = {max_ttft_s = inf, max_queue_wait_s = inf, queue_timeout_s = inf}
TOML
run_one() {  # tree label round
  local tree=$1 label=$2 round=$3 port
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local home="$OUT/home-$label"; mkdir -p "$home"
  (cd /tmp && PYTHONPATH=$tree KVSERVE_HOME=$home exec "$PY" -m kvserve.cli serve --config "$OUT/models.toml" \
     --port "$port" > "$OUT/server-$label-$round.log" 2>&1) &
  local pid=$!
  for _ in $(seq 1 900); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 1; done
  local common=(--base-url "http://127.0.0.1:$port" --model "$MODEL_ID" --tokenizer smollm2-135m
                --priority-style string --ignore-eos)
  local key; key=$(cat "$home/dev-token")
  for w in $WORKLOADS; do
    case $w in
      W1) args=(--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts "$W1_N"
                --max-concurrency "$W1_C" --seed $((100 + round))) ;;
      W2) args=(--dataset-name random --random-input-len 256 --random-output-len 128 --num-prompts "$W2_N"
                --max-concurrency 1 --seed $((200 + round))) ;;
      W3) args=(--duration 40 --goodput-ttft-ms 1000 --seed $((300 + round))
                --mix 'batch:concurrency=16,input=256,output=256,drain=0;interactive:rate=1,arrival=constant,dataset=chat,input=64,output=64') ;;
      *) echo "unknown workload $w" >&2; exit 2 ;;
    esac
    KVSERVE_API_KEY=$key "$PY" -m kvserve.cli bench serve "${common[@]}" "${args[@]}" \
       --result-file "$OUT/$w-$label-$round.json" > "$OUT/$w-$label-$round.log" 2>&1
  done
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
for round in $(seq 0 $((ROUNDS - 1))); do
  if [ $((round % 2)) -eq 0 ]; then  # alternate which commit runs first
    run_one "$BASE_TREE" base "$round"; run_one "$HEAD_TREE" head "$round"
  else
    run_one "$HEAD_TREE" head "$round"; run_one "$BASE_TREE" base "$round"
  fi
done
"$PY" - "$OUT" "$MODEL" <<'PYEOF'
import glob, json, statistics, sys
out, model = sys.argv[1:]
def runs(workload, label):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{workload}-{label}-*.json"))]
rows = [("W1 output tok/s", "W1", lambda d: d["output_throughput"]),
        ("W1 TTFT p50 (ms)", "W1", lambda d: d["p50_ttft_ms"]),
        ("W1 TPOT p50 (ms)", "W1", lambda d: d["p50_tpot_ms"]),
        ("W2 TTFT p50 (ms)", "W2", lambda d: d["p50_ttft_ms"]),
        ("W2 TPOT p50 (ms)", "W2", lambda d: d["p50_tpot_ms"]),
        ("W3 interactive TTFT p50 (ms)", "W3", lambda d: d["tiers"]["interactive"]["p50_ttft_ms"]),
        ("W3 interactive TTFT p99 (ms)", "W3", lambda d: d["tiers"]["interactive"]["p99_ttft_ms"]),
        ("W3 batch streamed tok/s", "W3", lambda d: d["tiers"]["batch"]["streamed_output_throughput"])]
print(f"{model}\n\n| measure | base (each run) | head (each run) | head / base, medians |\n|---|---|---|---|")
for name, w, get in rows:
    b, h = [get(d) for d in runs(w, "base")], [get(d) for d in runs(w, "head")]
    if b and h:
        fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
        print(f"| {name} | {fmt(b)} | {fmt(h)} | {statistics.median(h) / statistics.median(b):.2f} |")
PYEOF
echo "results: $OUT"
