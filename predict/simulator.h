// predict: the lane simulator. An op starts when its lane is free (lanes are FIFO, as streams
// are) and every op it depends on has finished. Durations: compute ops op_overhead +
// max(flops / rate, bytes / bandwidth) with the rates of the op's class, linear layers from the
// profile's measured linear_table where it has one; a transfer takes latency + bytes / link
// bandwidth, and on the CPU backend it also copies the bytes on the transfer thread (the engine
// copies, then sleeps out the emulated link time), so it lasts max(copy, link); copies and
// compute that share host cores slow each other by the profile's contention factors while both
// run.
#pragma once

#include <vector>

#include "predict/hardware_profile.h"
#include "predict/schedule.h"

namespace infinigen {

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

}  // namespace infinigen
