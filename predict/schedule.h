// predict: the schedule of a request, op by op: each compute op with its FLOPs and bytes, each
// transfer with its bytes, on the lane that runs it, and the ops each waits for (the events the
// runtime waits on). It is the runtime's own trace of the request (core/trace.h), recorded by a
// dry run of the real forward pass and KV policy and priced op by op (predict/op_costs.h), so
// there is one description of a decode step. The cost model (predict/cost_model.h) simulates it
// on a hardware profile.
//
// Lanes: compute (the host thread that runs the ops; on the CPU backend it is the emulated
// device), load (H2D stream), store (D2H stream), gather (host threads filling pinned staging
// before a DMA; only on the cuda backend, where the design puts the gather in front of one copy),
// and disk (a resumed session's history read into host memory, one layer after another).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/model_config.h"
#include "core/trace.h"
#include "offload/offload_options.h"
#include "predict/op_costs.h"

namespace infinigen {

// What a prediction is asked about.
struct CostModelInput {
  ModelConfig config;
  int64_t batch = 1;
  int64_t prompt_len = 1;  // every prompt this long (no left padding)
  int64_t gen_len = 1;     // generated tokens per sequence, the prefill's one included
  // > 0: a resumed conversation's turn (offload/session.h): each sequence holds history_len
  // tokens on disk, read back while the turn's first pass extends them by prompt_len tokens.
  int64_t history_len = 0;
  // The leading tokens the prompts share, in shared_prefix_groups groups (sequence b in group
  // b % groups; the rest of the prompts differ between sequences): a policy that shares prefixes
  // (option share_prefix) computes and keeps their whole KV blocks once per group.
  int64_t shared_prefix_len = 0;
  int64_t shared_prefix_groups = 1;
  DType kv_dtype = DType::F16;
  OffloadOptions options;  // policy, weights_gpu_percent, kv_block_tokens, speculation, h2o_budget
  // For a policy that selects its loads (infinigen): what a measured run fetched, per layer
  // (fraction) or per step and layer (rows). Dense layers always load everything.
  FetchReplay fetched;
};

enum class Lane { Compute = 0, Load = 1, Store = 2, Gather = 3, Disk = 4 };
constexpr int kLanes = 5;
const char* lane_name(Lane lane);

struct ScheduledOp {
  Lane lane = Lane::Compute;
  OpClass op_class = OpClass::Elementwise;
  std::string name;
  int64_t step = 0;    // 0 = prefill, then decode steps 1..gen_len-1
  int64_t layer = -1;  // -1: not a layer's (embedding, LM head, sampling)
  double flops = 0;
  double device_bytes = 0;  // bytes the op moves through device memory
  // GEMM y (M, N) = x (M, K) . w (N, K)^T: rows M, out_features N, in_features K, and the
  // weights' bytes.
  int64_t rows = 0;
  int64_t out_features = 0;
  int64_t in_features = 0;
  double weight_bytes = 0;
  uint64_t h2d_bytes = 0;   // transfers: bytes over the link (KV and weights)
  uint64_t disk_bytes = 0;  // a session read
  uint64_t d2h_bytes = 0;
  bool weights = false;  // a transfer of streamed weights (else KV)
  // Host copy work of a transfer: contiguous bytes, scattered-row bytes and the number of chunks
  // of its gather list (the CPU backend's transfer thread copies them all itself).
  double copy_bytes = 0;
  double row_bytes = 0;
  int64_t chunks = 0;
  // How a CUDA transfer of scattered rows crosses (--gather): host threads pack the rows into
  // pinned staging before one DMA (host_gather), or the gather kernel reads them over the link
  // together with its list, list_bytes of descriptors (--gather device, the default).
  bool host_gather = false;
  double list_bytes = 0;
  std::vector<int32_t> deps;  // indices of ops that must finish first
};

struct Schedule {
  std::vector<ScheduledOp> ops;
  int64_t steps = 0;                 // prefill + decode steps
  std::vector<int32_t> step_end;     // per step: the op whose end closes it (the sampling)
  std::vector<int32_t> prefill_end;  // the prefill pass's last compute op (before the LM head)
  uint64_t host_kv_bytes = 0;        // the host KV pool at the end (Trace::host_kv_bytes)
};

// The schedule of a trace: its ops priced, on their lanes, with their dependencies.
Schedule schedule_from_trace(const Trace& trace);
// The runtime's schedule of a whole request: the trace of a dry run of it (the prefill, then
// gen_len - 1 decode steps). Fails (one line) for configurations it does not model.
Schedule run_schedule(const CostModelInput& input);

}  // namespace infinigen
