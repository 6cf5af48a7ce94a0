#!/usr/bin/env python3
"""The perplexity HF transformers gives on the windows `infinigen eval` scores.

Cuts the text into the same windows as the engine (BOS, then window - 1 consecutive tokens, back
to back from the text's start; tokens from the `tokenizers` package with the checkpoint's
vocab.json and merges.txt), runs OPTForCausalLM over each whole window (fp32 compute on the
checkpoint's weights) and scores the tokens after the first --prefill of each window, exactly the
tokens the engine scores one decode step at a time. Writes a JSON fixture that
tests/eval_test.cc compares `infinigen eval --policy full` with (within 0.5%).

    python3 tools/make_hf_perplexity.py --checkpoint models/builtin \\
        --text tests/fixtures/heldout/kjv_Hosea.txt --prefill 64 --decode 192 --max-windows 4 \\
        --out tests/fixtures/builtin-perplexity.json

Requirements: tools/requirements.txt (torch, transformers, tokenizers).
"""

import argparse
import json
import math
import pathlib

import torch
import transformers
from tokenizers import ByteLevelBPETokenizer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=pathlib.Path)
    parser.add_argument("--text", required=True, type=pathlib.Path)
    parser.add_argument("--prefill", required=True, type=int)
    parser.add_argument("--decode", required=True, type=int)
    parser.add_argument("--max-windows", type=int, default=0, help="0 = every window")
    parser.add_argument("--out", required=True, type=pathlib.Path)
    args = parser.parse_args()

    tokenizer = ByteLevelBPETokenizer(str(args.checkpoint / "vocab.json"),
                                      str(args.checkpoint / "merges.txt"))
    model = transformers.OPTForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32)
    model.eval()
    bos = model.config.bos_token_id

    ids = tokenizer.encode(args.text.read_text(encoding="utf-8")).ids
    length = args.prefill + args.decode
    body = length - 1
    windows = [[bos] + ids[start:start + body] for start in range(0, len(ids) - body + 1, body)]
    if args.max_windows:
        windows = windows[:args.max_windows]
    if not windows:
        raise SystemExit(f"{args.text}: {len(ids)} tokens, shorter than a window of {length}")

    total_nll, total_tokens = 0.0, 0
    with torch.no_grad():
        for window in windows:
            tokens = torch.tensor([window])
            logits = model(input_ids=tokens).logits[0].double()
            # Position i's logits predict token i + 1; the scored tokens are [prefill, length).
            predicted = logits[args.prefill - 1:length - 1]
            targets = tokens[0, args.prefill:length]
            nll = torch.nn.functional.cross_entropy(predicted, targets, reduction="sum")
            total_nll += nll.item()
            total_tokens += len(targets)
    perplexity = math.exp(total_nll / total_tokens)
    fixture = {
        "checkpoint": args.checkpoint.name,
        "text": args.text.name,
        "prefill": args.prefill,
        "decode": args.decode,
        "windows": len(windows),
        "tokens": total_tokens,
        "perplexity": perplexity,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    args.out.write_text(json.dumps(fixture, indent=2) + "\n")
    print(f"{args.text.name}: {len(windows)} windows, perplexity {perplexity:.4f} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
