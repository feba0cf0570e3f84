#!/usr/bin/env bash
# Runs the default test suite (`python3 -m pytest -q` plus any arguments) while CPU-bound background
# processes compete for the cores, as on a busy CI machine; prints each run's wall time and pytest exit code.
#
#   bash scripts/stress_suite.sh                       # the whole suite once, under 2 busy loops
#   bash scripts/stress_suite.sh --runs 3              # three times in a row
#   bash scripts/stress_suite.sh --load 0 --runs 1     # quiet machine (no background load)
#   bash scripts/stress_suite.sh --runs 2 tests/test_queue_bound.py -x   # anything else goes to pytest
#
# Exit status: 0 if every run passed, else the exit code of the last failing run. The background
# processes are killed on any exit; Ctrl-C interrupts pytest (which cleans up its swarms) and ends the runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

runs=1
load=2
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --runs) runs=$2; shift 2 ;;
        --runs=*) runs=${1#*=}; shift ;;
        --load) load=$2; shift 2 ;;
        --load=*) load=${1#*=}; shift ;;
        --) shift; args+=("$@"); break ;;
        *) args+=("$1"); shift ;;
    esac
done
case "$runs$load" in *[!0-9]*) echo "usage: $0 [--runs N] [--load K] [pytest args...]" >&2; exit 2 ;; esac

busy=()
cleanup() {
    # Only the processes this script started, by pid.
    for pid in "${busy[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${busy[@]}"; do wait "$pid" 2>/dev/null; done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for _ in $(seq 1 "$load"); do
    "$PY" -c 'while True: pass' &
    busy+=($!)
done
echo "stress_suite: ${#busy[@]} CPU-bound background processes (pids ${busy[*]:-none}) on $(nproc) cores"

status=0
summary=()
for run in $(seq 1 "$runs"); do
    echo "=== stress_suite run $run/$runs: $PY -m pytest -q ${args[*]:-}"
    t0=$(date +%s%N)
    "$PY" -m pytest -q "${args[@]}"
    rc=$?
    ds=$(( ($(date +%s%N) - t0) / 100000000 ))  # tenths of a second
    line=$(printf "run %d/%d: pytest exit code %d, wall %d.%d s (%d min %d s)" "$run" "$runs" "$rc" \
        $((ds / 10)) $((ds % 10)) $((ds / 600)) $((ds / 10 % 60)))
    echo "=== stress_suite $line"
    summary+=("$line")
    [ "$rc" -ne 0 ] && status=$rc
    [ "$rc" -eq 2 ] && break  # pytest was interrupted (Ctrl-C): no further runs
done
echo "=== stress_suite summary (background load: ${#busy[@]} processes)"
printf '    %s\n' "${summary[@]}"
exit "$status"
