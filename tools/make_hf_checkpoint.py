#!/usr/bin/env python3
"""Writes a randomly initialised checkpoint with HF transformers itself, for reference tests of
architectures and variants the engine's own generator does not make.

Families (--family):
  opt      a tiny opt-350m-style OPT: LayerNorm after each block (no final LayerNorm) and a token
           embedding narrower than the model (project_in / project_out);
  llama    a Llama-3-style model: grouped-query attention (6 heads, 2 KV heads), llama3 rope
           scaling, an untied LM head, no biases;
  mistral  a Mistral-style model: one KV head, an explicit head_dim wider than hidden / heads,
           a sliding window and linear rope scaling;
  qwen2    a Qwen2-style model: biases on the Q/K/V projections only, tied embeddings, a large
           rope_theta.
Shapes are deliberately unlike any preset. transformers initialises the weights (seeded, with a
larger std than a real init so that a tiny model's logits are far from uniform) and writes
config.json and model.safetensors in fp16; no tokenizer files (the reference tests feed token
ids).

    python3 tools/make_hf_checkpoint.py --family llama --out tests/fixtures/llama-tiny
    python3 tools/make_hf_reference.py --checkpoint tests/fixtures/llama-tiny \\
        --out tests/fixtures/llama-tiny-reference.safetensors

Requirements: tools/requirements.txt (torch, transformers).
"""

import argparse
import pathlib

import torch
import transformers

INIT_STD = 0.2


def opt_config(args):
    return transformers.OPTConfig(
        vocab_size=args.vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=256, max_position_embeddings=256, word_embed_proj_dim=32,
        do_layer_norm_before=False, activation_function="relu", enable_bias=True,
        pad_token_id=1, bos_token_id=2, eos_token_id=2, dropout=0.0, attention_dropout=0.0,
        tie_word_embeddings=True, init_std=INIT_STD)


def llama_config(args):
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=96, intermediate_size=160, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        attention_bias=False, mlp_bias=False, tie_word_embeddings=False, hidden_act="silu",
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=INIT_STD)


def mistral_config(args):
    return transformers.MistralConfig(
        vocab_size=args.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=24, max_position_embeddings=256,
        sliding_window=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=False,
        hidden_act="silu", pad_token_id=0, bos_token_id=1, eos_token_id=2,
        initializer_range=INIT_STD)


def qwen2_config(args):
    return transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=64, intermediate_size=144, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, rope_theta=1000000.0, use_sliding_window=False,
        tie_word_embeddings=True, hidden_act="silu", pad_token_id=0, bos_token_id=1,
        eos_token_id=2, initializer_range=INIT_STD)


FAMILIES = {"opt": (opt_config, transformers.OPTForCausalLM),
            "llama": (llama_config, transformers.LlamaForCausalLM),
            "mistral": (mistral_config, transformers.MistralForCausalLM),
            "qwen2": (qwen2_config, transformers.Qwen2ForCausalLM)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=pathlib.Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="opt")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    make_config, model_class = FAMILIES[args.family]
    model = model_class(make_config(args)).half().eval()
    model.save_pretrained(args.out, safe_serialization=True)
    (args.out / "generation_config.json").unlink(missing_ok=True)
    (args.out / "model.safetensors").chmod(0o644)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters())} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
