#!/usr/bin/env bash
# Goodput under SLO: PD (1 prefill + 1 decode) against colocated serving (2 hybrid
# engines) at equal hardware: the same preset, one torch thread per engine on the same
# two pinned cores, the same KV budget and prefill chunk (examples/bench-*.yaml).
# `pdserve bench --compare` starts each spec with `pdserve up`, alternates them
# A,B,A,B and prints PD/colocated ratios. Results: docs/benchmarks.md.
#
#   benchmarks/pd_goodput.sh [OUT_DIR]
#   benchmarks/pd_goodput.sh --real [OUT_DIR]   # SmolLM2 in bfloat16 (examples/bench-real-*.yaml)
#
# 1. the mixed workload: 8 closed-loop chat streams (32-token prompts, 128 tokens out)
#    plus a 1,800-token prompt (8 out) every 3 s; SLO derived from colocated's medians;
# 2. the same classes mixed 9:1, Poisson arrivals swept over request rates; SLO
#    derived from colocated's medians at 3 req/s.
set -euo pipefail
cd "$(dirname "$0")/.."
specs=(examples/bench-pd.yaml examples/bench-colocated.yaml)
if [[ ${1:-} == --real ]]; then
  specs=(examples/bench-real-pd.yaml examples/bench-real-colocated.yaml)
  shift
fi
out="${1:-bench-results}"
mkdir -p "$out"
bench=(.venv/bin/pdserve bench --compare "${specs[@]}" --rounds 2 --no-progress)
"${bench[@]}" --duration 40 --json "$out/mixed.json" --plot "$out/mixed" \
  --run-dir "$out/mixed-run" | tee "$out/mixed.txt"
"${bench[@]}" --rates 1,2,3,4,5 --duration 30 --slo-from 3 --json "$out/sweep.json" \
  --plot "$out/sweep" --run-dir "$out/sweep-run" | tee "$out/sweep.txt"
