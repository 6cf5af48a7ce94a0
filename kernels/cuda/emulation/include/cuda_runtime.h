// kernels/cuda/emulation: stands in for CUDA's <cuda_runtime.h> in the emulated build (the
// `emulate` preset puts this folder first on the include path of the .cu sources).
#pragma once

// launch.h first: its standard headers must not see the device language's macros.
#include "cuda_emulation/api.h"
#include "cuda_emulation/launch.h"
// clang-format off
#include "cuda_emulation/device_language.h"
// clang-format on
