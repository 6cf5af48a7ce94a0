// core/models: the Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM): rotary
// positions, RMSNorm before each block, a SwiGLU feed-forward block, grouped-query attention
// (fewer K/V heads than query heads), biases only where the config asks (Qwen2's Q/K/V), and an
// LM head that is tied to the token embedding or not.
//
// config.json keys: num_key_value_heads, head_dim, rope_theta and rope_scaling (or transformers
// 5's rope_parameters; types default, linear and llama3), rms_norm_eps, hidden_act (silu only),
// attention_bias, mlp_bias, tie_word_embeddings, and a sliding window (Mistral's sliding_window,
// Qwen2's use_sliding_window), which bounds the context: within the window, attention is full
// attention. Anything else gets one line naming the key. Tensor names: "model.embed_tokens.weight",
// "model.layers.N.self_attn.q_proj.weight", ..., "model.norm.weight", "lm_head.weight" (untied).
#pragma once

#include "core/model_family.h"

namespace infinigen {

const ModelFamily& llama_family();

}  // namespace infinigen
