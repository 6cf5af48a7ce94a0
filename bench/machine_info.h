// bench: the machine and the code that produced a result, recorded next to every number.
#pragma once

#include <string>

#include "core/device.h"

namespace infinigen {

struct MachineInfo {
  std::string cpu;       // model name from /proc/cpuinfo, or "unknown"
  int cpu_threads = 0;   // hardware threads
  double memory_gib = 0;  // total RAM
  std::string device;    // the device the runs used: "cpu (CPU backend)" or the GPU's name
  int omp_threads = 0;   // OpenMP threads of the CPU backend
};

MachineInfo this_machine(Device device);
// The source commit the binary was built from (12 hex digits, "-modified" when the tree had
// uncommitted changes, or "unknown"); generated at build time by cmake/BuildInfo.cmake.
const char* source_commit();

}  // namespace infinigen
