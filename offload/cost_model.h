// offload: the cost model, a timeline simulator that replays the runtime's own schedule (the ops
// of core/opt_model.cc's forward loop, the bytes each KV policy and the weight streaming move, and
// the events the runtime waits on) on the lanes of a HardwareProfile and predicts prefill and
// decode latency and throughput. See docs/cost-model.md.
//
// Lanes: compute (the host thread that runs the ops; on the CPU backend it is the emulated
// device), load (H2D stream), store (D2H stream), and gather (host threads filling pinned staging
// before a DMA; only on the cuda backend, where the design puts the gather in front of one copy).
// An op starts when its lane is free (lanes are FIFO, as streams are) and every op it depends on
// has finished. Durations: compute ops op_overhead + max(flops / rate, bytes / bandwidth) with the
// rates of the op's class, linear layers from the profile's measured linear_table where it has one;
// a transfer takes latency + bytes / link bandwidth, and on the CPU backend it also copies the
// bytes on the transfer thread (the engine copies, then sleeps out the emulated link time), so it
// lasts max(copy, link); copies and compute that share host cores slow each other by the profile's
// contention factors while both run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/model_config.h"
#include "offload/hardware_profile.h"
#include "offload/runtime.h"

namespace infinigen {

struct CostModelInput {
  ModelConfig config;
  int64_t batch = 1;
  int64_t prompt_len = 1;  // every prompt this long (no left padding)
  int64_t gen_len = 1;     // generated tokens per sequence, the prefill's one included
  DType kv_dtype = DType::F16;
  OffloadOptions options;  // policy, weights_gpu_percent, kv_block_tokens, speculation, h2o_budget
  // Policy infinigen: per layer, the share of the pooled tokens a decode step loads (as a run
  // measured it: tokens_fetched / tokens_stored). Resampled by relative depth when its length is
  // not num_layers; dense layers always load everything.
  std::vector<double> fetched_fraction;
  // Policy infinigen, optional and exact: (sequence, head, token) rows loaded per decode step and
  // layer (a run's LayerTraffic::tokens_fetched), steps 1..gen_len-1 in order. Overrides
  // fetched_fraction where given.
  std::vector<std::vector<uint64_t>> fetched_rows;
};

enum class Lane { Compute = 0, Load = 1, Store = 2, Gather = 3 };
constexpr int kLanes = 4;
const char* lane_name(Lane lane);

// Which rates of the profile an op runs at (offload/hardware_profile.h).
enum class OpClass {
  Gemm,              // linear_table where the profile has one, else gemm_flops and
                     // device_memory_bytes_per_s
  AttentionPrefill,  // attention_flops, device_memory_bytes_per_s
  AttentionDecode,   // attention_flops, attention_bytes_per_s
  Elementwise,       // elementwise_bytes_per_s
  Codec,             // kv_codec_bytes_per_s
  Speculation,       // speculation_bytes_per_s
  Scoring,           // scoring_flops
  Transfer,          // the link (and the host copy on the CPU backend)
  Gather,            // host threads gathering rows into pinned staging (cuda backend)
};

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
  uint64_t h2d_bytes = 0;  // transfers: bytes over the link (KV and weights)
  uint64_t d2h_bytes = 0;
  bool weights = false;  // a transfer of streamed weights (else KV)
  // Host copy work of a transfer: contiguous bytes, scattered-row bytes and the number of chunks
  // of its gather list (the CPU backend's transfer thread copies them all itself).
  double copy_bytes = 0;
  double row_bytes = 0;
  int64_t chunks = 0;
  std::vector<int32_t> deps;  // indices of ops that must finish first
};

struct Schedule {
  std::vector<ScheduledOp> ops;
  int64_t steps = 0;                 // prefill + decode steps
  std::vector<int32_t> step_end;     // per step: the op whose end closes it (the sampling)
  std::vector<int32_t> prefill_end;  // the prefill pass's last compute op (before the LM head)
};

// The runtime's schedule of a whole request: the prefill, then gen_len - 1 decode steps, each
// with its own context length. Fails (one line) for configurations it does not model.
Schedule run_schedule(const CostModelInput& input);

struct OpTiming {
  double start = 0, end = 0;
};
// Replays `schedule` on `profile`'s lanes; one timing per op.
std::vector<OpTiming> simulate(const Schedule& schedule, const HardwareProfile& profile);
// Solo duration of one op on `profile` (no contention, no waiting); `cached`: its step's weights
// fit in the device's last-level cache (see step_weights_cached).
double op_seconds(const ScheduledOp& op, const HardwareProfile& profile, bool cached = false);
// Per step: whether its working set (weights, KV read, activations, both ends of each transfer)
// fits in half of profile.device_cache_bytes (the set size its linear table's cache grid was
// measured on), so that the weights come from the cache at every step.
std::vector<bool> step_weights_cached(const Schedule& schedule, const HardwareProfile& profile);

struct PredictedLayer {
  double compute_s = 0;            // compute ops of the layer (their simulated durations)
  double load_s = 0;               // load-lane time of the layer's transfers
  double store_s = 0;              // store-lane time
  double exposed_load_wait_s = 0;  // compute idle, waiting inside the layer
  uint64_t h2d_bytes = 0;          // KV and streamed weights, attributed as the runtime does
  uint64_t d2h_bytes = 0;
  uint64_t kv_h2d_bytes = 0;
  uint64_t weight_h2d_bytes = 0;
};

struct PredictedStep {
  double seconds = 0;  // from the previous step's end (prefill: from 0) to this step's sampling
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  std::vector<PredictedLayer> layers;
};

struct PredictedRun {
  bool fits = true;             // the memory plan fits profile.device_memory_bytes
  std::string does_not_fit;     // the planner's one-line reason when it does not
  double prefill_s = 0;         // prompt pass, LM head and the first token's sampling
  double decode_s = 0;          // the remaining gen_len - 1 steps
  double throughput_tok_s = 0;  // B * gen_len / (prefill + decode), as the runtime reports it
  PredictedStep prefill;
  PredictedStep middle_decode_step;  // step max(1, gen_len / 2) (empty when gen_len = 1)
  double mean_h2d_bytes_per_decode_step = 0;
  std::vector<PredictedStep> steps;  // every step, steps[0] = prefill
};

// Plans memory against the profile's device, builds the schedule and simulates it. When the
// plan does not fit, returns fits = false with the reason and no timings.
PredictedRun predict_run(const CostModelInput& input, const HardwareProfile& profile);

// FLOP and byte counts shared by the schedule and the profile measurement, so both count alike.
// Linear y (M, N) = x (M, K) w (N, K)^T + b with weights of `weight_bytes` per element.
double linear_flops(int64_t M, int64_t N, int64_t K);
double linear_bytes(int64_t M, int64_t N, int64_t K, size_t weight_bytes);
// Causal prefill attention of B * H heads over n tokens of head size d.
double attention_prefill_flops(int64_t B, int64_t H, int64_t n, int64_t d);
// Decode attention of B * H queries over `rows` KV rows each, KV of kv_bytes per element.
double attention_decode_bytes(int64_t B, int64_t H, int64_t rows, int64_t d, size_t kv_bytes);
double attention_decode_flops(int64_t B, int64_t H, int64_t rows, int64_t d);
// LayerNorm of (rows, D) fp32.
double layer_norm_bytes(int64_t rows, int64_t D);

}  // namespace infinigen
