#!/usr/bin/env bash
# The sweep's A/B three ways in one call (about 7 minutes on an H200; each arm takes 130-140 s):
# leakcheck as shipped (NVML reads paced to 0.5% of the time by their CPU time, NOTE [nvml
# pacing]), NVML read on nearly every tick whatever it costs (the behaviour before pacing), and
# a tracker without NVML. Separates NVML's share of the sweep's cost (docs/gpu-test-log.md,
# runs 16-20). Results under $OUT/bench.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT"
for arm in "" "--nvml-share 1" "--tracker-nvml off"; do
  echo "+ ${arm:-as shipped}"
  # shellcheck disable=SC2086  # the arm is two words
  timeout 180 python3 benchmarks/bench_sweep.py --workers 4 --persistent off --repeats 6 \
    --epochs 1 $arm --write 2>&1 | grep -E "^[0-9]+ workers:|\| A/B|\| accounted|^\| 4 workers \| [0-9]"
done
tar czf "$OUT/bench.tgz" benchmarks/results
