#!/usr/bin/env bash
# Continues the built-in Llama's retrieval training on a GPU (docs/builtin-model.md, "Retrieval";
# issue "A needle the policies must find"): the word-key phases, which take days of the
# development machine's two cores and minutes of a GPU. It runs the phases the digit keys needed,
# in order, each resuming the run with its own options:
#   1. short examples (64-384 tokens), 80% of the micro-batches, three quarters of them word keys,
#      half of those spelled from 2-4 random vocabulary pieces: the copy of a multi-token key;
#   2. every length up to the context, half the micro-batches, half of the keys words;
#   3. long examples (768 tokens and more), a fifth of the keys at depth 0 or 1;
#   4. the longest (1536 and more), half at the edges, at the schedule's low rate.
# Every evaluation (25 steps) saves the run and logs the run's own retrieval check; a limit
# (--minutes, or a lease's end: SIGTERM) keeps the last one. At the end, or at the limit, the last
# checkpoint is exported as DIR/builtin-llama, to be evaluated on any machine with
# `infinigen eval --task passkey --key-kind word|digits` before it replaces models/builtin-llama.
#
# Usage (on the GPU machine, from a checkout, with the corpus of tools/make_corpus.py carried):
#   tools/gpu_train_passkey.sh --corpus build/corpus --out DIR [--init models/builtin-llama]
#                              [--minutes 12] [--phases 1234] [--smoke]
# --init is the model to continue (the shipped one by default); a DIR/run from an earlier call is
# resumed instead when it exists. --smoke runs each phase for two steps on any device (a check of
# the script, not a training).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
corpus="" out="" init="$root/models/builtin-llama" minutes=12 phases=1234 smoke=0
while [ $# -gt 0 ]; do
  case "$1" in
    --corpus) corpus="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --init) init="$2"; shift 2 ;;
    --minutes) minutes="$2"; shift 2 ;;
    --phases) phases="$2"; shift 2 ;;
    --smoke) smoke=1; shift ;;
    *) echo "gpu_train_passkey: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[ -n "$corpus" ] && [ -n "$out" ] || { echo "gpu_train_passkey: --corpus and --out are required" >&2; exit 2; }
[ -f "$corpus/train.jsonl" ] || { echo "gpu_train_passkey: $corpus/train.jsonl is missing (tools/make_corpus.py)" >&2; exit 2; }
[ -f "$init/model.safetensors" ] || { echo "gpu_train_passkey: $init holds no model.safetensors" >&2; exit 2; }
[[ "$minutes" =~ ^[0-9]+$ ]] && [ "$minutes" -ge 1 ] || { echo "gpu_train_passkey: --minutes must be a whole number >= 1, got $minutes" >&2; exit 2; }
[ "$smoke" = 1 ] || python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' ||
  { echo "gpu_train_passkey: PyTorch sees no CUDA device (this script is for a GPU machine)" >&2; exit 2; }

mkdir -p "$out"
run="$out/run"
deadline=$(( $(date +%s) + 60 * minutes ))
# The shape of the built-in Llama (models/builtin-llama/config.json) and the retrieval run's rate.
common=(--family llama --kv-heads 1 --corpus "$corpus" --tokenizer "$root/configs/tokenizer"
        --run "$run" --layers 8 --hidden 256 --heads 4 --ffn 688 --context 2048 --micro-batch 8
        --batch-tokens 16384 --lr 5e-4 --warmup-steps 20 --eval-every 25 --patience 1000)

# Each phase runs to its share of the schedule's tokens (a resumed run takes the options given).
phase_tokens() {
  if [ "$smoke" = 1 ]; then echo $(( 32768 * $1 )); return; fi
  case "$1" in 1) echo 20000000 ;; 2) echo 40000000 ;; 3) echo 52000000 ;; 4) echo 56000000 ;; esac
}
phase_options() {
  echo "--max-tokens $(phase_tokens "$1")"
  case "$1" in
    1) echo " --retrieval-share 0.8 --retrieval-min-length 64 --retrieval-max-length 384 --retrieval-edge-share 0.2 --retrieval-word-share 0.75" ;;
    2) echo "--retrieval-share 0.5 --retrieval-max-length 0 --retrieval-edge-share 0.2 --retrieval-word-share 0.5" ;;
    3) echo "--retrieval-share 0.5 --retrieval-min-length 768 --retrieval-edge-share 0.2 --retrieval-word-share 0.5" ;;
    4) echo "--retrieval-share 0.5 --retrieval-min-length 1536 --retrieval-edge-share 0.5 --retrieval-word-share 0.5" ;;
  esac
}

stopped=0
for phase in $(echo "$phases" | grep -o .); do
  left=$(( deadline - $(date +%s) ))
  [ "$left" -gt 30 ] || { echo "gpu_train_passkey: time is up before phase $phase"; break; }
  echo "gpu_train_passkey: phase $phase, $left s left" | tee -a "$out/phases.log"
  # The first phase of a new run starts from --init; later ones resume the run's checkpoint.
  start=()
  [ -f "$run/checkpoint.pt" ] || start=(--init "$init")
  # shellcheck disable=SC2046
  if ! timeout --signal=TERM "$left" python3 "$root/tools/train_model.py" train "${common[@]}" \
      "${start[@]}" $(phase_options "$phase") >> "$out/train.log" 2>&1; then
    echo "gpu_train_passkey: phase $phase stopped (limit or error; see $out/train.log)" | tee -a "$out/phases.log"
    stopped=1
    break
  fi
done
if [ -f "$run/checkpoint.pt" ]; then
  python3 "$root/tools/train_model.py" export --run "$run" --which last --out "$out/builtin-llama"
  grep -h "passkey" "$out/train.log" | tail -3
fi
exit "$stopped"
