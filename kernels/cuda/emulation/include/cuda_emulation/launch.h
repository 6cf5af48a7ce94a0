// kernels/cuda/emulation: kernel launches. INFINIGEN_LAUNCH (kernels/cuda/common.cuh) spells
// kernel<<<grid, block, shared_bytes, stream>>>(args...) as
// launch(kernel, name, file, line, grid, block, shared_bytes, stream)(args...) here: the launch is
// checked as CUDA checks it (limits, shared memory) and queued on the stream; the arguments are
// converted to the kernel's parameter types and copied, as a real launch copies them.
#pragma once

#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cuda_emulation/api.h"

namespace infinigen::cuda_emulation {

struct LaunchSite {
  const char* kernel;  // the launch expression, e.g. "decode_kernel<T, 1>"
  const char* file;
  int line;
};

struct PointerArgument {
  int index;  // the parameter's position, from 1
  const void* pointer;
};

struct KernelLaunch {
  const void* kernel;  // identifies the kernel (cudaFuncSetAttribute's key)
  LaunchSite site;
  dim3 grid;
  dim3 block;
  size_t shared_bytes;
  cudaStream_t stream;
  std::vector<PointerArgument> pointers;  // checked against device memory when the kernel runs
  std::function<void()> thread_body;      // the kernel called with its arguments, per thread
};

// Validates and queues a launch; the result is what cudaGetLastError reports after a launch.
cudaError_t submit_kernel(KernelLaunch launch);

template <typename... Params>
class Launcher {
 public:
  using Kernel = void (*)(Params...);
  Launcher(Kernel kernel, LaunchSite site, dim3 grid, dim3 block, size_t shared_bytes,
           cudaStream_t stream)
      : kernel_(kernel),
        site_(site),
        grid_(grid),
        block_(block),
        shared_bytes_(shared_bytes),
        stream_(stream) {}

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "wrong number of kernel arguments");
    using Arguments = std::tuple<std::decay_t<Params>...>;
    auto arguments = std::make_shared<Arguments>(std::forward<Args>(args)...);
    KernelLaunch launch{reinterpret_cast<const void*>(kernel_),
                        site_,
                        grid_,
                        block_,
                        shared_bytes_,
                        stream_,
                        pointer_arguments(*arguments, std::index_sequence_for<Params...>{}),
                        [kernel = kernel_, arguments] { std::apply(kernel, *arguments); }};
    submit_kernel(std::move(launch));  // its result is read back with cudaGetLastError
  }

 private:
  template <typename Arguments, size_t... I>
  static std::vector<PointerArgument> pointer_arguments(const Arguments& arguments,
                                                        std::index_sequence<I...>) {
    std::vector<PointerArgument> pointers;
    (add_pointer<std::tuple_element_t<I, Arguments>>(pointers, static_cast<int>(I) + 1,
                                                     std::get<I>(arguments)),
     ...);
    return pointers;
  }
  template <typename T>
  static void add_pointer(std::vector<PointerArgument>& pointers, int index, const T& value) {
    if constexpr (std::is_pointer_v<T> && !std::is_function_v<std::remove_pointer_t<T>>) {
      if (value != nullptr) pointers.push_back({index, static_cast<const void*>(value)});
    }
  }

  Kernel kernel_;
  LaunchSite site_;
  dim3 grid_;
  dim3 block_;
  size_t shared_bytes_;
  cudaStream_t stream_;
};

template <typename... Params>
Launcher<Params...> launch(void (*kernel)(Params...), const char* name, const char* file, int line,
                           dim3 grid, dim3 block, size_t shared_bytes = 0,
                           cudaStream_t stream = nullptr) {
  return Launcher<Params...>(kernel, LaunchSite{name, file, line}, grid, block, shared_bytes,
                             stream);
}

}  // namespace infinigen::cuda_emulation

#define INFINIGEN_EMULATED_LAUNCH(grid, block, shared_bytes, stream, ...)                         \
  ::infinigen::cuda_emulation::launch(__VA_ARGS__, #__VA_ARGS__, __FILE__, __LINE__, grid, block, \
                                      shared_bytes, stream)
