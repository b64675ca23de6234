// Stub of the CUDA spellings the kernels use, for a host C++ compiler's syntax check only.
#pragma once
#include <cmath>
#include <cstdint>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__
struct rq_dim3 { unsigned x, y, z; };
extern rq_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct __half { unsigned short v; };
struct __half2 { __half x, y; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
float __half2float(__half);
__half __float2half_rn(float);
__half2 __floats2half2_rn(float, float);
unsigned __funnelshift_r(unsigned, unsigned, unsigned);
float __shfl_xor_sync(unsigned, float, int);
void __syncthreads();
void __syncwarp();  // attn_v5
int __any_sync(unsigned, int);
unsigned __byte_perm(unsigned, unsigned, unsigned);
size_t __cvta_generic_to_shared(const void*);  // attn_v5 (cp.async)
float __int_as_float(int);
inline float exp2f(float x) { return std::exp2(x); }
inline float fmaxf(float a, float b) { return std::fmax(a, b); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float log2f(float x) { return std::log2(x); }
// device-scope atomics, fences and L2 loads (attn_v4)
unsigned atomicAdd(unsigned*, unsigned);
unsigned atomicExch(unsigned*, unsigned);
void __threadfence();
void __threadfence_system();
void __nanosleep(unsigned int ns);
float __ldcg(const float*);
float4 __ldcg(const float4*);
