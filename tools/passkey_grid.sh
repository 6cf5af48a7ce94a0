#!/usr/bin/env bash
# Runs the passkey grid of docs/accuracy.md ("Passkey retrieval"): `infinigen eval --task passkey`
# on the built-in Llama over its default lengths (up to the context) and depths, for every policy
# and setting the comparison needs, then prints the Markdown tables (tools/eval_table.py).
#
#   cmake --workflow --preset release
#   tools/passkey_grid.sh [OUT_DIR]          # default build/passkey-grid; ~30 min on 2 cores
#
# Settings: `full` and `int4`; InfiniGen at alpha 4 with its fetch cap at 20% (the default), 10%
# and 5% of the tokens; `h2o` at the budgets those three loaded (their share of the whole KV);
# InfiniGen with its host pool capped at 80% under each eviction rule; and `full` and InfiniGen's
# three caps on the skewed model (`infinigen skew`).
#
# INFINIGEN (default build/release/bin/infinigen), MODEL (default builtin-llama), TRIALS (default
# 10 a cell: 250 a setting) and SWEEPS (default all; e.g. "full-int4 infinigen") can be overridden.
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${INFINIGEN:-build/release/bin/infinigen}
out=${1:-build/passkey-grid}
model=${MODEL:-builtin-llama}
trials=${TRIALS:-10}
sweeps=" ${SWEEPS:-full-int4 infinigen h2o pool skewed} "
mkdir -p "$out"

source tools/sweeps.sh
run() {  # run NAME [eval options...]: one sweep into $out/NAME, when SWEEPS names it
  run_sweep "$1" "$bin" eval --task passkey --model "$model" --trials "$trials" "${@:2}"
}

caps=0.2,0.1,0.05
run full-int4 --policy full,int4
run infinigen --policy infinigen --alpha 4 --max-fetch-share "$caps"
if [[ $sweeps == *" h2o "* ]]; then
  [ -f "$out/infinigen/eval.json" ] || SWEEPS=infinigen sweeps=" infinigen " run infinigen \
    --policy infinigen --alpha 4 --max-fetch-share "$caps"
  # H2O keeps the share of the whole KV that each InfiniGen cap loaded.
  budgets=$(python3 -c "
import json, sys
points = json.load(open(sys.argv[1]))['points']
print(','.join('%.3f' % p['kv_fetched'] for p in points if p['policy'] == 'infinigen'))" \
    "$out/infinigen/eval.json")
  run h2o --policy h2o --h2o-budget "$budgets"
fi
run pool --policy infinigen --alpha 4 --kv-pool-limit 0.8 --eviction counter,lru,fifo
if [[ $sweeps == *" skewed "* ]]; then
  [ -d "$out/$model-skewed" ] || "$bin" skew --model "$model" --out "$out/$model-skewed"
  model="$out/$model-skewed" run skewed --policy full,infinigen --alpha 4 --max-fetch-share "$caps"
fi

for name in $sweeps; do
  [ -f "$out/$name/eval.json" ] || continue
  echo
  echo "### $name"
  echo
  python3 tools/eval_table.py "$out/$name/eval.json"
done
