#!/usr/bin/env bash
# The GPU suite on the device machine: no install, no network. Results under $OUT.
# The tests run in $GPU_SUITE_PROCS pytest-xdist processes (default 4: each test starts its
# own interpreters and mostly waits on them), then the `gpu_alone` tests one at a time: they
# read device-wide state that the others' GPU work would disturb. Each test judges only its
# own job's processes, so the parallel ones do not see each other's.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LEAKCHECK_REQUIRE_GPU=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT"
{
  date -u +"%Y-%m-%d %H:%M:%S UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total,temperature.gpu,clocks.sm --format=csv
  python3 -c 'import torch, sys; print("torch", torch.__version__, "python", sys.version.split()[0])'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
started=$(date +%s)
common=(-p no:cacheprovider -q -rA --timeout="${TEST_TIMEOUT:-150}")
python3 -m pytest tests/gpu "${common[@]}" -n "${GPU_SUITE_PROCS:-4}" -m "gpu and not gpu_alone" \
  --junitxml="$OUT/gpu-junit-parallel.xml" "$@" 2>&1 | tee "$OUT/gpu-tests.log" | tail -45
python3 -m pytest tests/gpu "${common[@]}" -m "gpu_alone" -s \
  --junitxml="$OUT/gpu-junit-alone.xml" "$@" 2>&1 | tee "$OUT/gpu-tests-alone.log" | tail -15
echo "whole suite: $(( $(date +%s) - started )) s"
