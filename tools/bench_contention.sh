#!/usr/bin/env bash
# The CPU backend on a machine it shares: a run's wall time with the machine idle and with BUSY
# other CPU-bound processes, for the default team (sized to the cores others leave free,
# core/cpu_threads.h), a team fixed at every core (--threads N, the old default) and OpenMP's
# passive wait policy. Prints a Markdown table of medians (docs/benchmarks/cpu-contention.md).
#
#   tools/bench_contention.sh [--bin build/release/bin/infinigen] [--runs 7] [--busy 2] [-- RUN ARGS]
#
# The run is `infinigen run` with RUN ARGS (default: the built-in model's default run, greedy).
# Run it on an otherwise quiet machine: the busy processes are the only load it means to measure.
set -euo pipefail

bin=build/release/bin/infinigen
runs=7
busy=2
while [[ $# -gt 0 ]]; do
  case $1 in
    --bin) bin=$2; shift 2 ;;
    --runs) runs=$2; shift 2 ;;
    --busy) busy=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "bench_contention.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
run_args=("$@")
[[ ${#run_args[@]} -gt 0 ]] || run_args=(--temperature 0)
[[ -x $bin ]] || { echo "bench_contention.sh: no binary at $bin (build it first)" >&2; exit 2; }
cores=$(nproc)

busy_pids=()
start_busy() {
  for ((i = 0; i < busy; ++i)); do
    sh -c 'while :; do :; done' &
    busy_pids+=($!)
  done
  sleep 1
}
stop_busy() {
  if [[ ${#busy_pids[@]} -gt 0 ]]; then
    kill "${busy_pids[@]}" 2>/dev/null || true
    wait "${busy_pids[@]}" 2>/dev/null || true  # 143: ended by our SIGTERM
  fi
  busy_pids=()
}
trap stop_busy EXIT

# Median wall seconds of `runs` runs of the binary under the given environment and flags.
median_seconds() {
  local times=()
  for ((r = 0; r < runs; ++r)); do
    local t0 t1
    t0=$(date +%s.%N)
    env "$@" >/dev/null
    t1=$(date +%s.%N)
    times+=("$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')")
  done
  printf '%s\n' "${times[@]}" | sort -g | awk '{a[NR] = $1} END {printf "%.2f", a[int((NR + 1) / 2)]}'
}

declare -A setting=(
  [default]="$bin run ${run_args[*]}"
  [fixed]="$bin run --threads $cores ${run_args[*]}"
  [passive]="OMP_WAIT_POLICY=passive $bin run ${run_args[*]}"
)
labels=(default fixed passive)
names=([0]="default (team sized to free cores)" [1]="--threads $cores (every core, the old default)" [2]="OMP_WAIT_POLICY=passive")

declare -A idle loaded
for s in "${labels[@]}"; do
  # shellcheck disable=SC2086
  idle[$s]=$(median_seconds ${setting[$s]})
done
start_busy
for s in "${labels[@]}"; do
  # shellcheck disable=SC2086
  loaded[$s]=$(median_seconds ${setting[$s]})
done
stop_busy

echo "median of $runs runs, $cores cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
echo "run: infinigen run ${run_args[*]}"
echo
echo "| setting | idle (s) | beside $busy busy processes (s) |"
echo "|---|---:|---:|"
for i in "${!labels[@]}"; do
  s=${labels[$i]}
  echo "| ${names[$i]} | ${idle[$s]} | ${loaded[$s]} |"
done
