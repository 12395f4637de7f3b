#!/usr/bin/env bash
# Soak CI: run .ci/run N times, each on a fresh clone under a long path, optionally beside a
# busy loop on every core, to find the tests that fail only on a loaded machine or a longer
# checkout path. One line per run; exit 0 only when every run passed.
#
# Usage: tools/ci_soak.sh [-n RUNS] [--busy] [--keep] [--ref REF] [--repo PATH] [--path-len N]
#   -n RUNS      how many runs, each on its own clean clone (default 3)
#   --busy       a busy loop on every core (nproc) for the whole soak
#   --keep       keep the clones (default: each is removed after its run; logs are kept)
#   --ref REF    branch, tag or commit to clone (default: main)
#   --repo PATH  repository to clone from (default: the one holding this script)
#   --path-len N the clone's path is at least N characters long (default 160)
# Runs as CI does: CI=true, no PYTHONPATH/PYTEST_ADDOPTS/LEAKCHECK_*, no active venv.
set -euo pipefail

usage_error() {
  echo "ci_soak: $1 (see tools/ci_soak.sh --help)" >&2
  exit 2
}

runs=3
busy=0
keep=0
ref=main
repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
path_len=160
while (($#)); do
  case $1 in
    -n | --runs)
      (($# >= 2)) || usage_error "$1 needs a value"
      [[ $2 =~ ^[1-9][0-9]*$ ]] || usage_error "bad run count: '$2' (a whole number >= 1)"
      runs=$2
      shift 2
      ;;
    --busy) busy=1; shift ;;
    --keep) keep=1; shift ;;
    --ref)
      (($# >= 2)) || usage_error "$1 needs a value"
      ref=$2
      shift 2
      ;;
    --repo)
      (($# >= 2)) || usage_error "$1 needs a value"
      repo=$2
      shift 2
      ;;
    --path-len)
      (($# >= 2)) || usage_error "$1 needs a value"
      if ! [[ $2 =~ ^[1-9][0-9]{0,3}$ ]] || (($2 > 3000)); then
        usage_error "bad path length: '$2' (1..3000)"
      fi
      path_len=$2
      shift 2
      ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) usage_error "unknown argument: '$1'" ;;
  esac
done
git -C "$repo" rev-parse --git-dir > /dev/null 2>&1 || usage_error "not a git repository: '$repo'"
commit=$(git -C "$repo" rev-parse --verify --quiet "$ref^{commit}") \
  || usage_error "unknown ref in $repo: '$ref'"

work=$(mktemp -d "${TMPDIR:-/tmp}/ci-soak.XXXXXX")
busy_pids=()
run_pid=""

# NOTE [soak cleanup]: everything this script starts is ended by the PID it recorded, on a
# normal end, an error or Ctrl-C/TERM alike: the busy loops one by one, and a run still in
# progress by its process group (job control gives each background job a group led by its
# PID, so the group is .ci/run and what it started: pip, pytest and its xdist workers).
cleanup() {
  local pid
  if [[ -n $run_pid ]]; then
    kill -TERM -- "-$run_pid" 2> /dev/null || true
    wait "$run_pid" 2> /dev/null || true
    run_pid=""
  fi
  for pid in "${busy_pids[@]}"; do
    kill -TERM "$pid" 2> /dev/null || true
  done
  for pid in "${busy_pids[@]}"; do
    wait "$pid" 2> /dev/null || true
  done
  busy_pids=()
  if ((!keep)); then
    rm -rf "$work/clones"
  fi
}
trap cleanup EXIT
trap 'echo "ci_soak: interrupted" >&2; exit 130' INT TERM
set -m # each background job in its own process group (see NOTE [soak cleanup])

# A directory name long enough that the clone's path reaches path_len characters.
clones="$work/clones"
name="leakcheck-ci-soak-checkout-path"
suffix="/run-$runs"
base_len=$((${#clones} + 1 + ${#name} + ${#suffix}))
if ((base_len < path_len)); then
  name+=$(printf '%*s' $((path_len - base_len)) '' | tr ' ' x)
fi

# CI's environment, not this shell's: no venv, no test options, no leakcheck settings.
if [[ -n ${VIRTUAL_ENV:-} ]]; then
  PATH=$(tr ':' '\n' <<< "$PATH" | grep -vxF "$VIRTUAL_ENV/bin" | paste -sd: -)
  export PATH
fi
unset VIRTUAL_ENV PYTHONPATH PYTEST_ADDOPTS PYTHONHOME
while read -r var; do unset "$var"; done < <(compgen -e | grep '^LEAKCHECK_' || true)
export CI=true
# A script started in the background (`tools/ci_soak.sh &`, nohup) inherits SIGINT and SIGQUIT
# ignored, and so would every process of the run, where the tests' Ctrl-C to a child does
# nothing (5 false failures): CI's runner leaves them at their defaults.
default_signals=()
if env --default-signal=INT,QUIT true 2> /dev/null; then
  default_signals=(env "--default-signal=INT,QUIT")
fi

if ((busy)); then
  for ((core = 0; core < $(nproc); core++)); do
    bash -c 'while :; do :; done' &
    busy_pids+=("$!")
  done
fi

echo "ci_soak: $runs run(s) of $ref ($commit) from $repo, busy=$busy, logs in $work"
failed=0
for ((run = 1; run <= runs; run++)); do
  clone="$clones/$name/run-$run"
  log="$work/run-$run.log"
  mkdir -p "$(dirname "$clone")"
  git clone --quiet --no-checkout "$repo" "$clone"
  git -C "$clone" checkout --quiet --detach "$commit"
  start=$EPOCHREALTIME
  (cd "$clone" && exec "${default_signals[@]}" .ci/run) > "$log" 2>&1 &
  run_pid=$!
  status=0
  wait "$run_pid" || status=$?
  run_pid=""
  wall_s=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
  if ((status == 0)); then
    echo "run $run/$runs: pass  ${wall_s} s  (path ${#clone} chars)"
  else
    failed=$((failed + 1))
    # pytest's short summary: "FAILED tests/x.py::test_y - message" (ERROR for setup/teardown).
    ids=$(sed -n -E 's/^(FAILED|ERROR) ([^ ]+).*/\1 \2/p' "$log" | sort -u | paste -sd, - | sed 's/,/, /g')
    echo "run $run/$runs: FAIL  ${wall_s} s  exit $status  ${ids:-no pytest failure line (ruff, mypy or install: see log)}  log $log"
  fi
  if ((!keep)); then
    rm -rf "$clone"
  fi
done
echo "ci_soak: $((runs - failed)) of $runs run(s) passed"
((failed == 0))
