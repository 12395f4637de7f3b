#!/usr/bin/env bash
# Benchmarks on the device machine (one call, under 10 minutes). Results under $OUT/bench.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT"
run() { local limit=$1; shift; echo "+ $*"; timeout "$limit" "$@"; echo "rc=$?"; }
run 80 python3 benchmarks/bench_snapshot.py --children 64 --rounds 200 --write
run 50 python3 benchmarks/bench_snapshot.py --children 8 --rounds 200 --write
# Epochs of ~1.5 s (1000 batches), so that the per-epoch cost weighs as in real training.
run 150 python3 benchmarks/bench_watch.py --device cuda --workers 8 --batches 1000 --rounds 6 --warmup 1 --write
# 6 repeats (24 runs): the fewest for a 95% interval of the median (benchmarks/stats.py).
run 240 python3 benchmarks/bench_sweep.py --workers 4 --persistent off --repeats 6 --epochs 1 --write
if [ "${WITH_PLUGIN:-0}" = 1 ]; then
  run 90 python3 benchmarks/bench_plugin.py --tests 500 --rounds 3 --write
fi
tar czf "$OUT/bench.tgz" benchmarks/results
