#!/usr/bin/env bash
# Benchmarks on the device machine; each writes its current result over the one in
# benchmarks/results/ (names: benchmarks/results_io.py). Results under $OUT/bench.tgz.
# Usage: bash tools/gpu_bench.sh [snapshot] [start] [watch] [sweep] [control] [driver] [plugin]
# (start: `leakcheck snapshot` as a whole process beside python -c pass and nvidia-smi)
# A device call runs at most 10 minutes: the default, snapshot watch sweep, fits one call;
# `control driver` fits another.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT"
run() { local limit=$1; shift; echo "+ $*"; timeout "$limit" "$@"; echo "rc=$?"; }
# Epochs of 1000 batches, so that the per-epoch cost weighs as in real training.
watch=(python3 benchmarks/bench_watch.py --device cuda --workers 8 --batches 1000 --warmup 1 --write)
benches=${*:-snapshot watch sweep}
for bench in $benches; do
  case $bench in snapshot|start|watch|sweep|control|driver|plugin) ;;
    *) echo "gpu_bench.sh: unknown benchmark: $bench" >&2; exit 2 ;;
  esac
done
for bench in $benches; do
  case $bench in
    snapshot)
      run 80 python3 benchmarks/bench_snapshot.py --children 64 --rounds 200 --write
      run 50 python3 benchmarks/bench_snapshot.py --children 8 --rounds 200 --write ;;
    start) run 150 python3 benchmarks/bench_snapshot_start.py --rounds 60 --importtime --phases 10 --write ;;
    watch) run 150 "${watch[@]}" --rounds 6 ;;
    # The A/A check of the design: its A/B should centre on 0.
    control) run 270 "${watch[@]}" --rounds 24 --variant control ;;
    # 6 repeats (24 runs): the fewest for a 95% interval of the median (benchmarks/stats.py).
    sweep) run 240 python3 benchmarks/bench_sweep.py --workers 4 --persistent off --repeats 6 --epochs 1 --write ;;
    driver)
      for op in context malloc; do
        run 140 python3 benchmarks/bench_driver.py --op "$op" --workers 4 --rounds 6 --write
      done ;;
    plugin) run 90 python3 benchmarks/bench_plugin.py --tests 500 --rounds 3 --write ;;
  esac
done
tar czf "$OUT/bench.tgz" benchmarks/results
