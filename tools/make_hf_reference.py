#!/usr/bin/env python3
"""Reference logits for the CPU backend, computed by HF transformers (OPTForCausalLM,
LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM: whatever the checkpoint's config names).

Runs a checkpoint (one written by `infinigen make-model` or tools/make_hf_checkpoint.py, or the
built-in model) through transformers (fp32 compute on the checkpoint's weights, eager attention)
on a left-padded batch of prompts: the prefill logits at every position, then a few greedy
decode steps with the KV cache. Positions count each sequence's real tokens from its first one,
as generate() does. Writes them as a safetensors file that tests/hf_reference_test.cc compares
against (relative error <= 1e-4).

    infinigen make-model --preset opt-tiny --seed 7 --out tests/fixtures/opt-tiny
    python3 tools/make_hf_reference.py --checkpoint tests/fixtures/opt-tiny \
        --out tests/fixtures/opt-tiny-reference.safetensors
    python3 tools/make_hf_reference.py --checkpoint models/builtin \
        --out tests/fixtures/builtin-reference.safetensors

Requirements: tools/requirements.txt (torch, transformers, safetensors, numpy).
"""

import argparse
import json
import os

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

# Token ids of the prompts (the first is replaced by the model's BOS). Different lengths exercise
# left padding.
PROMPTS = [
    [2, 133, 1234, 77, 901, 45],
    [2, 600, 18, 1999, 402, 333, 12, 1500, 7, 88, 250],
    [2, 1000, 1001],
    [2, 45, 46, 47, 48, 49, 50, 51],
]
DECODE_STEPS = 5


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="HF-layout checkpoint directory")
    parser.add_argument("--out", required=True, help="output .safetensors file")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.checkpoint, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    config = model.config
    prompts = [[config.bos_token_id] + p[1:] for p in PROMPTS]

    batch = len(prompts)
    length = max(len(p) for p in prompts)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    tokens = torch.full((batch, length), pad, dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        tokens[b, length - len(prompt):] = torch.tensor(prompt)
        mask[b, length - len(prompt):] = 1

    def positions(mask):
        # Real tokens count from 0 (OPT derives its positions from the mask itself).
        if config.model_type == "opt":
            return {}
        return {"position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}

    with torch.no_grad():
        out = model(input_ids=tokens, attention_mask=mask, use_cache=True, **positions(mask))
        prefill_logits = out.logits.float()
        past = out.past_key_values
        step_tokens, step_logits = [], []
        next_tokens = prefill_logits[:, -1, :].argmax(dim=-1)
        for _ in range(DECODE_STEPS):
            step_tokens.append(next_tokens.clone())
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=torch.long)], dim=1)
            out = model(input_ids=next_tokens[:, None], attention_mask=mask,
                        past_key_values=past, use_cache=True,
                        **{k: v[:, -1:] for k, v in positions(mask).items()})
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            step_logits.append(logits)
            next_tokens = logits.argmax(dim=-1)

    first_valid = np.array([length - len(p) for p in prompts], dtype=np.int32)
    tensors = {
        "tokens": tokens.numpy().astype(np.int32),
        "first_valid": first_valid,
        "prefill_logits": prefill_logits.numpy(),
        "decode_tokens": torch.stack(step_tokens).numpy().astype(np.int32),
        "decode_logits": torch.stack(step_logits).numpy(),
    }
    metadata = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "checkpoint_config": json.dumps(config.to_dict(), sort_keys=True, default=str),
    }
    save_file(tensors, args.out, metadata=metadata)
    os.chmod(args.out, 0o644)
    print(f"wrote {args.out}: prefill {tuple(prefill_logits.shape)}, "
          f"{DECODE_STEPS} decode steps, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
