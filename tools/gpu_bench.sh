#!/usr/bin/env bash
# Benchmarks and the README's sweep outputs on the device machine. Results under $OUT/bench.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT" docs/h200
run() { echo "+ $*"; timeout "${STEP_TIMEOUT:-240}" "$@"; echo "rc=$?"; }
run python3 benchmarks/bench_snapshot.py --children 64 --rounds 200 --write
run python3 benchmarks/bench_snapshot.py --children 8 --rounds 200 --write
run python3 -m leakcheck sweep --json docs/h200/sweep-clean.json --plot docs/h200/sweep-clean.png > docs/h200/sweep-clean.txt 2>&1; tail -30 docs/h200/sweep-clean.txt
run python3 -m leakcheck sweep --scenario persistent-cache --persistent --workers 0,4 --json docs/h200/sweep-persistent-cache.json --plot docs/h200/sweep-persistent-cache.png > docs/h200/sweep-persistent-cache.txt 2>&1; tail -30 docs/h200/sweep-persistent-cache.txt
run python3 -m leakcheck sweep --scenario orphan --workers 2 --epochs 2 --json docs/h200/sweep-orphan.json > docs/h200/sweep-orphan.txt 2>&1; tail -25 docs/h200/sweep-orphan.txt
run python3 -m leakcheck sweep --no-teardown --workers 4 --epochs 2 --json docs/h200/sweep-no-teardown.json > docs/h200/sweep-no-teardown.txt 2>&1; tail -25 docs/h200/sweep-no-teardown.txt
run python3 benchmarks/bench_watch.py --device cuda --workers 8 --rounds 10 --write
run python3 benchmarks/bench_sweep.py --write
run python3 benchmarks/bench_plugin.py --tests 500 --rounds 3 --write
tar czf "$OUT/bench.tgz" benchmarks/results docs/h200
