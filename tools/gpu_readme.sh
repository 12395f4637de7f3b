#!/usr/bin/env bash
# The README's sweeps on the device machine (text, JSON, plots). Results under $OUT/readme.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT" docs/h200
sweep() { local name=$1; shift; echo "+ leakcheck sweep $*"; timeout 240 python3 -m leakcheck sweep "$@" \
  --json "docs/h200/sweep-$name.json" > "docs/h200/sweep-$name.txt" 2>/dev/null; echo "rc=$?"; tail -8 "docs/h200/sweep-$name.txt"; }
sweep clean --plot docs/h200/sweep-clean.png
sweep persistent-cache --scenario persistent-cache --persistent --workers 0,4 --plot docs/h200/sweep-persistent-cache.png
sweep orphan --scenario orphan --workers 2 --epochs 2
sweep no-teardown --no-teardown --workers 4 --epochs 2
sweep teardown-4workers --workers 4 --epochs 2
tar czf "$OUT/readme.tgz" docs/h200
