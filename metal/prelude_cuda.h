// CUDA prelude: maps the spellings the kernel bodies use onto CUDA (rendered for mx.fast.cuda_kernel).
// The bodies and common.h are shared with Metal; only this file and prelude_metal.h differ.
#include <cuda_fp16.h>
typedef unsigned int uint;
#define DEV
#define TG
#define THR
#define SHARED __shared__
#define INLINE __device__ __forceinline__
#define UNROLL _Pragma("unroll")
#define BARRIER() __syncthreads()
INLINE float to_float(__half x) { return __half2float(x); }
INLINE float fmax_f(float a, float b) { return fmaxf(a, b); }
INLINE float exp2_f(float x) { return exp2f(x); }
INLINE float rsqrt_f(float x) { return rsqrtf(x); }
INLINE float simd_sum_f(float x) {
  UNROLL for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}
INLINE float simd_max_f(float x) {
  UNROLL for (int m = 16; m > 0; m >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
INLINE float shfl_xor_f(float x, int m) { return __shfl_xor_sync(0xffffffffu, x, m); }
// bits [sh, sh + 32) of the 64-bit value hi:lo (sh < 32)
INLINE uint funnel_r(uint lo, uint hi, uint sh) { return __funnelshift_r(lo, hi, sh); }
INLINE uint4 load_u4(DEV const uint* p) { return *reinterpret_cast<const uint4*>(p); }
INLINE float4 load_f4(TG const float* p) { return *reinterpret_cast<const float4*>(p); }
INLINE float log2_f(float x) { return log2f(x); }
#define NEG_INF_F __int_as_float(0xff800000)
//--- body ---
const uint TID = threadIdx.x;
const uint NT = blockDim.x;
const uint BX = blockIdx.x;
const uint BY = blockIdx.y;
