// kernels/cuda: element types of the weight, table and cache buffers the CUDA kernels read.
// Activations are always fp32; these name the storage type of everything else.
#pragma once

namespace infinigen::kernels::cuda {

enum class Element { F32, F16, BF16 };

}  // namespace infinigen::kernels::cuda
