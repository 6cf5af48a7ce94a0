// bench: describing this machine.
#include "bench/machine_info.h"

#include <omp.h>
#include <unistd.h>

#include <fstream>
#include <thread>

namespace infinigen {
namespace {

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("model name", 0) == 0) {
      const size_t colon = line.find(':');
      if (colon != std::string::npos && colon + 2 <= line.size()) return line.substr(colon + 2);
    }
  }
  return "unknown";
}

}  // namespace

MachineInfo this_machine(Device device) {
  MachineInfo m;
  m.cpu = cpu_model();
  m.cpu_threads = static_cast<int>(std::thread::hardware_concurrency());
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  if (pages > 0 && page_size > 0) {
    m.memory_gib = static_cast<double>(pages) * static_cast<double>(page_size) / (1 << 30);
  }
  m.omp_threads = omp_get_max_threads();
  m.device = "cpu (CPU backend)";
  if (device == Device::Cuda) {
    const auto gpus = cuda_devices();
    m.device = gpus.empty() ? "cuda (no device)" : gpus.front().name;
  }
  return m;
}

}  // namespace infinigen
