#!/usr/bin/env bash
# Runs every fuzz target of the `fuzz` preset (or the TARGETs named) for SECONDS each (default
# 600), one after another, and prints each target's executions, then the total. Resumable: each target starts from the
# committed corpus plus everything it found in earlier runs (build/fuzz/tests/fuzz/found/NAME).
# A crashing input is written to build/fuzz/tests/fuzz/crashes/NAME/ and that target stops.
#
#   cmake --workflow --preset fuzz && nice tools/fuzz_long.sh 600 [TARGET...]
set -euo pipefail

seconds=${1:-600}
shift || true
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$root/build/fuzz/bin
work=$root/build/fuzz/tests/fuzz
logs=$work/logs
mkdir -p "$logs"
[ -d "$bin" ] || { echo "fuzz_long: $bin is missing; build it with: cmake --workflow --preset fuzz" >&2; exit 1; }

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  for target in "$bin"/*_fuzz; do targets+=("$(basename "$target")"); done
fi

total=0
for name in "${targets[@]}"; do
  target=$bin/$name
  [ -x "$target" ] || { echo "fuzz_long: no fuzz target $target" >&2; exit 1; }
  mkdir -p "$work/found/$name" "$work/crashes/$name"
  log=$logs/$name.log
  status=ok
  "$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$work/crashes/$name/" "$work/found/$name" "$root/tests/fuzz/corpus/$name" \
    >"$log" 2>&1 || status="FAILED (see $log)"
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  runs=${runs:-0}
  total=$((total + runs))
  printf '%-24s %12s executions in %s s  %s\n' "$name" "$runs" "$seconds" "$status"
done
printf '%-24s %12s executions\n' total "$total"
