#!/usr/bin/env bash
# The README's and docs/PICTURES.md's H200 outputs on the device machine (text, JSON, plots) into
# docs/h200/, each text file the command and its whole output (tools/readme_outputs.py quotes them).
# Results also under $OUT/readme.tgz.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT" docs/h200
sweep() {
  local name=$1; shift
  echo "+ leakcheck sweep $*"
  { echo "\$ leakcheck sweep $*"; timeout 240 python3 -m leakcheck sweep "$@" \
    --json "docs/h200/sweep-$name.json" 2>&1; } > "docs/h200/sweep-$name.txt"
  echo "rc=$?"; tail -6 "docs/h200/sweep-$name.txt"
}
sweep clean --plot docs/h200/sweep-clean.png
sweep persistent-cache --scenario persistent-cache --persistent --workers 0,4 --plot docs/h200/sweep-persistent-cache.png
sweep orphan --scenario orphan --workers 2 --epochs 2
sweep copy-on-read --scenario copy-on-read --workers 0,4
# A process holding a 1 GiB tensor, and the snapshot beside it.
python3 -c "import torch,time; x=torch.empty(2**30,dtype=torch.uint8,device='cuda'); open('/tmp/held','w').close(); time.sleep(60)" &
holder=$!
for _ in $(seq 1 100); do [ -e /tmp/held ] && break; sleep 0.2; done
{ echo "\$ leakcheck snapshot"; python3 -m leakcheck snapshot 2>&1; } > docs/h200/snapshot.txt
kill "$holder"; rm -f /tmp/held
cat docs/h200/snapshot.txt
# `leakcheck run --plot`: a clean train/val script, and persistent workers whose GPU cache grows.
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
tar czf "$OUT/readme.tgz" docs/h200
