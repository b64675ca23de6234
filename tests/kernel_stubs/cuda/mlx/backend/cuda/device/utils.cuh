// Stub of MLX's device utils header for the syntax check: only what generated kernels name.
#pragma once
#include <array>
#include <cuda_fp16.h>
namespace mlx::core::cu {
using Shape = std::array<int32_t, 8>;
using Strides = std::array<int64_t, 8>;
}
