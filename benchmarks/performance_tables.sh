#!/usr/bin/env bash
# The performance tables of docs/results.md that need a quiet host, in one run: the trainer backends' throughput
# (train_throughput.py), a device's state save (state_save.py), the fleet at 1000, 3000 and 10,000 devices
# (fleet_scale.py, every device training ~3 samples) and the profile of a 10,000-device round (fleet_scale.py
# --profile), and the same work against Flower's simulation at 2 to 3000 clients (vs_flower.py: round time, cold
# start, memory).
#
# Why one script: these ratios move with whatever else the machine runs (the round times and CPU shares of a fleet
# on a 2-core host, and which trainer backend is fastest), so they are measured together, on an idle machine, one
# after another, each benchmark alone. Before each one the script waits up to SETTLE_S seconds (default 300) for
# the host's 1-minute load to fall below 0.5, and writes the load it started at at the head of the output, so that
# a table made on a busy host says so.
#
#     benchmarks/performance_tables.sh [OUT]    (default: runs/performance-<commit>; about 2 hours on 2 cores)
#
# Each benchmark's output goes to OUT/<name>.txt (and fleet_scale's and vs_flower's figures to OUT/<name>.json);
# a benchmark that fails is reported and the next one runs. vs_flower.py makes Flower's environment
# (.venv-flower) on its first use.
set -uo pipefail
cd "$(dirname "$0")/.."
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
out="${1:-runs/performance-$commit}"
settle_s="${SETTLE_S:-300}"
mkdir -p "$out"
python=.venv/bin/python

load() { cut -d' ' -f1 /proc/loadavg; }

settle() {  # wait (at most settle_s) for the 1-minute load to fall below 0.5
  local waited=0
  while awk -v l="$(load)" 'BEGIN { exit !(l >= 0.5) }' && [ "$waited" -lt "$settle_s" ]; do
    sleep 10; waited=$((waited + 10))
  done
}

run() {  # run NAME COMMAND...: the command's output to OUT/NAME.txt, headed by what ran, when and at what load
  local name=$1; shift
  settle
  echo "[$(date -u +%FT%TZ)] $name (load $(load))"
  { echo "# commit $commit, $(date -u +%FT%TZ), $(nproc) cores, 1-minute load $(load) at the start"
    echo "\$ $*"; "$@"; } > "$out/$name.txt" 2>&1 || echo "$name failed: see $out/$name.txt"
}

run train_throughput "$python" benchmarks/train_throughput.py
run state_save "$python" benchmarks/state_save.py
run fleet_scale "$python" benchmarks/fleet_scale.py --devices 1000,3000,10000 --per-device 3 --broker mosquitto \
    --json "$out/fleet_scale.json"
# the profile of a 10,000-device round (yappi, in a run of its own: it slows what it measures)
run fleet_profile "$python" benchmarks/fleet_scale.py --devices 10000 --per-device 3 --rounds 2 --broker mosquitto \
    --profile 30
run vs_flower "$python" benchmarks/vs_flower.py --devices 2,10,200,1000,3000 --repeats 2 --json "$out/vs_flower.json"
echo "done: $out"
