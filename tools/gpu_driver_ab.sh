#!/usr/bin/env bash
# What the sampler's NVML reads cost the job's own driver calls, measured directly
# (benchmarks/bench_driver.py), in one call of about 7 minutes on an H200: workers creating and
# destroying contexts, then allocating and freeing, each with leakcheck as shipped and with
# NVML read on nearly every tick (--nvml-share 1). Results under $OUT/bench.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT"
for op in context malloc; do
  for arm in "" "--nvml-share 1"; do
    echo "+ --op $op ${arm:-(as shipped)}"
    # shellcheck disable=SC2086  # the arm is two words
    timeout 140 python3 benchmarks/bench_driver.py --op "$op" --workers 4 --rounds 6 $arm \
      --write 2>&1 | grep -E "^round|^\| A/B|^bench_driver:|Error"
  done
done
tar czf "$OUT/bench.tgz" benchmarks/results
