#!/usr/bin/env bash
# Runs every measurement of docs/accuracy.md: `infinigen eval` on the built-in model over the
# held-out documents of tools/make_corpus.py (windows of the model's full context, 128 tokens
# prefilled and the rest scored one decode step each), then prints the Markdown tables.
#
#   python3 tools/make_corpus.py --out build/corpus      # the held-out documents
#   cmake --workflow --preset release
#   tools/accuracy_sweeps.sh [OUT_DIR]                   # default build/accuracy; ~1 h on 2 cores
#
# INFINIGEN (default build/release/bin/infinigen), WINDOWS (default 16), MODEL (default builtin;
# builtin-llama for the Llama) and SWEEPS (default all of them; e.g. "compare cap-100 skewed") can
# be overridden.
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${INFINIGEN:-build/release/bin/infinigen}
out=${1:-build/accuracy}
windows=${WINDOWS:-16}
model=${MODEL:-builtin}
sweeps=" ${SWEEPS:-alpha compare pool ratio cap-200 cap-100 cap-50 h2o-small keys fetch-rule-batch skewed} "
shopt -s nullglob
texts=(build/corpus/heldout/*.txt)
if [ ${#texts[@]} -eq 0 ]; then
  echo "accuracy_sweeps: no held-out documents in build/corpus/heldout (run tools/make_corpus.py)" >&2
  exit 1
fi
text_args=()
for text in "${texts[@]}"; do text_args+=(--text "$text"); done
mkdir -p "$out"

source tools/sweeps.sh
run() {  # run NAME [eval options...]: one sweep into $out/NAME, when SWEEPS names it
  run_sweep "$1" "$bin" eval --model "$model" "${text_args[@]}" --max-windows "$windows" "${@:2}"
}

run alpha --policy full,infinigen --alpha 1,2,3,4,5,6,7,8,9
# H2O with the budget InfiniGen loads at alpha 4 (its share of the full KV over all layers): from
# the alpha sweep, or a run of alpha 4 alone when that sweep is not asked for.
[ -f "$out/alpha/eval.json" ] || SWEEPS=alpha4 sweeps=" alpha4 " run alpha4 --policy infinigen \
  --alpha 4
measured=$out/alpha/eval.json
[ -f "$measured" ] || measured=$out/alpha4/eval.json
budget=$(python3 -c "
import json, sys
points = [p for p in json.load(open(sys.argv[1]))['points'] if p['policy'] == 'infinigen'
          and (p['settings'].startswith('alpha 4,') or p['settings'] in ('', 'alpha 4'))]
print(round(points[0]['kv_fetched'], 3))" "$measured")
run compare --policy full,infinigen,h2o,int4 --alpha 4 --h2o-budget "$budget,0.2"
run pool --policy full,infinigen --kv-pool-limit 0,0.8 --eviction counter,lru,fifo
run ratio --policy infinigen --partial-ratio 0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1.0 \
  --partial-index-rule qk,q
# Tighter fetch caps than the default 20% of the window, and H2O at similar budgets.
for cap in 200 100 50; do
  run "cap-$cap" --policy infinigen --max-num-kv "$cap"
done
run h2o-small --policy h2o --h2o-budget 0.1,0.05
run keys --policy infinigen --partial-key-dtype f32,f16
run fetch-rule-batch --policy infinigen --fetch-rule batch
if [[ $sweeps == *" skewed "* ]]; then
  [ -d "$out/$model-skewed" ] || "$bin" skew --model "$model" --out "$out/$model-skewed"
  model="$out/$model-skewed" run skewed --policy full,infinigen --alpha 1,2,4,6
fi

for name in $sweeps; do
  [ -f "$out/$name/eval.json" ] || continue
  echo
  echo "### $name"
  echo
  if [ "$name" = compare ]; then
    python3 tools/eval_table.py "$out/$name/eval.json" --chunks
  else
    python3 tools/eval_table.py "$out/$name/eval.json"
  fi
done
