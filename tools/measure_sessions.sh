#!/usr/bin/env bash
# Time to first token of a conversation's second turn, resumed from a session on disk vs
# recomputed from the whole history (docs/sessions.md). For each model: turn 1 has a synthetic
# prompt of TURN1 tokens and generates GEN; turn 2 adds TURN2 new tokens. "Recomputed" is one run
# whose prompt is the whole conversation (TURN1 + GEN + TURN2 tokens). Before each resumed run the
# session's files are dropped from the page cache (posix_fadvise DONTNEED), so the history comes
# from the disk. Medians of REPEATS runs; the link emulated at 12 GB/s.
#
# usage: tools/measure_sessions.sh [BUILD_DIR]   (BUILD_DIR defaults to build/release)
set -euo pipefail

build=${1:-build/release}
bin="$build/bin/infinigen"
[[ -x "$bin" ]] || { echo "measure_sessions: no $bin (cmake --preset release && cmake --build build/release)" >&2; exit 1; }
TURN1=${TURN1:-1536}
TURN2=${TURN2:-64}
GEN=${GEN:-16}
REPEATS=${REPEATS:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

drop_cache() {  # every file under $1 out of the page cache
  python3 - "$1" <<'EOF'
import os, sys
for root, _, files in os.walk(sys.argv[1]):
    for name in files:
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
EOF
}

field() {  # field PATH from the JSON on stdin, e.g. prefill_latency_s or session.read_s
  python3 -c "import json,sys; v=json.load(sys.stdin)
for k in sys.argv[1].split('.'): v=v[k]
print(v)" "$1"
}

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

common=(--policy full --emulate-link-gbps 12 --gen-len "$GEN" --json)
printf "model,batch,recomputed_ttft_s,resumed_ttft_s,history_mb,read_s,restore_wait_s,cold_read_mb_s\n"
for spec in "builtin 4" "opt-125m 4"; do
  read -r model batch <<<"$spec"
  recomputed=() resumed=() read_s=() wait_s=()
  for ((i = 0; i < REPEATS; i++)); do
    rm -rf "$work/s"
    "$bin" run --model "$model" --batch "$batch" --prompt-len "$TURN1" --session "$work/s" \
      "${common[@]}" >/dev/null
    drop_cache "$work/s"
    out=$("$bin" run --model "$model" --prompt-len "$TURN2" --resume "$work/s" "${common[@]}")
    resumed+=("$(field prefill_latency_s <<<"$out")")
    read_s+=("$(field session.read_s <<<"$out")")
    wait_s+=("$(field session.restore_wait_s <<<"$out")")
    mb=$(field session.bytes_read <<<"$out" | awk '{printf "%.1f", $1 / 1e6}')
    out=$("$bin" run --model "$model" --batch "$batch" --prompt-len $((TURN1 + GEN + TURN2)) \
      "${common[@]}")
    recomputed+=("$(field prefill_latency_s <<<"$out")")
  done
  # The disk's cold read rate, on the session's files.
  drop_cache "$work/s"
  rate=$(python3 - "$work/s" <<'EOF'
import os, sys, time
total, start = 0, time.perf_counter()
for root, _, files in os.walk(sys.argv[1]):
    for name in files:
        with open(os.path.join(root, name), "rb", buffering=0) as f:
            while chunk := f.read(1 << 20):
                total += len(chunk)
print(f"{total / 1e6 / (time.perf_counter() - start):.0f}")
EOF
)
  printf "%s,%s,%s,%s,%s,%s,%s,%s\n" "$model" "$batch" \
    "$(printf '%s\n' "${recomputed[@]}" | median)" "$(printf '%s\n' "${resumed[@]}" | median)" \
    "$mb" "$(printf '%s\n' "${read_s[@]}" | median)" "$(printf '%s\n' "${wait_s[@]}" | median)" "$rate"
done
