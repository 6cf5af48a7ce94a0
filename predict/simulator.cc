// predict: replaying a schedule on a hardware profile's lanes.
#include "predict/simulator.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/error.h"

namespace infinigen {
namespace {

bool cpu_backend(const HardwareProfile& p) {
  return p.backend == "cpu";
}

// Host copy work of a transfer (seconds at the solo rate), as the engine does it.
double host_copy_seconds(const ScheduledOp& op, const HardwareProfile& p) {
  // The CPU backend's transfer thread copies every chunk itself (offload/transfer_engine.cc).
  if (op.row_bytes == 0 && op.copy_bytes == 0) return 0;
  return op.copy_bytes / p.host_copy_bytes_per_s + op.row_bytes / p.host_row_copy_bytes_per_s;
}

double link_seconds(const ScheduledOp& op, const HardwareProfile& p) {
  // The device gather's list crosses with a load's rows (a store's rows go the other way).
  const double list = cpu_backend(p) || op.lane == Lane::Store ? 0.0 : op.list_bytes;
  const double bytes = static_cast<double>(op.h2d_bytes + op.d2h_bytes) + list;
  const double rate = op.lane == Lane::Store ? p.d2h_bytes_per_s : p.h2d_bytes_per_s;
  return p.transfer_latency_s + (std::isinf(rate) ? 0.0 : bytes / rate);
}

// Work (seconds at the solo rate, on host or device) and the shortest time an op can take.
struct OpCost {
  double work = 0;
  double floor = 0;
  bool host_copy = false;  // its work is host copying (contends with compute on the CPU backend)
};

OpCost op_cost(const ScheduledOp& op, const HardwareProfile& p, bool cached) {
  OpCost cost;
  if (op.op_class == OpClass::Transfer) {
    cost.floor = link_seconds(op, p);
    // On the CPU backend the transfer thread copies, then sleeps out the emulated link time.
    if (cpu_backend(p)) {
      cost.work = host_copy_seconds(op, p);
      cost.host_copy = true;
    }
    return cost;
  }
  if (op.op_class == OpClass::DiskRead) {
    INFINIGEN_CHECK(p.disk_read_bytes_per_s > 0, "cost model: profile ", p.name,
                    " gives no disk_read_bytes_per_s, which a resumed session's turn needs");
    cost.floor = static_cast<double>(op.disk_bytes) / p.disk_read_bytes_per_s;
    return cost;
  }
  if (op.op_class == OpClass::HostCopy) {
    cost.work = op.device_bytes / p.host_copy_bytes_per_s;
    cost.host_copy = true;
    return cost;
  }
  if (op.op_class == OpClass::Gather) {
    cost.work = op.row_bytes / p.host_gather_bytes_per_s;
    cost.host_copy = true;
    return cost;
  }
  if (op.op_class == OpClass::Gemm && !p.linear_table.empty()) {
    cost.work = p.linear_table.seconds(op.rows, op.out_features, op.in_features, op.weight_bytes,
                                       cached, p.gemm_flops);
    return cost;
  }
  const double inf = std::numeric_limits<double>::infinity();
  double flop_rate = inf, byte_rate = inf;
  switch (op.op_class) {
    case OpClass::Gemm:
      flop_rate = p.gemm_flops;
      byte_rate = p.device_memory_bytes_per_s;
      break;
    case OpClass::AttentionPrefill:
      flop_rate = p.attention_flops;
      byte_rate = p.device_memory_bytes_per_s;
      break;
    case OpClass::AttentionDecode:
      flop_rate = p.attention_flops;
      byte_rate = p.attention_bytes_per_s;
      break;
    case OpClass::Elementwise:
      byte_rate = p.elementwise_bytes_per_s;
      break;
    case OpClass::Codec:
      byte_rate = p.kv_codec_bytes_per_s;
      break;
    case OpClass::Speculation:
      flop_rate = p.speculation_flops;
      byte_rate = p.speculation_bytes_per_s;
      break;
    case OpClass::Scoring:
      flop_rate = p.scoring_flops;
      break;
    default:
      break;
  }
  cost.work = p.op_overhead_s + std::max(op.flops / flop_rate, op.device_bytes / byte_rate);
  return cost;
}

// On the cuda backend with --gather host a transfer of scattered rows is a host gather into pinned
// staging followed by one DMA: the gather becomes its own op on the gather lane.
Schedule with_gather_lane(const Schedule& in, std::vector<int32_t>* original_index) {
  Schedule out;
  out.steps = in.steps;
  std::vector<int32_t> remap(in.ops.size());
  for (size_t i = 0; i < in.ops.size(); ++i) {
    ScheduledOp op = in.ops[i];
    for (int32_t& dep : op.deps) dep = remap[static_cast<size_t>(dep)];
    if (op.op_class == OpClass::Transfer && op.host_gather) {
      ScheduledOp gather = op;
      gather.lane = Lane::Gather;
      gather.op_class = OpClass::Gather;
      gather.name = op.name + "_gather";
      gather.h2d_bytes = gather.d2h_bytes = 0;
      out.ops.push_back(std::move(gather));
      original_index->push_back(-1);
      op.deps = {static_cast<int32_t>(out.ops.size() - 1)};
    }
    remap[i] = static_cast<int32_t>(out.ops.size());
    out.ops.push_back(std::move(op));
    original_index->push_back(static_cast<int32_t>(i));
  }
  return out;
}

std::vector<OpTiming> run_lanes(const Schedule& schedule, const HardwareProfile& p) {
  const std::vector<ScheduledOp>& ops = schedule.ops;
  const size_t n = ops.size();
  const std::vector<bool> cached = step_weights_cached(schedule, p);
  std::vector<OpCost> cost(n);
  for (size_t i = 0; i < n; ++i) {
    cost[i] = op_cost(ops[i], p, cached[static_cast<size_t>(ops[i].step)]);
  }
  std::vector<std::vector<int32_t>> lane_ops(kLanes);
  for (size_t i = 0; i < n; ++i) {
    lane_ops[static_cast<size_t>(ops[i].lane)].push_back(static_cast<int32_t>(i));
  }
  std::vector<OpTiming> timing(n);
  std::vector<double> remaining(n);
  std::vector<char> done(n, 0);
  std::vector<size_t> next(kLanes, 0);
  std::vector<int32_t> active(kLanes, -1);
  double t = 0;
  size_t finished = 0;
  constexpr double kEps = 1e-15;
  while (finished < n) {
    // Start every op whose lane is free and whose dependencies are done.
    for (int lane = 0; lane < kLanes; ++lane) {
      if (active[lane] >= 0 || next[lane] >= lane_ops[lane].size()) continue;
      const int32_t i = lane_ops[lane][next[lane]];
      bool ready = true;
      for (int32_t dep : ops[static_cast<size_t>(i)].deps) ready = ready && done[dep];
      if (!ready) continue;
      active[lane] = i;
      timing[i].start = t;
      remaining[i] = cost[i].work;
      ++next[lane];
    }
    // Rates: compute and host copies slow each other while both run (shared host cores).
    bool computing = false, copying = false;
    for (int lane = 0; lane < kLanes; ++lane) {
      const int32_t i = active[lane];
      if (i < 0 || remaining[i] <= kEps) continue;
      if (cost[i].host_copy) {
        copying = true;
      } else {
        computing = true;
      }
    }
    double dt = std::numeric_limits<double>::infinity();
    std::vector<double> rate(kLanes, 1.0);
    bool any = false;
    for (int lane = 0; lane < kLanes; ++lane) {
      const int32_t i = active[lane];
      if (i < 0) continue;
      any = true;
      if (cost[i].host_copy && computing) rate[lane] = 1.0 / p.copy_slowdown_under_compute;
      if (!cost[i].host_copy && copying) rate[lane] = 1.0 / p.compute_slowdown_under_copy;
      if (remaining[i] > kEps) {
        dt = std::min(dt, remaining[i] / rate[lane]);
      } else {
        dt = std::min(dt, std::max(0.0, timing[i].start + cost[i].floor - t));
      }
    }
    INFINIGEN_CHECK(any, "cost model: the schedule deadlocks at op ", next[0],
                    " (a dependency "
                    "on a later op)");
    t += dt;
    for (int lane = 0; lane < kLanes; ++lane) {
      const int32_t i = active[lane];
      if (i < 0) continue;
      remaining[i] = std::max(0.0, remaining[i] - rate[lane] * dt);
      // Relative slack: `t` accumulates rounding over many events.
      const double slack = kEps + 1e-12 * t;
      if (remaining[i] <= slack && timing[i].start + cost[i].floor <= t + slack) {
        timing[i].end = std::max(t, timing[i].start + cost[i].floor);
        done[i] = 1;
        active[lane] = -1;
        ++finished;
      }
    }
  }
  return timing;
}

}  // namespace

std::vector<bool> step_weights_cached(const Schedule& schedule, const HardwareProfile& profile) {
  // A step's working set: every byte its ops stream (weights, KV read by attention, activations)
  // plus, for each transfer, its source and its destination, which on the CPU backend share the
  // host's cache with the weights. Weights stay cached across steps only if all of it fits.
  std::vector<double> bytes(static_cast<size_t>(schedule.steps), 0.0);
  for (const ScheduledOp& op : schedule.ops) {
    bytes[static_cast<size_t>(op.step)] +=
        op.device_bytes + 2.0 * static_cast<double>(op.h2d_bytes + op.d2h_bytes);
  }
  // The cache grid of a linear table was measured on working sets of half the cache, the size
  // known to stay resident next to everything else; larger ones take the memory grid.
  const double resident = profile.device_cache_bytes / 2;
  std::vector<bool> cached(bytes.size());
  for (size_t s = 0; s < bytes.size(); ++s) cached[s] = bytes[s] <= resident;
  return cached;
}

double op_seconds(const ScheduledOp& op, const HardwareProfile& profile, bool cached) {
  const OpCost cost = op_cost(op, profile, cached);
  double seconds = std::max(cost.work, cost.floor);
  if (op.op_class == OpClass::Transfer && !cpu_backend(profile) && op.host_gather) {
    seconds += op.row_bytes / profile.host_gather_bytes_per_s;  // the gather before the DMA
  }
  return seconds;
}

std::vector<OpTiming> simulate(const Schedule& schedule, const HardwareProfile& profile) {
  if (cpu_backend(profile)) return run_lanes(schedule, profile);
  std::vector<int32_t> original;
  const Schedule expanded = with_gather_lane(schedule, &original);
  const std::vector<OpTiming> all = run_lanes(expanded, profile);
  std::vector<OpTiming> timing(schedule.ops.size());
  for (size_t i = 0; i < all.size(); ++i) {
    if (original[i] >= 0) timing[static_cast<size_t>(original[i])] = all[i];
  }
  return timing;
}

}  // namespace infinigen
