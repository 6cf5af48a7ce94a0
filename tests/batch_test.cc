// tests: the parts of `infinigen batch` (docs/batch.md): per-sequence lengths, stops and samplers
// in generate(), request lines read and refused line by line, shards from flags and launcher
// environments, grouping. Jobs through the binary: batch_job_test.cc.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "apps/infinigen/batch_input.h"
#include "apps/infinigen/batch_schedule.h"
#include "apps/infinigen/batch_shard.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using cli::BatchRequest;
using cli::parse_request_line;

// ---- per-sequence settings in generate() ----

class BatchSequenceSettings : public testing_util::OptTinyTest {
 protected:
  void SetUp() override {
    OptTinyTest::SetUp();
    request_.prompts = {{2, 10, 11, 12, 13}, {2, 500, 600}, {2, 40, 41, 42, 43, 44, 45}};
    request_.gen_len = 6;
    options_.policy = "full";  // exact attention: a sequence's tokens do not depend on the others
  }
  GenerationResult generate(const GenerationRequest& request) {
    return run_offloaded(source_, request, options_, Device::Cpu).result;
  }
  OffloadOptions options_;
};

// Each sequence ends at its own length, with the tokens it has in the full-length run, and the
// steps stop when the longest is done.
TEST_F(BatchSequenceSettings, EachSequenceEndsAtItsOwnLength) {
  const GenerationResult full = generate(request_);
  request_.sequence_gen_len = {2, 4, 1};
  const GenerationResult own = generate(request_);
  EXPECT_EQ(own.gen_len, 4);  // steps 5 and 6 not run
  for (size_t b = 0; b < 3; ++b) {
    const size_t length = static_cast<size_t>(request_.sequence_gen_len[b]);
    ASSERT_EQ(own.tokens[b].size(), length);
    EXPECT_EQ(own.tokens[b],
              std::vector<int32_t>(full.tokens[b].begin(), full.tokens[b].begin() + length));
  }
  request_.sequence_gen_len = {2, 7, 1};
  testing_util::expect_error([&] { generate(request_); },
                             {"sequence 2: 7 tokens to generate, outside [1, 6]"});
}

// The stop callback sees every token, the last one too, and ends its sequence there.
TEST_F(BatchSequenceSettings, TheStopCallbackEndsASequence) {
  std::vector<int64_t> calls(3, 0);
  request_.stop = [&](int64_t b, const std::vector<int32_t>& generated) {
    ++calls[b];
    EXPECT_EQ(std::ssize(generated), calls[b]);
    return b == 1 && generated.size() == 3;
  };
  const GenerationResult result = generate(request_);
  EXPECT_EQ(result.tokens[0].size(), 6u);
  EXPECT_EQ(result.tokens[1].size(), 3u);
  EXPECT_EQ(calls, (std::vector<int64_t>{6, 3, 6}));
  request_.stop = [](int64_t, const std::vector<int32_t>&) { return true; };
  EXPECT_EQ(generate(request_).gen_len, 1);  // every sequence ended after the prefill's token
}

// A sequence's own sampler draws for it alone: identical prompts with one seed sample the same
// tokens, whatever their place in the batch; with the request-wide sampler the rows differ.
TEST_F(BatchSequenceSettings, EachSequenceSamplesWithItsOwnGenerator) {
  request_.prompts = {request_.prompts[0], request_.prompts[0], request_.prompts[0]};
  request_.gen_len = 12;
  request_.sampling = {1.0f, 1.0f, 5};
  const GenerationResult shared = generate(request_);
  EXPECT_FALSE(shared.tokens[0] == shared.tokens[1] && shared.tokens[1] == shared.tokens[2]);
  request_.sequence_sampling.assign(3, SamplingOptions{1.0f, 1.0f, 5});
  const GenerationResult own = generate(request_);
  EXPECT_EQ(own.tokens[0], own.tokens[1]);
  EXPECT_EQ(own.tokens[0], own.tokens[2]);
  request_.sequence_sampling[2].seed = 6;
  EXPECT_NE(generate(request_).tokens[2], own.tokens[0]);
}

// ---- request lines ----

TEST(BatchInput, ReadsBothFormsAndEveryPromptShape) {
  const BatchRequest openai = parse_request_line(
      R"({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m",)"
      R"( "prompt": ["x", [5, 6]], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,)"
      R"( "seed": 11, "stop": "\n", "n": 2, "logprobs": null, "echo": false}})",
      3);
  ASSERT_TRUE(openai.ok()) << openai.error;
  EXPECT_EQ(openai.line, 3);
  EXPECT_EQ(openai.custom_id, "a");
  ASSERT_EQ(openai.prompts.size(), 2u);
  EXPECT_EQ(std::get<std::string>(openai.prompts[0]), "x");
  EXPECT_EQ(std::get<std::vector<int32_t>>(openai.prompts[1]), (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(openai.max_tokens, 7);
  EXPECT_FLOAT_EQ(*openai.temperature, 0.5f);
  EXPECT_EQ(openai.seed, 11u);
  EXPECT_EQ(openai.stop, std::vector<std::string>{"\n"});
  EXPECT_EQ(openai.sequences(), 4);

  const BatchRequest plain = parse_request_line(R"({"custom_id": "b", "prompt": [1, 2, 3]})", 1);
  ASSERT_TRUE(plain.ok()) << plain.error;
  EXPECT_EQ(plain.prompts.size(), 1u);
  EXPECT_FALSE(plain.max_tokens.has_value());
}

TEST(BatchInput, RefusesEachBadLineWithItsReason) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{not json", "not JSON"},
      {"[1, 2]", "must be a JSON object"},
      {R"({"prompt": "x"})", "no custom_id"},
      {R"({"custom_id": 5, "prompt": "x"})", "custom_id must be a non-empty string"},
      {R"({"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": []}})",
       "chat requests"},
      {R"({"custom_id": "a", "messages": [{"role": "user", "content": "hi"}]})", "chat requests"},
      {R"({"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}})",
       "only /v1/completions"},
      {R"({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}})",
       "method must be POST"},
      {R"({"custom_id": "a", "prompt": "x", "max_tokens": 0})", "max_tokens must be a whole"},
      {R"({"custom_id": "a", "prompt": "x", "temperature": -1})", "temperature must be"},
      {R"({"custom_id": "a", "prompt": "x", "top_p": 1.5})", "top_p must be"},
      {R"({"custom_id": "a", "prompt": "x", "n": 0})", "n must be"},
      {R"({"custom_id": "a", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]})", "at most 4"},
      {R"({"custom_id": "a", "prompt": "x", "logprobs": 6})", "logprobs must be at most 5"},
      {R"({"custom_id": "a", "prompt": "x", "logprobs": -1})", "logprobs must be a whole"},
      {R"({"custom_id": "a", "prompt": "x", "best_of": 3})", "best_of 3"},
      {R"({"custom_id": "a", "prompt": "x", "frequency_penalty": 0.5})",
       "frequency_penalty 0.5 is not supported"},
      {R"({"custom_id": "a", "prompt": "x", "colour": "red"})", "unknown field 'colour'"},
      {R"({"custom_id": "a", "prompt": []})", "prompt must be"},
      {R"({"custom_id": "a"})", "no prompt"},
  };
  for (const auto& [text, fragment] : cases) {
    const BatchRequest request = parse_request_line(text, 9);
    EXPECT_FALSE(request.ok()) << text;
    EXPECT_NE(request.error.find(fragment), std::string::npos) << text << ": " << request.error;
    EXPECT_EQ(request.error.find('\n'), std::string::npos) << request.error;
  }
}

// ---- shards and grouping ----

cli::Shard shard_from(const std::map<std::string, std::string>& env, const std::string& flag = "",
                      std::optional<int64_t> count = std::nullopt) {
  return cli::resolve_shard(flag, count, [&](const char* name) -> const char* {
    const auto found = env.find(name);
    return found == env.end() ? nullptr : found->second.c_str();
  });
}

TEST(BatchShard, ComesFromTheFlagOrTheLauncher) {
  const auto expect = [](const cli::Shard& shard, int64_t index, int64_t count) {
    EXPECT_EQ(shard.index, index) << shard.source;
    EXPECT_EQ(shard.count, count) << shard.source;
  };
  expect(shard_from({}), 0, 1);
  expect(shard_from({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}}, "1/2"), 1, 2);
  expect(shard_from({{"SLURM_ARRAY_TASK_ID", "2"}, {"SLURM_ARRAY_TASK_COUNT", "5"}}), 2, 5);
  expect(shard_from({{"SLURM_ARRAY_TASK_ID", "7"},
                     {"SLURM_ARRAY_TASK_MIN", "1"},
                     {"SLURM_ARRAY_TASK_MAX", "9"},
                     {"SLURM_ARRAY_TASK_STEP", "2"}}),
         3, 5);
  expect(shard_from({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}}), 3, 4);
  expect(shard_from({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}), 1, 2);
  expect(shard_from({{"PMI_RANK", "0"}, {"PMI_SIZE", "8"}}), 0, 8);
  expect(shard_from({{"JOB_COMPLETION_INDEX", "5"}}, "", 6), 5, 6);
  // Shard k of 4 owns batches k, k + 4, ...
  EXPECT_TRUE(shard_from({}, "1/4").owns(9));
  EXPECT_FALSE(shard_from({}, "1/4").owns(10));

  const auto refused = [](const std::function<void()>& call, const std::string& fragment) {
    testing_util::expect_error(call, {fragment});
  };
  refused([] { shard_from({}, "2/2"); }, "shard 2 of 2 does not exist");
  refused([] { shard_from({}, "1-2"); }, "--shard must be I/N");
  refused([] { shard_from({{"JOB_COMPLETION_INDEX", "1"}}); }, "--shard-count");
  refused(
      [] {
        shard_from({{"SLURM_PROCID", "x"}, {"SLURM_NTASKS", "2"}});
      },
      "SLURM_PROCID holds 'x'");
  refused([] { shard_from({{"SLURM_ARRAY_TASK_ID", "4"}}); }, "SLURM_ARRAY_TASK_COUNT");
  refused([] { shard_from({}, "", 3); }, "JOB_COMPLETION_INDEX is not set");
}

TEST(BatchShard, RanksOfANodeTakeDifferentGpus) {
  const auto visible = [](std::map<std::string, std::string> env, int64_t gpus) {
    return cli::rank_visible_devices(
        [&](const char* name) -> const char* {
          const auto found = env.find(name);
          return found == env.end() ? nullptr : found->second.c_str();
        },
        gpus);
  };
  EXPECT_EQ(visible({}, 4), std::nullopt);
  EXPECT_EQ(visible({{"SLURM_LOCALID", "5"}}, 4), "1");
  EXPECT_EQ(visible({{"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"CUDA_VISIBLE_DEVICES", "4,6,7"}}, 0),
            "7");
  EXPECT_EQ(visible({{"LOCAL_RANK", "1"}, {"CUDA_VISIBLE_DEVICES", "3"}}, 8), std::nullopt);
}

TEST(BatchSchedule, GroupsByLengthWithoutSplittingARequest) {
  const std::vector<cli::RequestShape> shapes = {{1, 50, 4}, {2, 3, 4}, {1, 40, 4},
                                                 {3, 5, 8},  {1, 3, 2}, {1, 41, 4}};
  // One window (4 batches' worth): by length, then by max_tokens; a request that does not fit
  // starts the next batch.
  EXPECT_EQ(cli::group_requests(shapes, 4, cli::BatchOrder::ByLength),
            (std::vector<std::vector<size_t>>{{4, 1, 2}, {5, 0}, {3}}));
  EXPECT_EQ(cli::group_requests(shapes, 4, cli::BatchOrder::Arrival),
            (std::vector<std::vector<size_t>>{{0, 1, 2}, {3, 4}, {5}}));
  testing_util::expect_error([&] { cli::group_requests(shapes, 2, cli::BatchOrder::ByLength); },
                             {"a request of 3 sequences does not fit a batch of 2"});
}

// Windows of 4 batches' worth of sequences by prompt length, each regrouped by max_tokens, so
// that a batch's sequences end together: the 8 shortest prompts first, then the 4 longest.
TEST(BatchSchedule, SequencesThatEndTogetherShareABatch) {
  std::vector<cli::RequestShape> shapes;
  for (int64_t i = 0; i < 12; ++i) shapes.push_back({1, 100 + i, (i * 5) % 7 + 1});
  // max_tokens: 1, 6, 4, 2, 7, 5, 3, 1 | 6, 4, 2, 7
  EXPECT_EQ(cli::group_requests(shapes, 2, cli::BatchOrder::ByLength),
            (std::vector<std::vector<size_t>>{{0, 7}, {3, 6}, {2, 5}, {1, 4}, {10, 9}, {8, 11}}));
}

}  // namespace
}  // namespace infinigen
