// tests: properties of the OPT forward pass and the generation loop on synthetic weights.
#include <gtest/gtest.h>

#include "core/generation.h"
#include "core/synthetic_model.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::relative_error;

class OptModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    const ModelConfig config = load_preset("opt-tiny");
    model_ = make_model(config, synthetic_weights(config, {}, Device::Cpu), Device::Cpu).release();
  }
  static void TearDownTestSuite() { delete model_; }

  // Logits (B, n, V) of every position of a left-padded batch, fp32 KV.
  static Tensor all_logits(const std::vector<std::vector<int32_t>>& prompts) {
    std::vector<int32_t> first_valid;
    const std::vector<int32_t> tokens = left_pad(prompts, 1, &first_valid);
    KvCache cache(model_->config(), static_cast<int64_t>(prompts.size()),
                  static_cast<int64_t>(tokens.size() / prompts.size()), DType::F32, Device::Cpu);
    return model_->prefill(tokens, first_valid, cache, true);
  }

  static Model* model_;
};
Model* OptModelTest::model_ = nullptr;

const std::vector<int32_t> kShort = {2, 10, 11, 12, 13};
const std::vector<int32_t> kLong = {2, 500, 600, 700, 800, 900, 1000, 1100, 1200};

TEST_F(OptModelTest, LeftPaddingDoesNotChangeResults) {
  const int64_t V = model_->config().vocab_size;
  const Tensor alone = all_logits({kShort});           // (1, 5, V)
  const Tensor batched = all_logits({kShort, kLong});  // (2, 9, V): kShort padded by 4
  for (int64_t i = 0; i < 5; ++i) {
    EXPECT_LT(relative_error(batched.data<float>() + (4 + i) * V, alone.data<float>() + i * V, V),
              1e-5)
        << "position " << i;
  }
}

TEST_F(OptModelTest, DecodeWithCacheEqualsFullRecompute) {
  const int64_t V = model_->config().vocab_size;
  const std::vector<int32_t> extra = {42, 43, 44};
  std::vector<int32_t> full = kLong;
  full.insert(full.end(), extra.begin(), extra.end());
  const Tensor reference = all_logits({full});  // (1, 12, V)

  KvCache cache(model_->config(), 1, 16, DType::F32, Device::Cpu);
  model_->prefill(kLong, {0}, cache);
  for (size_t s = 0; s < extra.size(); ++s) {
    const Tensor logits = model_->decode({extra[s]}, cache);
    const int64_t position = static_cast<int64_t>(kLong.size() + s);
    EXPECT_LT(relative_error(logits.data<float>(), reference.data<float>() + position * V, V), 1e-5)
        << "step " << s;
  }
  EXPECT_EQ(cache.length(), 12);
}

TEST_F(OptModelTest, Fp16CacheStaysCloseToFp32) {
  GenerationRequest request;
  request.prompts = {kShort, kLong};
  request.gen_len = 6;
  request.kv_dtype = DType::F32;
  const GenerationResult exact = generate(*model_, request);
  request.kv_dtype = DType::F16;
  const GenerationResult half = generate(*model_, request);
  EXPECT_EQ(exact.tokens, half.tokens);  // greedy choices survive fp16 rounding of K and V
}

TEST_F(OptModelTest, SamplingIsSeededAndTopPDegeneratesToGreedy) {
  GenerationRequest request;
  request.prompts = {kShort, kLong, kShort};
  request.gen_len = 8;
  const GenerationResult greedy = generate(*model_, request);
  EXPECT_EQ(greedy.tokens.size(), 3u);
  EXPECT_EQ(greedy.tokens[0], greedy.tokens[2]);  // same prompt, same greedy continuation
  EXPECT_EQ(greedy.tokens[0].size(), 8u);

  request.sampling = {1.0f, 1e-6f, 123};  // top-p so small that only the best token is kept
  EXPECT_EQ(generate(*model_, request).tokens, greedy.tokens);

  request.sampling = {1.5f, 0.95f, 7};
  const GenerationResult a = generate(*model_, request), b = generate(*model_, request);
  EXPECT_EQ(a.tokens, b.tokens);
  request.sampling.seed = 8;
  EXPECT_NE(generate(*model_, request).tokens, a.tokens);
}

TEST_F(OptModelTest, RequestsOutsideTheModelAreRefused) {
  GenerationRequest request;
  request.prompts = {kShort};
  request.gen_len = model_->config().max_positions;  // prompt + gen beyond the context
  EXPECT_THROW(generate(*model_, request), Error);
  request.gen_len = 4;
  request.prompts = {{}};
  EXPECT_THROW(generate(*model_, request), Error);
  request.prompts = {{2, static_cast<int32_t>(model_->config().vocab_size)}};
  EXPECT_THROW(generate(*model_, request), Error);
  request.prompts = {kShort};
  request.gen_len = 0;
  EXPECT_THROW(generate(*model_, request), Error);
  request.gen_len = 2;
  request.sampling.top_p = 0.0f;
  EXPECT_THROW(generate(*model_, request), Error);
}

TEST_F(OptModelTest, TimingsFollowFlexGenDefinitions) {
  GenerationRequest request;
  request.prompts = {kShort, kLong};
  request.gen_len = 5;
  const GenerationResult r = generate(*model_, request);
  EXPECT_GT(r.prefill_seconds, 0.0);
  EXPECT_GT(r.decode_seconds, 0.0);
  EXPECT_DOUBLE_EQ(r.throughput(), 2.0 * 5.0 / (r.prefill_seconds + r.decode_seconds));
  EXPECT_DOUBLE_EQ(r.decode_throughput(), 2.0 * 4.0 / r.decode_seconds);
  EXPECT_EQ(r.prompt_len, 9);
}

}  // namespace
}  // namespace infinigen
