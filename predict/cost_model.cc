// predict: predicting a run from its schedule and a hardware profile.
#include "predict/cost_model.h"

#include <algorithm>
#include <cstdint>

#include "core/error.h"
#include "offload/memory_planner.h"
#include "offload/runtime.h"
#include "predict/simulator.h"

namespace infinigen {

PredictedRun predict_run(const CostModelInput& input, const HardwareProfile& profile) {
  PredictedRun run;
  MemoryRequest memory = offload_memory_request(input.config, input.batch, input.prompt_len,
                                                input.gen_len, input.kv_dtype, input.options);
  memory.device_capacity =
      static_cast<size_t>(std::min(profile.device_memory_bytes, static_cast<double>(SIZE_MAX / 2)));
  memory.host_capacity = SIZE_MAX / 2;  // the profile describes the device side only
  memory.gemm_scratch = profile.backend != "cpu";
  CostModelInput placed = input;
  try {
    placed.options = with_plan_placements(input.options, plan_memory(memory));
  } catch (const Error& e) {
    run.fits = false;
    run.does_not_fit = e.what();
    return run;
  }

  const Schedule schedule = run_schedule(placed);
  run.host_kv_bytes = schedule.host_kv_bytes;
  const std::vector<OpTiming> timing = simulate(schedule, profile);
  const int64_t L = input.config.num_layers;
  run.steps.resize(static_cast<size_t>(schedule.steps));
  for (PredictedStep& step : run.steps) step.layers.resize(static_cast<size_t>(L));
  double previous_compute_end = 0;
  for (size_t i = 0; i < schedule.ops.size(); ++i) {
    const ScheduledOp& op = schedule.ops[i];
    PredictedStep& step = run.steps[static_cast<size_t>(op.step)];
    step.h2d_bytes += op.h2d_bytes;
    step.d2h_bytes += op.d2h_bytes;
    const double seconds = timing[i].end - timing[i].start;
    if (op.lane == Lane::Compute) {
      const double idle = std::max(0.0, timing[i].start - previous_compute_end);
      previous_compute_end = timing[i].end;
      if (op.layer < 0) continue;
      PredictedLayer& layer = step.layers[static_cast<size_t>(op.layer)];
      layer.compute_s += seconds;
      layer.exposed_load_wait_s += idle;
      continue;
    }
    if (op.layer < 0) continue;
    PredictedLayer& layer = step.layers[static_cast<size_t>(op.layer)];
    layer.h2d_bytes += op.h2d_bytes;
    layer.d2h_bytes += op.d2h_bytes;
    (op.weights ? layer.weight_h2d_bytes : layer.kv_h2d_bytes) += op.h2d_bytes;
    (op.lane == Lane::Store ? layer.store_s : layer.load_s) += seconds;
  }
  double previous_end = 0;
  for (int64_t s = 0; s < schedule.steps; ++s) {
    const double end = timing[static_cast<size_t>(schedule.step_end[static_cast<size_t>(s)])].end;
    run.steps[static_cast<size_t>(s)].seconds = end - previous_end;
    previous_end = end;
  }
  run.prefill = run.steps[0];
  run.prefill_s = run.steps[0].seconds;
  uint64_t decode_h2d = 0;
  for (int64_t s = 1; s < schedule.steps; ++s) {
    run.decode_s += run.steps[static_cast<size_t>(s)].seconds;
    decode_h2d += run.steps[static_cast<size_t>(s)].h2d_bytes;
  }
  if (schedule.steps > 1) {
    run.middle_decode_step =
        run.steps[static_cast<size_t>(std::max<int64_t>(1, schedule.steps / 2))];
    run.mean_h2d_bytes_per_decode_step =
        static_cast<double>(decode_h2d) / static_cast<double>(schedule.steps - 1);
  }
  const double total = run.prefill_s + run.decode_s;
  run.throughput_tok_s = total > 0 ? static_cast<double>(input.batch * input.gen_len) / total : 0.0;
  return run;
}

}  // namespace infinigen
