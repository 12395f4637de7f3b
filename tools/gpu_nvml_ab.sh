#!/usr/bin/env bash
# The sweep's A/B three ways in one call (under 10 minutes on an H200): the tracker as shipped,
# with NVML's per-process lists left out, and without NVML. Separates NVML's share of the
# sweep's cost (docs/gpu-test-log.md, runs 16-17). Results under $OUT/bench.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT"
for mode in full memory off; do
  echo "+ --tracker-nvml $mode"
  timeout 190 python3 benchmarks/bench_sweep.py --workers 4 --persistent off --repeats 6 \
    --epochs 1 --tracker-nvml "$mode" --write 2>&1 | grep -E "^[0-9]+ workers:|\| A/B|\| accounted"
done
tar czf "$OUT/bench.tgz" benchmarks/results
