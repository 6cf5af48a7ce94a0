// tests: traces (core/trace.h). A dry run records the same ops and transfers, in the same order
// and with the same dependencies, as the real run it stands for, and touches no memory at the
// paper's sizes.
#include "core/trace.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>

#include "core/model_loader.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"
#include "speculate/speculation.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

std::string describe(const TracedOp& op) {
  std::ostringstream s;
  s << op.name << " kind " << static_cast<int>(op.kind) << " step " << op.step << " layer "
    << op.layer << " sizes";
  for (int64_t v : op.sizes) s << " " << v;
  s << " dtype " << dtype_name(op.dtype) << " bytes " << op.bytes << " chunks " << op.chunks
    << " content " << static_cast<int>(op.content) << " deps";
  for (int32_t d : op.deps) s << " " << d;
  return s.str();
}

class DryTrace : public testing_util::SmallRunTest {
 protected:
  // The trace of a real run of `options`.
  Trace wet(const OffloadOptions& options) const {
    Trace trace(/*dry=*/false);
    TraceScope scope(trace);
    run_offloaded(source_, request_, options, Device::Cpu);
    return trace;
  }

  void expect_same_trace(const OffloadOptions& options, const FetchReplay* replay = nullptr) {
    const Trace real = wet(options);
    const Trace dry = dry_run_trace(source_.config, request_, options, Device::Cpu, replay);
    ASSERT_FALSE(real.ops().empty());
    ASSERT_EQ(real.ops().size(), dry.ops().size()) << options.policy;
    for (size_t i = 0; i < real.ops().size(); ++i) {
      ASSERT_EQ(describe(real.ops()[i]), describe(dry.ops()[i])) << options.policy << ", op " << i;
    }
  }
};

// A policy that selects its loads from the data replays a real run's fetches in a dry run: those
// are checked below, replaying everything.
TEST_F(DryTrace, RecordsWhatTheRealRunDoes) {
  for (const KvPolicy* policy : kv_policies()) {
    if (policy->selects_loads) continue;
    OffloadOptions options;
    options.policy = policy->name;
    expect_same_trace(options);
  }
}

TEST_F(DryTrace, RecordsStreamedWeights) {
  OffloadOptions options;
  options.policy = "full";
  options.weights_gpu_percent = 50;
  expect_same_trace(options);
}

TEST_F(DryTrace, ReplayingEverythingRecordsWhatSelectingEverythingDoes) {
  int64_t selecting = 0;
  for (const KvPolicy* policy : kv_policies()) {
    if (!policy->selects_loads) continue;
    ++selecting;
    OffloadOptions options;
    options.policy = policy->name;
    options.speculation.alpha = 1e9;  // every token passes the threshold, and fits the budget
    options.speculation.max_num_kv = 1 << 20;
    FetchReplay everything;
    everything.fraction.assign(static_cast<size_t>(source_.config.num_layers), 1.0);
    options.row_cache = RowCacheUse::Off;
    expect_same_trace(options, &everything);
    // With the row cache: selecting everything, a step holds all the step before selected (every
    // row but the token stored since), which a replayed share of 1 serves too.
    options.row_cache = RowCacheUse::On;
    everything.again.assign(static_cast<size_t>(source_.config.num_layers), 1.0);
    expect_same_trace(options, &everything);
  }
  EXPECT_GE(selecting, 1);  // infinigen
}

TEST_F(DryTrace, ASelectingPolicyWithoutAReplayIsRefused) {
  for (const KvPolicy* policy : kv_policies()) {
    if (!policy->selects_loads) continue;
    OffloadOptions options;
    options.policy = policy->name;
    EXPECT_THROW(dry_run_trace(source_.config, request_, options, Device::Cpu, nullptr), Error)
        << policy->name;
  }
}

// Resident memory of this process now, in MiB.
double resident_mib() {
  std::ifstream statm("/proc/self/statm");
  long pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return static_cast<double>(pages_resident) * static_cast<double>(sysconf(_SC_PAGESIZE)) /
         (1024.0 * 1024.0);
}

TEST(DryTraceAtScale, OptThirteenBAtTheFigureFourteenPointNeedsNoMemory) {
  // 26 GB of weights and 30 GB of KV if anything were allocated.
  const ModelSource source = resolve_model("opt-13b", {});
  GenerationRequest request;
  std::vector<int32_t> prompt(1920, 5);
  prompt[0] = source.config.bos_token_id;
  request.prompts.assign(20, prompt);
  request.gen_len = 4;
  request.sampling.temperature = 0;
  for (const KvPolicy* policy : kv_policies()) {
    OffloadOptions options;
    options.policy = policy->name;
    FetchReplay replay;
    replay.fraction = {1.0, 1.0, 0.1};
    const double before = resident_mib();
    const Trace trace = dry_run_trace(source.config, request, options, Device::Cpu, &replay);
    EXPECT_LT(resident_mib() - before, 512.0) << policy->name;
    // Per layer and step at least the four projections and two FFN linears.
    int64_t linears = 0;
    for (const TracedOp& op : trace.ops()) {
      linears += std::string(op.name) == "linear" ? 1 : 0;
    }
    EXPECT_GE(linears, 6 * source.config.num_layers * request.gen_len) << policy->name;
  }
}

}  // namespace
}  // namespace infinigen
