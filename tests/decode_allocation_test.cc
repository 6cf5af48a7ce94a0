// tests: nothing is allocated in a decode step (issue 25). Every policy decodes in buffers
// allocated before its first decode step: the model's activations (core/activations.h), the
// LM head's logits, and what each KV policy needs; the device and pinned allocations a step makes
// are counted (core/device.h's allocation_counts) by the run's statistics and around whole steps.
#include <gtest/gtest.h>

#include "core/activations.h"
#include "core/device.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

// What a run allocated and freed in its decode steps: as its statistics count them (each step's
// KV passes, StepStats::allocations and frees), and around whole steps (the model's pass, its LM
// head and the sampling: from the first token's progress report to the last one's).
struct DecodeAllocations {
  uint64_t in_step_statistics = 0;
  uint64_t around_steps = 0;
  AllocationCounts around;  // by kind, for the failure message
  std::string per_step;     // "step 1: 2 allocations, 2 frees; ..." where any
};

std::string describe(const AllocationCounts& c) {
  return cat("cpu ", c.cpu_allocs, "/", c.cpu_frees, ", cuda ", c.cuda_allocs, "/", c.cuda_frees,
             ", pinned ", c.pinned_allocs, "/", c.pinned_frees, " (allocations/frees)");
}

DecodeAllocations decode_allocations(const ModelSource& source, const GenerationRequest& request,
                                     const OffloadOptions& options, Device device) {
  AllocationCounts first, last;
  const ProgressCallback progress = [&](int64_t done, int64_t total) {
    if (done == 1) first = allocation_counts();  // the prefill and its token are done
    if (done == total) last = allocation_counts();
  };
  const OffloadRun run = run_offloaded(source, request, options, device, progress);
  DecodeAllocations counted;
  const auto& steps = run.stats.steps();
  EXPECT_EQ(std::ssize(steps), request.gen_len);  // the prefill, then the decode steps
  for (size_t i = 1; i < steps.size(); ++i) {
    counted.in_step_statistics += steps[i].allocations + steps[i].frees;
    if (steps[i].allocations + steps[i].frees > 0) {
      counted.per_step +=
          cat("step ", i, ": ", steps[i].allocations, " allocations, ", steps[i].frees, " frees; ");
    }
  }
  counted.around = last.since(first);
  counted.around_steps = counted.around.allocs() + counted.around.frees();
  return counted;
}

// The models the runs use (kModels), synthetic and small: OPT (opt-tiny with 4 layers: InfiniGen's
// two dense layers and two speculated ones), OPT-350m's variant (post-LayerNorm, projected
// embeddings, no final norm) and the Llama family (llama-tiny: RoPE, grouped queries, SwiGLU).
const std::vector<std::string> kModels = {"opt", "opt-350m-like", "llama"};
ModelSource model_source(const std::string& model) {
  ModelSource source = resolve_model(model == "llama" ? "llama-tiny" : "opt-tiny", {});
  if (model == "llama") return source;
  source.config.num_layers = 4;
  if (model == "opt-350m-like") {
    // Wider than the model, not narrower as OPT-350m's: the synthetic generator puts outlier
    // channels anywhere in [0, D) of the token embedding (core/synthetic_model.cc), past the
    // end of a narrower one.
    source.config.word_embed_dim = 96;
    source.config.pre_norm = false;
    source.config.final_norm = false;
  }
  return source;
}

GenerationRequest small_request() {
  GenerationRequest request;
  request.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                     {2, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500}};
  request.gen_len = 6;
  return request;
}

TEST(AllocationCounts, CountDeviceAndPinnedAllocationsOnce) {
  const AllocationCounts before = allocation_counts();
  { const Tensor t = Tensor::empty({16}, DType::F32, Device::Cpu); }
  void* pinned = pinned_alloc(64, "a test buffer");
  pinned_free(pinned);
  const AllocationCounts made = allocation_counts().since(before);
  EXPECT_EQ(made.cpu_allocs, 1u);
  EXPECT_EQ(made.cpu_frees, 1u);
  // Pinned memory counts as pinned only, whatever allocator gives it.
  EXPECT_EQ(made.pinned_allocs, 1u);
  EXPECT_EQ(made.pinned_frees, 1u);
  EXPECT_EQ(made.allocs(), 2u);
  EXPECT_EQ(made.frees(), 2u);
}

TEST(ActivationBuffers, DescribeEveryBufferOfBothFamilies) {
  const ModelConfig opt = load_preset("opt-tiny");
  std::vector<std::string> names;
  for (const ActivationBuffer& b : activation_buffers(opt, 3, 5)) {
    names.emplace_back(b.name);
    EXPECT_EQ(b.shape[0], b.per_sequence ? 3 : 15) << b.name;
    EXPECT_EQ(b.dtype, DType::F32) << b.name;
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"hidden", "normed", "query", "key", "value", "attention",
                                      "ffn", "last", "final_normed", "logits"}));
  const ModelConfig llama = load_preset("llama-tiny");
  names.clear();
  size_t bytes = 0;
  for (const ActivationBuffer& b : activation_buffers(llama, 2, 4)) {
    names.emplace_back(b.name);
    bytes += b.bytes();
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"hidden", "normed", "query", "key", "value", "attention",
                                      "ffn", "ffn_up", "last", "final_normed", "logits"}));
  // D 128, H * d 128, H_kv * d 64, F 352, V 8192; 8 rows, and 2 for the head.
  EXPECT_EQ(bytes,
            4u * (8 * (128 + 128 + 128 + 64 + 64 + 128 + 352 + 352) + 2 * (128 + 128 + 8192)));
  EXPECT_EQ(activation_bytes(llama, 2, 4), bytes);
}

TEST(DecodeAllocation, EveryPolicyDecodesWithoutAllocatingOnTheCpu) {
  const GenerationRequest request = small_request();
  for (const std::string& model : kModels) {
    const ModelSource source = model_source(model);
    for (const KvPolicy* policy : kv_policies()) {
      OffloadOptions options;
      options.policy = policy->name;
      for (double weights_on_device : {100.0, 0.0}) {  // resident, and streamed from the host
        options.weights_gpu_percent = weights_on_device;
        const DecodeAllocations got = decode_allocations(source, request, options, Device::Cpu);
        const std::string what =
            cat(model, " --policy ", policy->name, " --weights-gpu-percent ", weights_on_device);
        EXPECT_EQ(got.in_step_statistics, 0u) << what << ": " << got.per_step;
        EXPECT_EQ(got.around_steps, 0u) << what << ": " << describe(got.around);
      }
    }
  }
}

TEST(DecodeAllocation, CappedInfinigenPoolDecodesWithoutAllocating) {
  const GenerationRequest request = small_request();
  OffloadOptions options;
  options.policy = "infinigen";
  options.kv_pool_limit = 0.5;  // 9 of the 18 positions: decode steps evict
  for (const std::string& model : kModels) {
    const ModelSource source = model_source(model);
    const DecodeAllocations got = decode_allocations(source, request, options, Device::Cpu);
    EXPECT_EQ(got.in_step_statistics, 0u) << model << ": " << got.per_step;
    EXPECT_EQ(got.around_steps, 0u) << model << ": " << describe(got.around);
  }
}

// Sequences that end at different steps leave the batch (KvStore::drop_sequences): the steps
// after a drop allocate nothing either, and neither does the drop.
void expect_dropping_allocates_nothing(Device device) {
  GenerationRequest request = small_request();
  request.sequence_gen_len = {2, 6};
  const ModelSource source = model_source("opt");
  for (const KvPolicy* policy : kv_policies()) {
    OffloadOptions options;
    options.policy = policy->name;
    const DecodeAllocations got = decode_allocations(source, request, options, device);
    EXPECT_EQ(got.in_step_statistics, 0u) << policy->name << ": " << got.per_step;
    EXPECT_EQ(got.around_steps, 0u) << policy->name << ": " << describe(got.around);
  }
}

TEST(DecodeAllocation, DroppingEndedSequencesAllocatesNothing) {
  expect_dropping_allocates_nothing(Device::Cpu);
}

// Pools of blocks shorter than the run, so that decode steps cross into new blocks: PagedKv
// (`full` and `infinigen`) pins every block of the run before the first decode step.
TEST(DecodeAllocation, PoolBlocksAreReservedBeforeDecoding) {
  const GenerationRequest request = small_request();
  for (const std::string policy : {"full", "infinigen"}) {
    OffloadOptions options;
    options.policy = policy;
    options.kv_block_tokens = 4;  // prompts of 12 tokens: decode tokens 12 to 16 open 2 blocks
    const DecodeAllocations got =
        decode_allocations(model_source("opt"), request, options, Device::Cpu);
    EXPECT_EQ(got.in_step_statistics, 0u) << policy << ": " << got.per_step;
    EXPECT_EQ(got.around_steps, 0u) << policy << ": " << describe(got.around);
  }
}

// On a CUDA device (the emulated one in CI): every policy that runs there.
TEST(DecodeAllocationGpu, EveryPolicyThatRunsOnCudaDecodesWithoutAllocating) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  const GenerationRequest request = small_request();
  int64_t policies = 0;
  for (const std::string& model : kModels) {
    const ModelSource source = model_source(model);
    for (const KvPolicy* policy : kv_policies()) {
      if (!policy->runs_on(Device::Cuda)) continue;
      policies += model == kModels.front();
      OffloadOptions options;
      options.policy = policy->name;
      const DecodeAllocations got = decode_allocations(source, request, options, Device::Cuda);
      const std::string what = cat(model, " --policy ", policy->name);
      EXPECT_EQ(got.in_step_statistics, 0u) << what << ": " << got.per_step;
      EXPECT_EQ(got.around_steps, 0u) << what << ": " << describe(got.around);
    }
  }
  EXPECT_EQ(policies, std::ssize(kv_policies()));  // every policy
}

TEST(DecodeAllocationGpu, DroppingEndedSequencesAllocatesNothing) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  expect_dropping_allocates_nothing(Device::Cuda);
}

}  // namespace
}  // namespace infinigen
