// kernels/cpu: when a kernel is worth spreading over OpenMP threads.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cpu {

// Multiply-adds (or elements touched) below which a kernel runs on the calling thread: waking a
// thread team costs microseconds, more than small ops of tiny models take.
inline constexpr int64_t kParallelWork = int64_t{1} << 16;

}  // namespace infinigen::kernels::cpu
