// predict: the cost model. It plans a request's memory against a hardware profile, takes the
// runtime's schedule of it (predict/schedule.h) and simulates it on the profile's lanes
// (predict/simulator.h), predicting prefill and decode latency and throughput. See
// docs/cost-model.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "predict/hardware_profile.h"
#include "predict/schedule.h"

namespace infinigen {

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
  uint64_t host_kv_bytes = 0;        // the host KV pool at the end, as the runtime allocates it
  std::vector<PredictedStep> steps;  // every step, steps[0] = prefill
};

// Plans memory against the profile's device, builds the schedule and simulates it. When the
// plan does not fit, returns fits = false with the reason and no timings.
PredictedRun predict_run(const CostModelInput& input, const HardwareProfile& profile);

}  // namespace infinigen
