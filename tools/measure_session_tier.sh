#!/usr/bin/env bash
# Time to first token of resumed turns in one `infinigen batch` job, hot (history from the
# host-memory tier) and cold (from the session's files) side by side (docs/sessions.md, "A
# host-memory tier"). SESSIONS conversations: a first turn of TURN1 prompt tokens, then two more
# turns of TURN2 tokens each, every session's turn k before any turn k + 1; each turn generates
# GEN tokens. --session-cache holds about half the sessions and the prefetch is off, so that some
# resumed turns find their session in the tier and the others read it. Per model: a run whose
# cold reads come from the page cache (the files were written moments before, as on a serving
# machine with memory to spare); one with every session file dropped from the page cache every
# 20 ms by a process beside the job (posix_fadvise DONTNEED), so that they come from the disk;
# and one with the prefetch on (and the dropping). Token-id prompts (seeded), greedy.
#
# usage: tools/measure_session_tier.sh [BUILD_DIR]   (BUILD_DIR defaults to build/release)
set -euo pipefail

build=${1:-build/release}
bin="$build/bin/infinigen"
[[ -x "$bin" ]] || { echo "measure_session_tier: no $bin" >&2; exit 1; }
SESSIONS=${SESSIONS:-8}
TURN1=${TURN1:-1024}
TURN2=${TURN2:-64}
GEN=${GEN:-8}
work=$(mktemp -d)
dropper=""
trap '[[ -n "$dropper" ]] && kill "$dropper" 2>/dev/null; rm -rf "$work"' EXIT

python3 - "$work/job.jsonl" "$SESSIONS" "$TURN1" "$TURN2" "$GEN" <<'PY'
import json, random, sys
path, sessions, turn1, turn2, gen = sys.argv[1], *map(int, sys.argv[2:])
random.seed(31)
lines = []
for turn in range(3):
    for s in range(sessions):
        n = turn1 if turn == 0 else turn2
        line = {"custom_id": f"s{s}-t{turn}", "prompt": [random.randrange(4, 2000) for _ in range(n)],
                "max_tokens": gen, "session": f"s{s}"}
        if turn == 0:
            line["session_new"] = True
        lines.append(json.dumps(line))
open(path, "w").write("\n".join(lines) + "\n")
PY

start_dropping() {  # every file under $1 out of the page cache, every 20 ms, until killed
  python3 -c '
import os, sys, time
while True:
    for root, _, files in os.walk(sys.argv[1]):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass
    time.sleep(0.02)
' "$1" &
  dropper=$!
}

for model in builtin builtin-llama; do
  # About half the sessions: one session's files after its first turn, times SESSIONS / 2.
  probe="$work/probe"
  rm -rf "$probe"; mkdir -p "$probe/roots"
  head -1 "$work/job.jsonl" > "$probe/one.jsonl"
  "$bin" batch --model "$model" --input "$probe/one.jsonl" --output "$probe/out.jsonl" \
    --temperature 0 --session-root "$probe/roots" > /dev/null
  one=$(du -sb "$probe/roots/s0" | cut -f1)
  cache=${CACHE:-$(( one * (SESSIONS / 2) + one / 2 ))}
  for mode in page-cache disk prefetch; do
    rm -rf "$work/roots" "$work"/out*; mkdir -p "$work/roots"
    prefetch=false
    [[ $mode == prefetch ]] && prefetch=true
    [[ $mode != page-cache ]] && start_dropping "$work/roots"
    "$bin" batch --model "$model" --input "$work/job.jsonl" --output "$work/out.jsonl" \
      --temperature 0 --session-root "$work/roots" --session-cache "$cache" \
      --session-prefetch "$prefetch" --json > "$work/summary.json"
    if [[ -n "$dropper" ]]; then kill "$dropper"; wait "$dropper" 2>/dev/null || true; dropper=""; fi
    python3 - "$work/summary.json" "$model" "$mode" "$cache" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))["sessions"]
print(f"{sys.argv[2]:14} {sys.argv[3]:10} cache {int(sys.argv[4]) / 1e6:.1f} MB: "
      f"hot {s['hot_turns']} turns, TTFT {s['hot_ttft_s'] * 1e3:.1f} ms, {s['hot_bytes'] / 1e6:.1f} MB; "
      f"cold {s['cold_turns']} turns, TTFT {s['cold_ttft_s'] * 1e3:.1f} ms, {s['cold_bytes'] / 1e6:.1f} MB; "
      f"prefetched {s['tier_prefetched']} ({s['prefetch_bytes'] / 1e6:.1f} MB), "
      f"evicted {s['tier_evictions']}, bypassed {s['tier_bypassed']}, peak {s['tier_peak_bytes'] / 1e6:.1f} MB")
PY
  done
done
