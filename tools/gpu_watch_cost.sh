#!/usr/bin/env bash
# What watch(loader) costs, split (issue 3; docs/gpu-test-log.md, "Next GPU session"), in one call
# of about 7 minutes on an H200: bench_watch as in runs 19-22 (epochs of ~1.5-2 s), then with
# epochs five times longer, so that the per-epoch cost (an epoch end's few milliseconds) weighs
# less and the sampler's share stands alone. Each round shows the sampler's CPU and, of it, the
# CPU inside NVML (``nvml_cpu_s``). Results under $OUT/bench.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT"
# Limits: ~70-90 s and ~3.5-5 minutes expected; 540 s in all, under a call's 10 minutes.
# ARMS="1000:120 1000:120 1000:120" runs the short epochs three times instead.
for arm in ${ARMS:-1000:120 5000:420}; do
  batches=${arm%%:*}
  echo "+ bench_watch --batches $batches"
  timeout "${arm##*:}" python3 benchmarks/bench_watch.py --device cuda --workers 8 --batches "$batches" \
    --rounds 6 --warmup 1 --write 2>&1 | grep -E "^\| [0-9]|^\| A/B|^\| accounted|^- per|Error"
done
tar czf "$OUT/bench.tgz" benchmarks/results
