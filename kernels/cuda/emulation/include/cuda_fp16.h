// kernels/cuda/emulation: stands in for CUDA's <cuda_fp16.h> in the emulated build.
#pragma once

#include "cuda_emulation/half.h"
