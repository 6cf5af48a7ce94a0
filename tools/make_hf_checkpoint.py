#!/usr/bin/env python3
"""Writes a randomly initialised checkpoint with HF transformers itself, for reference tests of
architecture variants the engine's own generator does not make.

The default is a tiny opt-350m-style OPT: LayerNorm after each block (no final LayerNorm) and a
token embedding narrower than the model (project_in / project_out). transformers initialises
the weights (seeded) and writes config.json and model.safetensors in fp16; no tokenizer files
(the reference tests feed token ids).

    python3 tools/make_hf_checkpoint.py --out tests/fixtures/opt-tiny-post-ln
    python3 tools/make_hf_reference.py --checkpoint tests/fixtures/opt-tiny-post-ln \\
        --out tests/fixtures/opt-tiny-post-ln-reference.safetensors

Requirements: tools/requirements.txt (torch, transformers).
"""

import argparse
import pathlib

import torch
import transformers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--embed", type=int, default=32, help="word_embed_proj_dim")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--pre-norm", action="store_true", help="do_layer_norm_before = true")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = transformers.OPTConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, ffn_dim=args.ffn, max_position_embeddings=args.positions,
        word_embed_proj_dim=args.embed, do_layer_norm_before=args.pre_norm,
        activation_function="relu", enable_bias=True, pad_token_id=1, bos_token_id=2,
        eos_token_id=2, dropout=0.0, attention_dropout=0.0, tie_word_embeddings=True,
        # A larger init than OPT's 0.02 so that the tiny model's logits are far from uniform.
        init_std=0.2)
    model = transformers.OPTForCausalLM(config).half().eval()
    model.save_pretrained(args.out, safe_serialization=True)
    (args.out / "generation_config.json").unlink(missing_ok=True)
    (args.out / "model.safetensors").chmod(0o644)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters())} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
