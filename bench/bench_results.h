// bench: an experiment's results as files: CSV (one row per point and policy) and JSON (the same
// rows plus the machine, the commit and every setting), read by tools/plot_bench.py.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "bench/bench_runner.h"
#include "bench/machine_info.h"

namespace infinigen {

nlohmann::json bench_json(const BenchReport& report, const MachineInfo& machine,
                          const std::string& command_line);
std::string bench_csv(const BenchReport& report);

}  // namespace infinigen
