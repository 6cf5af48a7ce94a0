// tests: the op profile (core/op_profile.h, `infinigen run --profile-ops`): every op of a run's
// steps is charged once per call, the intervals add up to no more than the run took, and nothing
// is recorded without a profile installed or in a dry run; on the CPU and on a CUDA device.
#include "core/op_profile.h"

#include <gtest/gtest.h>

#include <string>

#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

const OpProfile::Entry* find(const OpProfile::Phase& phase, const std::string& name) {
  for (const OpProfile::Entry& e : phase.entries) {
    if (e.name == name) return &e;
  }
  return nullptr;
}

// SmallRunTest's run (opt-tiny cut to 4 layers, two prompts of 12 tokens, 6 generated) under a
// policy, profiled.
class OpProfileRun : public testing_util::SmallRunTest {
 protected:
  struct Profiled {
    OffloadRun run;
    OpProfile::Phase prefill, decode;
  };
  Profiled profiled_run(const std::string& policy, Device device) {
    OffloadOptions options;
    options.policy = policy;
    OpProfile profile;
    Profiled p;
    {
      const OpProfileScope scope(profile);
      p.run = run_offloaded(source_, request_, options, device);
    }
    profile.finish();
    p.prefill = profile.prefill();
    p.decode = profile.decode();
    return p;
  }
  void expect_every_op_charged(const Profiled& p, const std::string& policy) const;
};

void OpProfileRun::expect_every_op_charged(const Profiled& p, const std::string& policy) const {
  const int64_t layers = 4, decode_steps = request_.gen_len - 1;
  EXPECT_EQ(p.prefill.steps, 1) << policy;
  EXPECT_EQ(p.decode.steps, decode_steps) << policy;
  // Per layer q, k, v, out, fc1, fc2, then the LM head: in every pass; InfiniGen's speculation
  // adds the partial query of each of opt-tiny's 2 speculated layers.
  const OpProfile::Entry* linear = find(p.decode, "linear");
  ASSERT_NE(linear, nullptr) << policy;
  const int64_t speculated = policy == "infinigen" ? 2 : 0;
  EXPECT_EQ(linear->calls, decode_steps * (6 * layers + 1 + speculated)) << policy;
  const OpProfile::Entry* attention = find(p.decode, "attention_decode");
  ASSERT_NE(attention, nullptr) << policy;
  EXPECT_EQ(attention->calls, decode_steps * layers) << policy;
  EXPECT_GT(attention->seconds, 0.0) << policy;
  const OpProfile::Entry* prompt_attention = find(p.prefill, "attention_prefill");
  ASSERT_NE(prompt_attention, nullptr) << policy;
  EXPECT_EQ(prompt_attention->calls, layers) << policy;
  // The intervals tile each phase from its first step's start to the next phase's: no more than
  // the phase took (the prefill's end reaches past its clock by the first token's bookkeeping).
  EXPECT_GT(p.decode.seconds(), 0.0) << policy;
  EXPECT_LE(p.decode.seconds(), p.run.result.decode_seconds * 1.05 + 1e-3) << policy;
  EXPECT_LE(p.prefill.seconds(), p.run.result.prefill_seconds * 1.05 + 1e-3) << policy;
  for (const OpProfile::Entry& e : p.decode.entries) EXPECT_GE(e.seconds, 0.0) << e.name;
}

TEST_F(OpProfileRun, ChargesEveryOpOfEveryStepOnTheCpu) {
  for (const std::string policy : {"full", "infinigen"}) {
    expect_every_op_charged(profiled_run(policy, Device::Cpu), policy);
  }
  // InfiniGen's own work is named: the speculation of the next layer's rows.
  const Profiled p = profiled_run("infinigen", Device::Cpu);
  const OpProfile::Entry* speculate = find(p.decode, "speculate");
  ASSERT_NE(speculate, nullptr);
  EXPECT_EQ(speculate->calls, 5 * 2);  // opt-tiny's 2 speculated layers of 4
}

TEST_F(OpProfileRun, RecordsNothingWithoutAScopeOrInADryRun) {
  OpProfile profile;
  OffloadOptions options;
  options.policy = "full";
  run_offloaded(source_, request_, options, Device::Cpu);
  {
    const OpProfileScope scope(profile);
    dry_run_trace(source_.config, request_, options, Device::Cpu, nullptr);
  }
  profile.finish();
  EXPECT_EQ(profile.prefill().steps, 0);
  EXPECT_TRUE(profile.prefill().entries.empty());
  EXPECT_TRUE(profile.decode().entries.empty());
  EXPECT_EQ(active_op_profile(), nullptr);
}

// On a CUDA device (the emulated one in CI) the marks are events on the compute stream, and the
// host's waits for the device (InfiniGen's selection counts, a layer each) have an entry.
class OpProfileGpu : public OpProfileRun {};

TEST_F(OpProfileGpu, ChargesEveryOpOnTheDeviceAndTheHostWaits) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  for (const std::string policy : {"full", "infinigen"}) {
    const Profiled p = profiled_run(policy, Device::Cuda);
    expect_every_op_charged(p, policy);
    if (policy == "infinigen") {
      const OpProfile::Entry* wait = find(p.decode, "(host wait)");
      ASSERT_NE(wait, nullptr);
      EXPECT_GE(wait->calls, 5 * 2);  // at least the selection's, each speculated layer
    }
  }
}

}  // namespace
}  // namespace infinigen
