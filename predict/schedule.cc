// predict: the runtime's schedule of a request, from the trace of a dry run of it.
#include "predict/schedule.h"

#include <algorithm>
#include <optional>

#include "core/error.h"
#include "core/generation.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"
#include "offload/session.h"

namespace infinigen {

const char* lane_name(Lane lane) {
  switch (lane) {
    case Lane::Compute:
      return "compute";
    case Lane::Load:
      return "load";
    case Lane::Store:
      return "store";
    case Lane::Gather:
      return "gather";
    case Lane::Disk:
      return "disk";
  }
  return "?";
}

Schedule schedule_from_trace(const Trace& trace) {
  Schedule schedule;
  schedule.host_kv_bytes = trace.host_kv_bytes();
  schedule.ops.reserve(trace.ops().size());
  for (const TracedOp& traced : trace.ops()) {
    ScheduledOp op;
    op.name = traced.name;
    op.step = traced.step;
    op.layer = traced.layer;
    op.deps = traced.deps;
    if (traced.kind == TracedKind::Compute) {
      const OpWork work = op_work(traced);
      op.lane = Lane::Compute;
      op.op_class = work.op_class;
      op.flops = work.flops;
      op.device_bytes = work.bytes;
      op.rows = work.rows;
      op.out_features = work.out_features;
      op.in_features = work.in_features;
      op.weight_bytes = work.weight_bytes;
      const auto step = static_cast<size_t>(op.step);
      if (schedule.step_end.size() <= step) schedule.step_end.resize(step + 1, -1);
      schedule.step_end[step] = static_cast<int32_t>(schedule.ops.size());
    } else if (traced.kind == TracedKind::Read) {
      op.lane = Lane::Disk;
      op.op_class = OpClass::DiskRead;
      op.disk_bytes = traced.bytes;
    } else {
      const bool load = traced.kind == TracedKind::Load;
      op.lane = load ? Lane::Load : Lane::Store;
      op.op_class = OpClass::Transfer;
      (load ? op.h2d_bytes : op.d2h_bytes) = traced.bytes;
      op.weights = traced.content == TransferContent::Weights;
      // Rows picked one by one are a gather; everything else copies runs.
      (traced.content == TransferContent::KvRows ? op.row_bytes : op.copy_bytes) =
          static_cast<double>(traced.bytes);
      op.chunks = traced.chunks;
    }
    schedule.ops.push_back(std::move(op));
  }
  schedule.steps = static_cast<int64_t>(schedule.step_end.size());
  INFINIGEN_CHECK(
      std::find(schedule.step_end.begin(), schedule.step_end.end(), -1) == schedule.step_end.end(),
      "cost model: a step of the trace has no compute op");
  return schedule;
}

Schedule run_schedule(const CostModelInput& in) {
  INFINIGEN_CHECK(in.batch >= 1 && in.prompt_len >= 1 && in.gen_len >= 1,
                  "cost model: batch, prompt length and generation length must be >= 1");
  const bool replays = kv_policy(in.options.policy).selects_loads;
  if (replays) in.fetched.validate(in.config.num_layers);
  INFINIGEN_CHECK(in.shared_prefix_len >= 0 && in.shared_prefix_len <= in.prompt_len,
                  "cost model: the shared prefix (", in.shared_prefix_len,
                  " tokens) must be within the prompt (", in.prompt_len, ")");
  // Prompts of equal length, of ids any vocabulary holds, different in every token but for the
  // prefixes their groups share; beyond that the tokens do not matter to a dry run.
  GenerationRequest request;
  for (int64_t b = 0; b < in.batch; ++b) {
    request.prompts.emplace_back(
        static_cast<size_t>(in.prompt_len),
        1 + static_cast<int32_t>(b % std::max<int64_t>(in.config.vocab_size - 1, 1)));
  }
  if (in.shared_prefix_len > 0) {
    share_leading_tokens(request.prompts, in.shared_prefix_len, in.shared_prefix_groups);
  }
  request.gen_len = in.gen_len;
  request.sampling.temperature = 0;
  request.kv_dtype = in.kv_dtype;
  INFINIGEN_CHECK(in.history_len >= 0, "cost model: history length must be >= 0");
  std::optional<DrySessionTurn> session;
  if (in.history_len > 0) {
    session.emplace(in.batch, in.history_len, in.config.num_layers, in.config.kv_heads());
  }
  const Trace trace = dry_run_trace(in.config, request, in.options, Device::Cpu,
                                    replays ? &in.fetched : nullptr, session ? &*session : nullptr);
  Schedule schedule = schedule_from_trace(trace);
  for (ScheduledOp& op : schedule.ops) {
    if (op.op_class != OpClass::Transfer || op.row_bytes == 0) continue;
    op.host_gather = in.options.gather == GatherMode::Host;
    if (!op.host_gather) op.list_bytes = static_cast<double>(op.chunks) * sizeof(CopyChunk);
  }
  return schedule;
}

}  // namespace infinigen
