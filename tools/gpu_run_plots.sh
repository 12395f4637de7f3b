#!/usr/bin/env bash
# `leakcheck run --plot` on the device machine: a clean train/val script and persistent workers
# whose GPU cache grows, each report's text and picture into docs/h200/ (also $OUT/plots.tgz).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT" docs/h200
run() {
  local name=$1; shift
  echo "+ leakcheck run --plot docs/h200/$name.png -- python $*"
  { echo "\$ leakcheck run --plot docs/h200/$name.png -- python $*"
    timeout 240 python3 -m leakcheck run --plot "docs/h200/$name.png" -- python3 "$@" 2>&1
  } > "docs/h200/$name.txt"
  echo "rc=$?"; tail -12 "docs/h200/$name.txt"
}
run run-trainval examples/train_val.py
run run-cache-leak examples/plain_persistent_cache_leak.py
tar czf "$OUT/plots.tgz" docs/h200/run-*
