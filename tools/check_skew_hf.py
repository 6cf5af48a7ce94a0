#!/usr/bin/env python3
"""Checks with HF transformers that a skewed checkpoint computes the same logits as its source.

`infinigen skew` rotates each head's query and key projections by the same orthogonal matrix, so
every attention score, and with it every output, is unchanged in any implementation. This loads
both checkpoints with transformers' OPTForCausalLM (fp32 compute, eager attention), runs the
left-padded prompts of tools/make_hf_reference.py through both, and prints the largest relative
logit difference over the real (non-padding) positions: ||skewed - original|| / ||original||.

    infinigen make-model --preset opt-tiny --dtype f32 --seed 7 --out /tmp/opt-tiny
    infinigen skew --model /tmp/opt-tiny --out /tmp/opt-tiny-skewed
    python3 tools/check_skew_hf.py --original /tmp/opt-tiny --skewed /tmp/opt-tiny-skewed

Exits non-zero when the difference exceeds --tolerance. Requirements: tools/requirements.txt.
"""

import argparse
import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_reference import PROMPTS  # noqa: E402  (the same prompts as the CPU fixtures)


def load(directory):
    model = transformers.OPTForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--original", required=True, help="checkpoint before skewing")
    parser.add_argument("--skewed", required=True, help="output of `infinigen skew`")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest accepted relative logit difference (default 1e-4)")
    args = parser.parse_args()

    original, skewed = load(args.original), load(args.skewed)
    pad = original.config.pad_token_id
    batch, length = len(PROMPTS), max(len(p) for p in PROMPTS)
    tokens = torch.full((batch, length), pad, dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for b, prompt in enumerate(PROMPTS):
        tokens[b, length - len(prompt):] = torch.tensor(prompt)
        mask[b, length - len(prompt):] = 1

    with torch.no_grad():
        a = original(input_ids=tokens, attention_mask=mask).logits.double()
        b = skewed(input_ids=tokens, attention_mask=mask).logits.double()
    worst = 0.0
    for s, prompt in enumerate(PROMPTS):
        for i in range(length - len(prompt), length):
            diff = torch.linalg.norm(b[s, i] - a[s, i]) / torch.linalg.norm(a[s, i])
            worst = max(worst, diff.item())
    positions = sum(len(p) for p in PROMPTS)
    print(f"max relative logit difference {worst:.3e} over {positions} positions "
          f"({batch} prompts, transformers {transformers.__version__})")
    sys.exit(0 if worst <= args.tolerance else 1)


if __name__ == "__main__":
    main()
