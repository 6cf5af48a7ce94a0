// kernels/cuda/emulation: errors as CUDA keeps them. A failed call returns its code and leaves it
// as the host thread's last error (cudaGetLastError reads and clears it); a fault in device work
// is sticky: every later call returns it, as a GPU context is unusable after one. The emulation
// explains each error it finds: the text goes to stderr and is what cudaGetErrorString returns
// for that code, so that the engine's one-line message carries it.
#include <cstdio>
#include <mutex>
#include <string>

#include "kernels/cuda/emulation/device_state.h"

namespace infinigen::cuda_emulation {
namespace {

struct ThreadError {
  cudaError_t code = cudaSuccess;
  cudaError_t explained_code = cudaSuccess;
  std::string explanation;
};
thread_local ThreadError thread_error;

struct StickyError {
  std::mutex mutex;
  cudaError_t code = cudaSuccess;
  std::string* explanation = nullptr;  // never freed: cudaGetErrorString hands out its text
};
StickyError& sticky() {
  static auto* state = new StickyError;
  return *state;
}

const char* generic_string(cudaError_t code) {
  switch (code) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInitializationError:
      return "initialization error";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorInsufficientDriver:
      return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotReady:
      return "device not ready";
    case cudaErrorIllegalAddress:
      return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources:
      return "too many resources requested for launch";
    case cudaErrorHostMemoryAlreadyRegistered:
      return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered:
      return "pointer does not correspond to a registered memory region";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure";
    case cudaErrorUnknown:
      return "unknown error";
  }
  return "unrecognized error code";
}

}  // namespace

cudaError_t fail(cudaError_t code, const std::string& message) {
  thread_error.code = code;
  thread_error.explained_code = code;
  thread_error.explanation =
      std::string(generic_string(code)) + " (emulated device: " + message + ")";
  std::fprintf(stderr, "cuda emulation: %s\n", message.c_str());
  return code;
}

cudaError_t sticky_error() {
  StickyError& state = sticky();
  std::lock_guard<std::mutex> lock(state.mutex);
  return state.code;
}

void set_sticky_error(cudaError_t code, const std::string& message) {
  StickyError& state = sticky();
  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.code != cudaSuccess) return;  // the first fault is the one to report
  state.code = code;
  state.explanation =
      new std::string(std::string(generic_string(code)) + " (emulated device: " + message + ")");
  std::fprintf(stderr, "cuda emulation: %s\n", message.c_str());
}

std::string describe_site(const LaunchSite& site) {
  std::string file = site.file;
  const size_t slash = file.find_last_of('/');
  if (slash != std::string::npos) file = file.substr(slash + 1);
  return "kernel '" + std::string(site.kernel) + "' (" + file + ":" + std::to_string(site.line) +
         ")";
}

// Clears the sticky error (cudaDeviceReset).
void clear_sticky_error() {
  StickyError& state = sticky();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.code = cudaSuccess;
}

}  // namespace infinigen::cuda_emulation

using infinigen::cuda_emulation::sticky_error;
using infinigen::cuda_emulation::thread_error;

cudaError_t cudaGetLastError() {
  const cudaError_t sticky_code = sticky_error();
  if (sticky_code != cudaSuccess) return sticky_code;
  const cudaError_t code = thread_error.code;
  thread_error.code = cudaSuccess;
  return code;
}

cudaError_t cudaPeekAtLastError() {
  const cudaError_t sticky_code = sticky_error();
  return sticky_code != cudaSuccess ? sticky_code : thread_error.code;
}

const char* cudaGetErrorString(cudaError_t code) {
  auto& state = infinigen::cuda_emulation::sticky();
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (code != cudaSuccess && code == state.code) return state.explanation->c_str();
  }
  if (code != cudaSuccess && code == thread_error.explained_code) {
    return thread_error.explanation.c_str();
  }
  return infinigen::cuda_emulation::generic_string(code);
}

const char* cudaGetErrorName(cudaError_t code) {
  switch (code) {
#define INFINIGEN_EMULATION_NAME(name) \
  case name:                           \
    return #name;
    INFINIGEN_EMULATION_NAME(cudaSuccess)
    INFINIGEN_EMULATION_NAME(cudaErrorInvalidValue)
    INFINIGEN_EMULATION_NAME(cudaErrorMemoryAllocation)
    INFINIGEN_EMULATION_NAME(cudaErrorInitializationError)
    INFINIGEN_EMULATION_NAME(cudaErrorInvalidConfiguration)
    INFINIGEN_EMULATION_NAME(cudaErrorInvalidDevicePointer)
    INFINIGEN_EMULATION_NAME(cudaErrorInvalidMemcpyDirection)
    INFINIGEN_EMULATION_NAME(cudaErrorInsufficientDriver)
    INFINIGEN_EMULATION_NAME(cudaErrorNoDevice)
    INFINIGEN_EMULATION_NAME(cudaErrorInvalidDevice)
    INFINIGEN_EMULATION_NAME(cudaErrorInvalidResourceHandle)
    INFINIGEN_EMULATION_NAME(cudaErrorNotReady)
    INFINIGEN_EMULATION_NAME(cudaErrorIllegalAddress)
    INFINIGEN_EMULATION_NAME(cudaErrorLaunchOutOfResources)
    INFINIGEN_EMULATION_NAME(cudaErrorHostMemoryAlreadyRegistered)
    INFINIGEN_EMULATION_NAME(cudaErrorHostMemoryNotRegistered)
    INFINIGEN_EMULATION_NAME(cudaErrorLaunchFailure)
    INFINIGEN_EMULATION_NAME(cudaErrorUnknown)
#undef INFINIGEN_EMULATION_NAME
  }
  return "cudaErrorUnknown";
}
