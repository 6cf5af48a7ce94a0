// tests: presets, HF config.json parsing, the refusal of unsupported OPT variants and
// generation_config.json (a checkpoint's sampling defaults).
#include "core/model_config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/generation_config.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using nlohmann::json;

json opt_125m_json() {
  return json::parse(R"({"model_type": "opt", "hidden_size": 768, "num_hidden_layers": 12,
    "num_attention_heads": 12, "ffn_dim": 3072, "vocab_size": 50272,
    "max_position_embeddings": 2048, "word_embed_proj_dim": 768, "do_layer_norm_before": true,
    "activation_function": "relu", "pad_token_id": 1, "bos_token_id": 2, "eos_token_id": 2,
    "torch_dtype": "float16", "enable_bias": true})");
}

std::string error_of(const json& j) {
  try {
    config_from_json(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ModelConfig, EveryPresetLoads) {
  const std::vector<std::string> names = preset_names();
  for (const char* expected :
       {"opt-125m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "opt-30b", "opt-66b", "opt-tiny",
        "llama-2-7b", "llama-2-13b", "llama-3.1-8b", "mistral-7b", "qwen2.5-7b", "llama-tiny"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
    EXPECT_EQ(load_preset(expected).name, expected);
  }
}

TEST(ModelConfig, ParameterCountsMatchThePublishedSizes) {
  EXPECT_NEAR(static_cast<double>(load_preset("opt-125m").num_parameters()), 125.2e6, 0.5e6);
  EXPECT_NEAR(static_cast<double>(load_preset("opt-13b").num_parameters()), 12.85e9, 0.05e9);
  EXPECT_NEAR(static_cast<double>(load_preset("opt-30b").num_parameters()), 29.97e9, 0.1e9);
  const ModelConfig c = load_preset("opt-13b");
  EXPECT_EQ(c.head_dim(), 128);
  EXPECT_EQ(c.kv_bytes_per_token(DType::F16), 2u * 40 * 5120 * 2);
}

TEST(ModelConfig, LlamaFamilyPresetsHaveThePublishedSizes) {
  EXPECT_NEAR(static_cast<double>(load_preset("llama-2-7b").num_parameters()), 6.738e9, 0.01e9);
  EXPECT_NEAR(static_cast<double>(load_preset("llama-2-13b").num_parameters()), 13.016e9, 0.01e9);
  EXPECT_NEAR(static_cast<double>(load_preset("llama-3.1-8b").num_parameters()), 8.030e9, 0.01e9);
  EXPECT_NEAR(static_cast<double>(load_preset("mistral-7b").num_parameters()), 7.248e9, 0.01e9);
  EXPECT_NEAR(static_cast<double>(load_preset("qwen2.5-7b").num_parameters()), 7.616e9, 0.01e9);
  // Grouped queries cut the KV: 2 * L * H_kv * d * 2 bytes.
  EXPECT_EQ(load_preset("llama-3.1-8b").kv_bytes_per_token(DType::F16), 2u * 32 * 8 * 128 * 2);
  EXPECT_EQ(load_preset("llama-2-7b").kv_bytes_per_token(DType::F16), 2u * 32 * 32 * 128 * 2);
  EXPECT_EQ(load_preset("qwen2.5-7b").kv_heads(), 4);
  EXPECT_TRUE(load_preset("qwen2.5-7b").qkv_bias);
  EXPECT_FALSE(load_preset("qwen2.5-7b").out_bias);
  EXPECT_EQ(load_preset("llama-3.1-8b").rope.scaling, RopeConfig::Scaling::Llama3);
}

json llama_json() {
  return json::parse(R"({"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "max_position_embeddings": 1024, "vocab_size": 1000, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": [2, 3],
    "torch_dtype": "bfloat16"})");
}

TEST(ModelConfig, LlamaFamilyKeysAndTheirRefusals) {
  const ModelConfig c = config_from_json(llama_json(), "config.json");
  EXPECT_EQ(c.family, "llama");
  EXPECT_EQ(c.kv_heads(), 2);
  EXPECT_EQ(c.head_dim(), 32);
  EXPECT_EQ(c.eos_token_id, 2);  // the first of several
  EXPECT_EQ(c.dtype, DType::BF16);
  EXPECT_EQ(config_from_json(config_to_hf_json(c), "again").num_parameters(), c.num_parameters());

  json v5 = llama_json();  // transformers 5 writes rope_parameters
  v5.erase("rope_theta");
  v5["rope_parameters"] =
      json::parse(R"({"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0})");
  const ModelConfig linear = config_from_json(v5, "config.json");
  EXPECT_EQ(linear.rope.scaling, RopeConfig::Scaling::Linear);
  EXPECT_EQ(linear.rope.theta, 500000.0);

  json mistral = llama_json();
  mistral["model_type"] = "mistral";
  mistral["sliding_window"] = 256;
  EXPECT_EQ(config_from_json(mistral, "config.json").max_positions, 256);

  json indivisible = llama_json();
  indivisible["num_key_value_heads"] = 3;
  EXPECT_NE(error_of(indivisible).find("num_key_value_heads 3 does not divide"), std::string::npos);
  json yarn = llama_json();
  yarn["rope_scaling"] = json::parse(R"({"rope_type": "yarn", "factor": 4.0})");
  EXPECT_NE(error_of(yarn).find("rope_scaling type \"yarn\""), std::string::npos);
  json gelu = llama_json();
  gelu["hidden_act"] = "gelu";
  EXPECT_NE(error_of(gelu).find("hidden_act"), std::string::npos);
  json llama3 = llama_json();
  llama3["rope_scaling"] = json::parse(R"({"rope_type": "llama3", "factor": 8.0})");
  EXPECT_NE(error_of(llama3).find("llama3 needs"), std::string::npos);
}

TEST(ModelConfig, HfJsonRoundTrips) {
  const ModelConfig c = config_from_json(opt_125m_json(), "config.json");
  EXPECT_EQ(c.hidden_size, 768);
  EXPECT_EQ(c.dtype, DType::F16);
  const ModelConfig back = config_from_json(config_to_hf_json(c), "again");
  EXPECT_EQ(back.num_parameters(), c.num_parameters());
  EXPECT_EQ(back.max_positions, 2048);
}

TEST(ModelConfig, Opt350mVariantsAreRead) {
  json opt_350m = opt_125m_json();
  opt_350m["do_layer_norm_before"] = false;  // post-LayerNorm, so no final LayerNorm
  opt_350m["word_embed_proj_dim"] = 512;     // project_in / project_out
  const ModelConfig c = config_from_json(opt_350m, "opt-350m");
  EXPECT_FALSE(c.pre_norm);
  EXPECT_FALSE(c.final_norm);
  EXPECT_EQ(c.embed_dim(), 512);
  EXPECT_EQ(config_from_json(config_to_hf_json(c), "again").embed_dim(), 512);
  // The tensors follow: a narrower embedding, the projections, no final LayerNorm.
  const ModelConfig plain = config_from_json(opt_125m_json(), "opt-125m");
  EXPECT_EQ(plain.embed_dim(), plain.hidden_size);
  EXPECT_EQ(c.num_parameters() - plain.num_parameters(),
            (512 - 768) * c.vocab_size + 2 * 512 * 768 - 2 * 768);
  json bad = opt_125m_json();
  bad["do_layer_norm_before"] = "yes";
  EXPECT_NE(error_of(bad).find("'do_layer_norm_before'"), std::string::npos);
}

// A config without model_type is read by the family its architectures name, not as OPT (which
// would refuse it for a missing ffn_dim, blaming the wrong model).
TEST(ModelConfig, ArchitecturesNameTheFamilyWhenModelTypeIsAbsent) {
  json llama = llama_json();
  llama.erase("model_type");
  llama["architectures"] = {"LlamaForCausalLM"};
  EXPECT_EQ(config_from_json(llama, "config.json").family, "llama");
  json mistral = llama;
  mistral["architectures"] = {"MistralForCausalLM"};
  mistral["sliding_window"] = 256;
  const ModelConfig m = config_from_json(mistral, "config.json");
  EXPECT_EQ(m.model_type, "mistral");
  EXPECT_EQ(m.max_positions, 256);
  json neox = llama;
  neox["architectures"] = {"GPTNeoXForCausalLM"};
  EXPECT_NE(error_of(neox).find("no model_type, and architectures names GPTNeoXForCausalLM"),
            std::string::npos)
      << error_of(neox);
  json bad = llama;
  bad["architectures"] = 3;
  EXPECT_NE(error_of(bad).find("architectures"), std::string::npos) << error_of(bad);
}

TEST(ModelConfig, UnsupportedVariantsAreRefusedByName) {
  json gelu = opt_125m_json();
  gelu["activation_function"] = "gelu";
  EXPECT_NE(error_of(gelu).find("activation_function"), std::string::npos);
  json neox = opt_125m_json();
  neox["model_type"] = "gpt_neox";
  EXPECT_NE(error_of(neox).find("model_type"), std::string::npos);
}

TEST(ModelConfig, BadValuesNameTheKey) {
  json missing = opt_125m_json();
  missing.erase("ffn_dim");
  EXPECT_NE(error_of(missing).find("'ffn_dim'"), std::string::npos);
  json negative = opt_125m_json();
  negative["num_hidden_layers"] = -3;
  EXPECT_NE(error_of(negative).find("'num_hidden_layers'"), std::string::npos);
  json indivisible = opt_125m_json();
  indivisible["num_attention_heads"] = 7;
  EXPECT_NE(error_of(indivisible).find("not divisible"), std::string::npos);
  json bad_token = opt_125m_json();
  bad_token["eos_token_id"] = 60000;
  EXPECT_NE(error_of(bad_token).find("outside the vocabulary"), std::string::npos);
}

TEST(ModelConfig, FilesAndPresetsReportWhatIsWrong) {
  testing_util::TempDir dir("config");
  EXPECT_THROW(load_hf_config(dir.str()), Error);  // no config.json
  std::ofstream(dir.path() / "config.json") << "{ not json";
  try {
    load_hf_config(dir.str());
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("config.json: not valid JSON"), std::string::npos);
  }
  try {
    load_preset("opt-7b");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown model preset 'opt-7b'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("opt-6.7b"), std::string::npos);
  }
}

std::optional<SamplingOptions> generation_config_of(const std::string& text) {
  testing_util::TempDir dir("generation-config");
  if (!text.empty()) std::ofstream(dir.path() / "generation_config.json") << text;
  return load_generation_config(dir.str());
}

std::string generation_config_error(const std::string& text) {
  try {
    generation_config_of(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(GenerationConfig, AbsentIsNulloptAndDoSampleFalseIsGreedy) {
  EXPECT_FALSE(generation_config_of("").has_value());
  const auto greedy = generation_config_of(R"({"do_sample": false, "temperature": 0.7})");
  ASSERT_TRUE(greedy.has_value());
  EXPECT_EQ(greedy->temperature, 0.0f);
  EXPECT_EQ(greedy->top_p, 1.0f);
}

TEST(GenerationConfig, DoSampleTakesTemperatureAndTopP) {
  const auto sampled = generation_config_of(R"({"do_sample": true, "temperature": 0.7,
      "top_p": 0.9, "bos_token_id": 2})");
  ASSERT_TRUE(sampled.has_value());
  EXPECT_FLOAT_EQ(sampled->temperature, 0.7f);
  EXPECT_FLOAT_EQ(sampled->top_p, 0.9f);
  const auto defaults = generation_config_of(R"({"do_sample": true})");
  EXPECT_FLOAT_EQ(defaults->temperature, 1.0f);
  EXPECT_FLOAT_EQ(defaults->top_p, 1.0f);
}

TEST(GenerationConfig, BadFilesAreOneLineErrors) {
  EXPECT_NE(generation_config_error("{not json").find("not valid JSON"), std::string::npos);
  EXPECT_NE(generation_config_error(R"({"do_sample": true, "top_p": 1.5})").find("top_p"),
            std::string::npos);
  EXPECT_NE(generation_config_error(R"({"do_sample": true, "temperature": 0})")
                .find("temperature must be positive"),
            std::string::npos);
  EXPECT_NE(generation_config_error(R"({"do_sample": "yes"})").find("wrong type"),
            std::string::npos);
  EXPECT_NE(generation_config_error("[1, 2]").find("not a JSON object"), std::string::npos);
}

}  // namespace
}  // namespace infinigen
