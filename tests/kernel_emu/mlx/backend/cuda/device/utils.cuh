// The CPU executor's stand-in for MLX's device utils header (benchmarks/emulate_kernel.py).
#pragma once
#include "cuda_emu.h"
namespace mlx::core::cu {
using Shape = std::array<int32_t, 8>;
using Strides = std::array<int64_t, 8>;
}
