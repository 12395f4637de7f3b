#!/usr/bin/env bash
# The GPU suite on the device machine: no install, no network. Results under $OUT.
# One test at a time: the residual rule judges a device's memory as a whole, so tests running
# side by side would see each other's (a run with 4 xdist processes failed 10 tests so).
# Usage: [GPU_FILES="tests/gpu/test_a.py ..."] bash tools/gpu_suite.sh [pytest args]; the
# whole tests/gpu by default, which takes longer than one device call: split it by files.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LEAKCHECK_REQUIRE_GPU=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT"
{
  date -u +"%Y-%m-%d %H:%M:%S UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,clocks.sm --format=csv
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
python3 -m pytest ${GPU_FILES:-tests/gpu} -p no:cacheprovider -q -rA --timeout="${TEST_TIMEOUT:-150}" \
  --junitxml="$OUT/gpu-junit.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -60
