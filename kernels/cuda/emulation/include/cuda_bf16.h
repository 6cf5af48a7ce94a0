// kernels/cuda/emulation: stands in for CUDA's <cuda_bf16.h> in the emulated build.
#pragma once

#include "cuda_emulation/half.h"
