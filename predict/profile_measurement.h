// predict: measures the CPU backend's hardware profile on this machine by timing the engine's own
// ops (core/ops.h, the int4 codec, speculation) and transfer engine; `infinigen bench
// --measure-profile OUT.yaml` writes the result with write_hardware_profile.
#pragma once

#include <functional>
#include <string>

#include "predict/hardware_profile.h"

namespace infinigen {

// Full: the repetitions, rotating sets (128 MiB, or 4x the last-level cache) and sweeps behind
// configs/hardware/cpu-backend.yaml; about a minute on 2 cores. Quick: few repetitions, sets of
// twice the cache, a coarse linear table; seconds, for tests of the measurement itself.
enum class ProfileEffort { Full, Quick };

// Times each op class at decode and prefill shapes and returns medians as a profile named
// "cpu-backend". The link is left unlimited (h2d/d2h infinite, no latency): the CPU backend's
// link is the emulation a run uses, set with with_link(). `progress` (may be empty) gets one
// line per measurement.
HardwareProfile measure_cpu_backend_profile(
    const std::function<void(const std::string&)>& progress = {},
    ProfileEffort effort = ProfileEffort::Full);

}  // namespace infinigen
