// tests: the CPU backend against HF transformers on the same checkpoint, for every model family.
//
// Checkpoints: tests/fixtures/opt-tiny, synthetic (infinigen make-model --preset opt-tiny --seed
// 7); tests/fixtures/opt-tiny-post-ln, opt-350m's variant (LayerNorm after each block,
// project_in / project_out); tests/fixtures/{llama,mistral,qwen2}-tiny, the Llama family's three
// configs (grouped-query attention, llama3 and linear rope scaling, an explicit head_dim, a
// sliding window, Q/K/V biases, tied and untied LM heads), all initialised by transformers
// (tools/make_hf_checkpoint.py); and the built-in models (models/builtin, an OPT, and
// models/builtin-llama, a Llama with grouped-query attention, trained by tools/train_model.py). Next to each, tests/fixtures/NAME-reference.safetensors holds
// transformers' logits for a left-padded batch (tools/make_hf_reference.py). Both run fp32
// arithmetic on the same fp16 weights, so they must agree to fp32 rounding: relative error
// <= 1e-4 per position. The offloading policies that compute full attention (gpu, full, and
// infinigen selecting everything) must then pick transformers' greedy tokens too.
#include <gtest/gtest.h>

#include <cctype>
#include <cstring>
#include <filesystem>

#include "core/generation.h"
#include "core/model_loader.h"
#include "core/safetensors.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::relative_error;

constexpr double kTolerance = 1e-4;

struct Checkpoint {
  const char* name;       // the reference is tests/fixtures/<name>-reference.safetensors
  std::string directory;  // the checkpoint
};

class HfReference : public ::testing::TestWithParam<Checkpoint> {
 protected:
  void SetUp() override {
    reference_ = SafetensorsFile::open(std::string(INFINIGEN_FIXTURES_DIR) + "/" + GetParam().name +
                                       "-reference.safetensors");
    loaded_ = load_model(GetParam().directory, {});
  }
  Tensor load(const char* name) const {
    const SafetensorsEntry* entry = reference_->find(name);
    EXPECT_NE(entry, nullptr) << name;
    Tensor t = Tensor::empty(entry->shape, entry->dtype);
    std::memcpy(t.raw(), reference_->bytes(*entry), entry->nbytes);
    return t;
  }
  std::vector<int32_t> ints(const char* name) const {
    const Tensor t = load(name);
    return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
  }

  std::shared_ptr<const SafetensorsFile> reference_;
  LoadedModel loaded_;
};

TEST_P(HfReference, PrefillAndDecodeMatchTransformers) {
  Model& model = *loaded_.model;
  const int64_t V = model.config().vocab_size;
  const std::vector<int32_t> tokens = ints("tokens");
  const std::vector<int32_t> first_valid = ints("first_valid");
  const int64_t B = static_cast<int64_t>(first_valid.size());
  const int64_t n = static_cast<int64_t>(tokens.size()) / B;
  const Tensor expected_prefill = load("prefill_logits");  // (B, n, V)
  ASSERT_EQ(expected_prefill.shape(), (Shape{B, n, V}));

  KvCache cache(model.config(), B, n + 8, DType::F32, Device::Cpu);
  const Tensor prefill = model.prefill(tokens, first_valid, cache, /*all_positions=*/true);
  ASSERT_EQ(prefill.shape(), expected_prefill.shape());
  int64_t compared = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = first_valid[b]; i < n; ++i) {  // padded positions are not defined outputs
      const int64_t offset = (b * n + i) * V;
      EXPECT_LE(relative_error(prefill.data<float>() + offset,
                               expected_prefill.data<float>() + offset, V),
                kTolerance)
          << "sequence " << b << " position " << i;
      ++compared;
    }
  }
  EXPECT_GT(compared, 20);

  const std::vector<int32_t> decode_tokens = ints("decode_tokens");  // (steps, B)
  const Tensor expected_decode = load("decode_logits");              // (steps, B, V)
  const int64_t steps = expected_decode.dim(0);
  for (int64_t s = 0; s < steps; ++s) {
    const std::vector<int32_t> step(decode_tokens.begin() + s * B,
                                    decode_tokens.begin() + (s + 1) * B);
    const Tensor logits = model.decode(step, cache);
    for (int64_t b = 0; b < B; ++b) {
      EXPECT_LE(relative_error(logits.data<float>() + b * V,
                               expected_decode.data<float>() + (s * B + b) * V, V),
                kTolerance)
          << "decode step " << s << " sequence " << b;
    }
  }
}

TEST_P(HfReference, GreedyTokensMatchTransformers) {
  // The fixture's decode tokens are transformers' greedy choices: the engine must pick the same.
  const std::vector<int32_t> first_valid = ints("first_valid");
  const std::vector<int32_t> tokens = ints("tokens");
  const int64_t B = static_cast<int64_t>(first_valid.size());
  const int64_t n = static_cast<int64_t>(tokens.size()) / B;
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t b = 0; b < B; ++b) {
    prompts.emplace_back(tokens.begin() + b * n + first_valid[b], tokens.begin() + (b + 1) * n);
  }
  const std::vector<int32_t> expected = ints("decode_tokens");
  GenerationRequest request;
  request.prompts = prompts;
  request.gen_len = static_cast<int64_t>(expected.size()) / B;
  request.kv_dtype = DType::F32;
  const GenerationResult result = generate(*loaded_.model, request);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < request.gen_len; ++s) {
      EXPECT_EQ(result.tokens[b][s], expected[s * B + b]) << "sequence " << b << " step " << s;
    }
  }
}

TEST_P(HfReference, OffloadedPoliciesComputingFullAttentionPickTransformersGreedyTokens) {
  const std::vector<int32_t> first_valid = ints("first_valid");
  const std::vector<int32_t> tokens = ints("tokens");
  const int64_t B = static_cast<int64_t>(first_valid.size());
  const int64_t n = static_cast<int64_t>(tokens.size()) / B;
  GenerationRequest request;
  for (int64_t b = 0; b < B; ++b) {
    request.prompts.emplace_back(tokens.begin() + b * n + first_valid[b],
                                 tokens.begin() + (b + 1) * n);
  }
  const std::vector<int32_t> expected = ints("decode_tokens");
  request.gen_len = static_cast<int64_t>(expected.size()) / B;
  request.kv_dtype = DType::F32;
  const ModelSource source = resolve_model(GetParam().directory, {});
  for (const char* policy : {"gpu", "full", "infinigen"}) {
    OffloadOptions options;
    options.policy = policy;
    // Every token within alpha, and a cap above the context: InfiniGen selects everything.
    options.speculation.alpha = 1e9;
    options.speculation.max_num_kv = 1 << 20;
    const OffloadRun run = run_offloaded(source, request, options, Device::Cpu);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t s = 0; s < request.gen_len; ++s) {
        EXPECT_EQ(run.result.tokens[b][s], expected[s * B + b])
            << policy << ": sequence " << b << " step " << s;
      }
    }
  }
}

Checkpoint fixture(const char* name) {
  return {name, (std::filesystem::path(INFINIGEN_FIXTURES_DIR) / name).string()};
}

INSTANTIATE_TEST_SUITE_P(
    Checkpoints, HfReference,
    ::testing::Values(fixture("opt-tiny"), fixture("opt-tiny-post-ln"), fixture("llama-tiny"),
                      fixture("mistral-tiny"), fixture("qwen2-tiny"),
                      Checkpoint{"builtin", std::string(INFINIGEN_SOURCE_DIR) + "/models/builtin"},
                      Checkpoint{"builtin-llama",
                                 std::string(INFINIGEN_SOURCE_DIR) + "/models/builtin-llama"}),
    [](const ::testing::TestParamInfo<Checkpoint>& param) {
      std::string name;
      bool upper = true;
      for (const char ch : std::string(param.param.name)) {  // opt-tiny-post-ln: OptTinyPostLn
        if (ch == '-') {
          upper = true;
          continue;
        }
        name += upper ? static_cast<char>(std::toupper(static_cast<unsigned char>(ch))) : ch;
        upper = false;
      }
      return name;
    });

}  // namespace
}  // namespace infinigen
