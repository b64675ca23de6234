// Metal prelude: maps the spellings the kernel bodies use onto Metal (rendered for mx.fast.metal_kernel).
// The bodies and common.h are shared with CUDA; only this file and prelude_cuda.h differ.
#define DEV device
#define TG threadgroup
#define THR thread
#define SHARED threadgroup
#define INLINE inline
#define UNROLL _Pragma("unroll")
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
INLINE float to_float(half x) { return float(x); }
INLINE float fmax_f(float a, float b) { return fmax(a, b); }
INLINE float exp2_f(float x) { return exp2(x); }
INLINE float rsqrt_f(float x) { return rsqrt(x); }
INLINE float simd_sum_f(float x) { return simd_sum(x); }
INLINE float simd_max_f(float x) { return simd_max(x); }
INLINE float shfl_xor_f(float x, int m) { return simd_shuffle_xor(x, ushort(m)); }
// bits [sh, sh + 32) of the 64-bit value hi:lo (sh < 32)
INLINE uint funnel_r(uint lo, uint hi, uint sh) { return sh == 0u ? lo : ((lo >> sh) | (hi << (32u - sh))); }
INLINE uint4 load_u4(DEV const uint* p) { return *((DEV const uint4*)p); }
INLINE float4 load_f4(TG const float* p) { return *((TG const float4*)p); }
INLINE float log2_f(float x) { return log2(x); }
#define NEG_INF_F (-INFINITY)
//--- body ---
const uint TID = thread_position_in_threadgroup.x;
const uint NT = threads_per_threadgroup.x;
const uint BX = threadgroup_position_in_grid.x;
const uint BY = threadgroup_position_in_grid.y;
