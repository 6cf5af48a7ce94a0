// tests: the cost model: its schedule moves exactly the bytes the runtime moves (per step and
// layer, every policy), and the simulator behaves as a timeline must (zero-cost compute leaves
// the transfers, an unlimited link leaves the compute, a faster link never slows a step).
#include "predict/cost_model.h"

#include <gtest/gtest.h>

#include <limits>

#include "core/model_loader.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"
#include "predict/op_costs.h"
#include "predict/simulator.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

// Bytes the schedule moves per (step, layer): KV load, KV store, weights.
struct LayerBytes {
  uint64_t kv_h2d = 0, kv_d2h = 0, weights_h2d = 0;
};
std::vector<std::vector<LayerBytes>> schedule_bytes(const Schedule& s, int64_t layers) {
  std::vector<std::vector<LayerBytes>> out(static_cast<size_t>(s.steps),
                                           std::vector<LayerBytes>(static_cast<size_t>(layers)));
  for (const ScheduledOp& op : s.ops) {
    if (op.op_class != OpClass::Transfer) continue;
    LayerBytes& b = out[static_cast<size_t>(op.step)][static_cast<size_t>(op.layer)];
    (op.weights ? b.weights_h2d : b.kv_h2d) += op.h2d_bytes;
    b.kv_d2h += op.d2h_bytes;
  }
  return out;
}

class CostModelSchedule : public testing_util::SmallRunTest {
 protected:
  CostModelInput input(const OffloadOptions& options) const {
    CostModelInput in;
    in.config = source_.config;
    in.batch = static_cast<int64_t>(request_.prompts.size());
    in.prompt_len = static_cast<int64_t>(request_.prompts[0].size());
    in.gen_len = request_.gen_len;
    in.kv_dtype = request_.kv_dtype;
    in.options = options;
    in.shared_prefix_len = shared_prefix_len_;
    return in;
  }
  int64_t shared_prefix_len_ = 0;  // leading tokens request_'s prompts share

  OffloadRun real_run(const OffloadOptions& options) const {
    return run_offloaded(source_, request_, options, Device::Cpu);
  }
  // Runs the policy for real and checks the schedule's bytes against every step and layer.
  void expect_same_bytes(const OffloadOptions& options) {
    expect_same_bytes(options, real_run(options));
  }
  void expect_same_bytes(const OffloadOptions& options, const OffloadRun& run) {
    CostModelInput in = input(options);
    const auto& steps = run.stats.steps();
    for (size_t s = 1; s < steps.size(); ++s) {
      in.fetched.rows.emplace_back();
      in.fetched.again_rows.emplace_back();
      for (const LayerTraffic& layer : steps[s].layers) {
        in.fetched.rows.back().push_back(layer.tokens_fetched);
        in.fetched.again_rows.back().push_back(layer.tokens_from_row_cache);
      }
    }
    const Schedule schedule = run_schedule(in);
    const auto bytes = schedule_bytes(schedule, source_.config.num_layers);
    const std::string policy = options.policy;
    ASSERT_EQ(bytes.size(), steps.size()) << policy;
    EXPECT_EQ(schedule.host_kv_bytes, steps.back().host_kv_bytes) << policy;
    uint64_t moved = 0;
    for (size_t s = 0; s < steps.size(); ++s) {
      uint64_t h2d = 0, d2h = 0;
      for (size_t l = 0; l < steps[s].layers.size(); ++l) {
        const LayerTraffic& measured = steps[s].layers[l];
        EXPECT_EQ(bytes[s][l].kv_h2d, measured.kv_h2d_bytes)
            << policy << " step " << s << " layer " << l;
        EXPECT_EQ(bytes[s][l].kv_d2h, measured.kv_d2h_bytes)
            << policy << " step " << s << " layer " << l;
        EXPECT_EQ(bytes[s][l].weights_h2d, measured.weight_h2d_bytes)
            << policy << " step " << s << " layer " << l;
        h2d += bytes[s][l].kv_h2d + bytes[s][l].weights_h2d;
        d2h += bytes[s][l].kv_d2h;
      }
      EXPECT_EQ(h2d, steps[s].h2d_bytes) << policy << " step " << s;
      EXPECT_EQ(d2h, steps[s].d2h_bytes) << policy << " step " << s;
      moved += h2d + d2h;
    }
    // A run that keeps KV in a host pool or streams weights moves bytes (a policy that keeps the
    // KV on the device, with every weight there, moves none): the comparisons above are not of
    // nothing with nothing.
    if (run.plan.host_kv_pool > 0 || options.weights_gpu_percent < 100) {
      EXPECT_GT(moved, 0u) << policy;
    }
  }
};

TEST_F(CostModelSchedule, BytesPerStepAndLayerEqualTheRuntimes) {
  for (const KvPolicy* policy : kv_policies()) {
    OffloadOptions options;
    options.policy = policy->name;
    options.kv_block_tokens = 4;
    options.h2o_budget = 0.3;
    options.speculation.alpha = 1.0;
    options.speculation.max_num_kv = 5;
    expect_same_bytes(options);
  }
}

// A capped pool (infinigen's): the dry run keeps as many prompt tokens as the run does, and its
// decode steps evict as the run's do, whichever the data would choose.
TEST_F(CostModelSchedule, ACappedPoolMovesTheRuntimesBytes) {
  for (const EvictionPolicy eviction :
       {EvictionPolicy::Counter, EvictionPolicy::Lru, EvictionPolicy::Fifo}) {
    OffloadOptions options;
    options.kv_block_tokens = 4;
    options.kv_pool_limit = 0.5;
    options.eviction = eviction;
    options.speculation.alpha = 1.0;
    options.speculation.max_num_kv = 5;
    const OffloadRun run = real_run(options);
    expect_same_bytes(options, run);
    // The cap binds: the prompt overflows it, and decode evicts.
    EXPECT_GT(run.stats.pool_cap().prompt_not_kept, 0u);
    EXPECT_GT(run.stats.pool_cap().evictions, 0u);
  }
}

TEST_F(CostModelSchedule, StreamedWeightsMoveTheRuntimesBytes) {
  for (double percent : {50.0, 0.0}) {
    for (const KvPolicy* policy : kv_policies()) {
      OffloadOptions options;
      options.policy = policy->name;
      options.kv_block_tokens = 4;
      options.weights_gpu_percent = percent;
      expect_same_bytes(options);
    }
    source_.config.num_layers = 3;  // odd: layer 0 shares the last layer's buffer
  }
}

TEST_F(CostModelSchedule, ASharedPrefixMovesTheRuntimesBytes) {
  // Three prompts of 12 tokens sharing their first 9: two blocks of 4 are shared.
  request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                      {2, 10, 11, 12, 13, 14, 15, 16, 17, 500, 600, 700},
                      {2, 10, 11, 12, 13, 14, 15, 16, 17, 7, 8, 9}};
  shared_prefix_len_ = 9;
  for (const KvPolicy* policy : kv_policies()) {
    // Which prefix rows a selecting policy's sequences load in common depends on the data: the
    // cost model prices its fetch as if nothing were shared (an upper bound, docs/cost-model.md).
    if (policy->selects_loads) continue;
    OffloadOptions options;
    options.policy = policy->name;
    options.kv_block_tokens = 4;
    expect_same_bytes(options);
  }
}

// A cuda-backend profile with every compute rate scaled by `compute` and the link by `link`.
HardwareProfile scaled(double compute, double link) {
  HardwareProfile p = load_hardware_profile("rtx-a6000-pcie3");
  for (double* rate :
       {&p.gemm_flops, &p.device_memory_bytes_per_s, &p.attention_flops, &p.attention_bytes_per_s,
        &p.elementwise_bytes_per_s, &p.kv_codec_bytes_per_s, &p.speculation_bytes_per_s,
        &p.speculation_flops, &p.scoring_flops}) {
    *rate *= compute;
  }
  if (std::isinf(compute)) p.op_overhead_s = 0;
  p.h2d_bytes_per_s *= link;
  p.d2h_bytes_per_s *= link;
  if (std::isinf(link)) {  // and the host side of transfers too: they cost nothing
    p.transfer_latency_s = 0;
    p.host_copy_bytes_per_s = p.host_row_copy_bytes_per_s = p.host_gather_bytes_per_s = link;
  }
  return p;
}

CostModelInput opt_13b(const std::string& policy) {
  CostModelInput in = testing_util::preset_request<CostModelInput>("opt-13b", 4, 512, 8, policy);
  in.fetched.fraction = {1.0, 1.0, 0.08, 0.1, 0.12};
  return in;
}

// Seconds of decode step `step` from the simulated timings.
double step_seconds(const Schedule& s, const std::vector<OpTiming>& t, int64_t step) {
  return t[static_cast<size_t>(s.step_end[static_cast<size_t>(step)])].end -
         t[static_cast<size_t>(s.step_end[static_cast<size_t>(step - 1)])].end;
}

TEST(CostModelSimulator, WithFreeComputeAFullStepIsItsTransfers) {
  const CostModelInput in = opt_13b("full");
  const HardwareProfile p = scaled(std::numeric_limits<double>::infinity(), 1.0);
  const Schedule s = run_schedule(in);
  const std::vector<OpTiming> t = simulate(s, p);
  for (int64_t step = 1; step < s.steps; ++step) {
    double expected = 0;
    for (const ScheduledOp& op : s.ops) {
      if (op.step == step && op.lane == Lane::Load) {
        expected += p.transfer_latency_s + static_cast<double>(op.h2d_bytes) / p.h2d_bytes_per_s;
      }
    }
    EXPECT_NEAR(step_seconds(s, t, step), expected, 1e-9 * expected) << "step " << step;
  }
}

TEST(CostModelSimulator, WithAnUnlimitedLinkAStepIsItsCompute) {
  for (const KvPolicy* policy : kv_policies()) {
    const CostModelInput in = opt_13b(policy->name);
    const HardwareProfile p = scaled(1.0, std::numeric_limits<double>::infinity());
    const Schedule s = run_schedule(in);
    const std::vector<OpTiming> t = simulate(s, p);
    for (int64_t step = 1; step < s.steps; ++step) {
      double expected = 0;
      for (const ScheduledOp& op : s.ops) {
        if (op.step == step && op.lane == Lane::Compute) expected += op_seconds(op, p);
      }
      EXPECT_NEAR(step_seconds(s, t, step), expected, 1e-9 * expected)
          << policy->name << " step " << step;
    }
  }
}

TEST(CostModelSimulator, DoublingTheLinkNeverSlowsAStep) {
  // Without contention: with it, a faster link can move a host copy into a compute-heavy
  // stretch and slow the step by microseconds (a real scheduling anomaly of shared cores).
  HardwareProfile cpu = with_link(load_hardware_profile("cpu-backend"), 4.0, 10.0);
  cpu.compute_slowdown_under_copy = cpu.copy_slowdown_under_compute = 1;
  for (const HardwareProfile& base : {load_hardware_profile("rtx-a6000-pcie3"), cpu}) {
    HardwareProfile fast = base;
    fast.h2d_bytes_per_s *= 2;
    fast.d2h_bytes_per_s *= 2;
    for (const KvPolicy* policy : kv_policies()) {
      for (double percent : {100.0, 50.0}) {
        CostModelInput in = opt_13b(policy->name);
        in.config.num_layers = 6;
        in.options.weights_gpu_percent = percent;
        const PredictedRun slow_run = predict_run(in, base);
        const PredictedRun fast_run = predict_run(in, fast);
        ASSERT_TRUE(slow_run.fits) << slow_run.does_not_fit;
        for (size_t s = 1; s < slow_run.steps.size(); ++s) {
          EXPECT_LE(fast_run.steps[s].seconds, slow_run.steps[s].seconds * (1 + 1e-9))
              << base.name << " " << policy->name << " " << percent << "% step " << s;
        }
        EXPECT_LE(fast_run.decode_s, slow_run.decode_s * (1 + 1e-9));
      }
    }
  }
}

TEST(CostModelSimulator, PolicyGpuMovesNothingAndFullMovesTheFormula) {
  const Schedule gpu = run_schedule(opt_13b("gpu"));
  for (const ScheduledOp& op : gpu.ops) EXPECT_NE(op.lane, Lane::Load) << op.name;
  for (const ScheduledOp& op : gpu.ops) EXPECT_NE(op.lane, Lane::Store) << op.name;
  const CostModelInput in = opt_13b("full");
  const PredictedRun run = predict_run(in, load_hardware_profile("rtx-a6000-pcie3"));
  ASSERT_TRUE(run.fits);
  const uint64_t L = 40, B = 4, D = 5120;
  for (size_t s = 1; s < run.steps.size(); ++s) {
    const uint64_t n = 512 + s - 1;
    EXPECT_EQ(run.steps[s].h2d_bytes, 2 * L * B * n * D * 2);
    EXPECT_EQ(run.steps[s].d2h_bytes, 2 * L * B * D * 2);
  }
  EXPECT_GT(run.throughput_tok_s, 0);
  EXPECT_NEAR(run.throughput_tok_s, 4.0 * 8 / (run.prefill_s + run.decode_s), 1e-9);
}

// InfiniGen's scattered rows on a GPU: with --gather device (the default) a load of them lasts
// the link time of the rows and of the kernel's 24-byte descriptors, nothing on the host; with
// --gather host, the host threads' packing of the rows and then the link time of the rows alone.
TEST(CostModelSimulator, DeviceGatherReadsRowsAndDescriptorsOverTheLink) {
  const HardwareProfile p = scaled(std::numeric_limits<double>::infinity(), 1.0);
  CostModelInput in = opt_13b("infinigen");
  const Schedule device = run_schedule(in);
  bool saw_rows = false;
  for (const ScheduledOp& op : device.ops) {
    if (op.op_class != OpClass::Transfer || op.row_bytes == 0) continue;
    saw_rows = true;
    EXPECT_FALSE(op.host_gather);
    EXPECT_EQ(op.list_bytes, static_cast<double>(op.chunks) * sizeof(CopyChunk));
    const double seconds = op_seconds(op, p);
    if (op.lane != Lane::Load) continue;
    EXPECT_NEAR(seconds,
                p.transfer_latency_s +
                    (static_cast<double>(op.h2d_bytes) + op.list_bytes) / p.h2d_bytes_per_s,
                1e-12)
        << op.name;
  }
  EXPECT_TRUE(saw_rows);
  in.options.gather = GatherMode::Host;
  for (const ScheduledOp& op : run_schedule(in).ops) {
    if (op.op_class != OpClass::Transfer || op.row_bytes == 0) continue;
    EXPECT_TRUE(op.host_gather);
    EXPECT_EQ(op.list_bytes, 0);
    if (op.lane != Lane::Load) continue;
    EXPECT_NEAR(op_seconds(op, p),
                p.transfer_latency_s + static_cast<double>(op.h2d_bytes) / p.h2d_bytes_per_s +
                    op.row_bytes / p.host_gather_bytes_per_s,
                1e-12)
        << op.name;
  }
}

TEST(CostModelSimulator, APlanThatDoesNotFitIsReportedNotTimed) {
  CostModelInput in = opt_13b("gpu");
  in.config = load_preset("opt-66b");
  const PredictedRun run = predict_run(in, load_hardware_profile("rtx-a6000-pcie3"));
  EXPECT_FALSE(run.fits);
  EXPECT_NE(run.does_not_fit.find("does not fit"), std::string::npos) << run.does_not_fit;
  EXPECT_EQ(run.decode_s, 0);
}

TEST(CostModelSimulator, InfinigenNeedsAMeasuredFetchShare) {
  CostModelInput in = opt_13b("infinigen");
  in.fetched.fraction.clear();
  testing_util::expect_error([&] { run_schedule(in); },
                             {"infinigen", "share of tokens it fetches"});
}

// A capped pool at OPT-13B's size is priced (its dry run allocates no KV), but a resumed turn over
// one is refused: what its extension keeps depends on the conversation's attention.
TEST(CostModelSimulator, ACappedPoolIsPricedButNotItsResumedTurns) {
  CostModelInput in = opt_13b("infinigen");
  in.options.kv_pool_limit = 0.5;
  const PredictedRun run = predict_run(in, load_hardware_profile("rtx-a6000-pcie3"));
  EXPECT_TRUE(run.fits) << run.does_not_fit;
  EXPECT_GT(run.decode_s, 0);
  in.history_len = 256;
  testing_util::expect_error([&] { run_schedule(in); }, {"resumed turn", "--kv-pool-limit"});
}

}  // namespace
}  // namespace infinigen
