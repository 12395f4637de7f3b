#!/usr/bin/env bash
# Attribution evidence on the device machine: the default sweep N times in a row (each
# worker's epoch peak against its own report), the persistent-cache sweep for the README,
# and the watch() cost benchmark. Results under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/leakcheck-out}; mkdir -p "$OUT" docs/h200
runs=${RUNS:-5}
for i in $(seq 1 "$runs"); do
  plot=(); [ "$i" = 1 ] && plot=(--plot docs/h200/sweep-clean.png)
  timeout 120 python3 -m leakcheck sweep --json "$OUT/sweep-$i.json" "${plot[@]}" \
    > "$OUT/sweep-$i.txt" 2>/dev/null; echo "sweep $i rc=$?"
done
cp "$OUT/sweep-1.txt" docs/h200/sweep-clean.txt
python3 benchmarks/sweep_attribution.py "$OUT"/sweep-*.json --write "$OUT/attribution.md"
timeout 90 python3 -m leakcheck sweep --scenario persistent-cache --persistent --workers 0,4 \
  --plot docs/h200/sweep-persistent-cache.png > docs/h200/sweep-persistent-cache.txt 2>/dev/null
echo "persistent-cache rc=$?"; tail -12 docs/h200/sweep-persistent-cache.txt
timeout 100 python3 benchmarks/bench_watch.py --device cuda --workers 8 --batches 1000 \
  --warmup 1 --rounds ${WATCH_ROUNDS:-2} --write 2>&1 | tail -25
cp benchmarks/results/watch-h200.* "$OUT/" 2>/dev/null
tar czf "$OUT/h200.tgz" docs/h200
