// Just enough of Metal's built-ins for a C++ compiler to syntax-check the Metal rendering of the
// kernels (tests/test_kernels.py); semantics are not modelled.
#pragma once
#include <cmath>
#include <cstdint>
#define device
#define threadgroup
#define thread
#define constant
typedef unsigned int uint;
typedef unsigned short ushort;
typedef _Float16 half;
typedef half float16_t;
struct uint3 { uint x, y, z; };
struct uint4 {
  uint x, y, z, w;
  uint4() = default;
  explicit uint4(uint v) : x(v), y(v), z(v), w(v) {}
};
struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
};
struct half2 {
  half x, y;
  half2() = default;
  half2(half a, half b) : x(a), y(b) {}
};
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) {}
inline float simd_sum(float x) { return x; }
inline float simd_max(float x) { return x; }
inline float simd_shuffle_xor(float x, ushort) { return x; }
inline void simdgroup_barrier(mem_flags) {}  // attn_v5
inline bool simd_any(bool b) { return b; }
typedef unsigned long ulong;
template <class T, class U> T as_type(U u) { T t; __builtin_memcpy(&t, &u, sizeof(T)); return t; }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
using std::exp2;
using std::fmax;
using std::log2;
template <class T, int R, int C>
struct simdgroup_matrix {
  T e[2];
  T* thread_elements() { return e; }
};
template <class T, int R, int C>
simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) { return {{v, v}}; }
template <class T, class U, int R, int C>
void simdgroup_multiply_accumulate(simdgroup_matrix<T, R, C>& d, const simdgroup_matrix<U, R, C>&,
                                   const simdgroup_matrix<U, R, C>&, const simdgroup_matrix<T, R, C>&) {}
struct bfloat16_t {
  unsigned short v;
  bfloat16_t() = default;
  bfloat16_t(float);
  explicit operator float() const;
};
// device-scope atomics (attn_v4)
struct atomic_uint { unsigned v; };
enum memory_order { memory_order_relaxed };
uint atomic_fetch_add_explicit(device atomic_uint*, uint, memory_order);
void atomic_store_explicit(device atomic_uint*, uint, memory_order);
