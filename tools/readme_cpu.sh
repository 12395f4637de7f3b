#!/usr/bin/env bash
# The README's CPU outputs, printed afresh into docs/cpu/ (run from the repository root with
# the package installed; NAMES picks some, e.g. NAMES="run-trainval pytest-demo"). Each file
# holds the command and its whole output; the README quotes them.
set -u
mkdir -p docs/cpu
out() {
  local name=$1; shift
  [[ -n "${NAMES:-}" && " $NAMES " != *" $name "* ]] && return
  echo "+ $*"; { echo "\$ $*"; "$@" 2>&1; } > "docs/cpu/$name.txt"; echo "rc=$?"
}
out sweep-clean leakcheck sweep
out sweep-copy-on-read leakcheck sweep --scenario copy-on-read --workers 0,2
# docs/FAILURES.md: each failure staged (oom and shm-full need root and a memory cgroup)
out sweep-oom leakcheck sweep --scenario oom --workers 2 --epochs 2
out sweep-shm-full leakcheck sweep --scenario shm-full --workers 2 --epochs 2
out sweep-hang leakcheck sweep --scenario hang --workers 1 --epochs 2
out sweep-fd-pressure leakcheck sweep --scenario fd-pressure --workers 2 --epochs 2
out watch-orphan python examples/grandchild_leak.py
out run-trainval leakcheck run -- python examples/train_val.py
out run-orphans leakcheck run -- python examples/shell_orphans.py
out pytest-demo python -m pytest -p no:cacheprovider --gpu-leak-check examples/test_demo.py
rm -f /dev/shm/demo_segment  # the demo leaves it on purpose
out lightning python examples/lightning_helper_leak.py
out ddp-spawn leakcheck run -- python examples/ddp_spawn_train.py --leak
out snapshot leakcheck snapshot
