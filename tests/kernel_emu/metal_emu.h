// A CPU executor for the Metal rendering of the kernels: the kernel function compiled as host C++ and run on the
// cooperative threads of emu_core.h, one context per thread of a threadgroup, threadgroups one after another. The
// Metal built-ins the preludes use have their semantics across the 32 lanes of a SIMD group (threads 32 s ..
// 32 s + 31 of a one-dimensional threadgroup): simd_sum / simd_max / simd_any / simd_shuffle_xor / simd_broadcast
// exchange values between the lanes' contexts, threadgroup_barrier is the threadgroup's barrier (whatever its
// flags: it always synchronizes execution), simdgroup_barrier the SIMD group's. simdgroup_matrix<T, 8, 8> holds two
// elements a lane; which two is Apple's layout (as MLX's steel MMA fragments use it), written here from the lane's
// bits and not from metal/prelude_metal.h: lane bits b0..b4 hold row b1 + 2 b2 + 4 b4, columns 2 b0 + 4 b3 and the
// next one. simdgroup_multiply_accumulate gathers the 32 lanes' elements into whole 8x8 matrices, multiplies in
// float and gives each lane its elements of the result. Address-space qualifiers are empty; threadgroup arrays are
// laid out by emu::shared_alloc (emulate.py rewrites their declarations).
#pragma once
#ifndef RQ_METAL_EMU_H  // also a guard: a precompiled header keeps macros, not every compiler's pragma-once state
#define RQ_METAL_EMU_H
#include "emu_core.h"

#define device
#define threadgroup
#define thread
#define constant

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;
typedef _Float16 half;
typedef half float16_t;

struct uint3 {
  uint x, y, z;
};
struct uint4 {
  uint x, y, z, w;
  uint4() = default;
  uint4(uint a, uint b, uint c, uint d) : x(a), y(b), z(c), w(d) {}
  explicit uint4(uint v) : x(v), y(v), z(v), w(v) {}
};
struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
  explicit float4(float v) : x(v), y(v), z(v), w(v) {}
};
struct half2 {
  half x, y;
  half2() = default;
  half2(half a, half b) : x(a), y(b) {}
};
static_assert(sizeof(half2) == 4 && sizeof(uint4) == 16 && sizeof(float4) == 16);

// bfloat: the high 16 bits of a float, rounded to nearest even from float
struct bfloat16_t {
  uint16_t v;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      v = (uint16_t)((u >> 16) | 0x40u);  // NaN stays NaN
      return;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    v = (uint16_t)(u >> 16);
  }
  explicit operator float() const {
    uint32_t u = (uint32_t)v << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};
namespace emu {
inline bfloat16_t bf16_bits(uint16_t b) {
  bfloat16_t x;
  x.v = b;
  return x;
}
}  // namespace emu

template <class T, class U>
T as_type(U u) {
  static_assert(sizeof(T) == sizeof(U));
  T t;
  std::memcpy(&t, &u, sizeof(T));
  return t;
}
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
using std::exp2;
using std::fmax;
using std::log2;
using std::sqrt;

// ---- synchronization ----
enum class mem_flags { mem_none, mem_device, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) { emu::block_barrier(); }
inline void simdgroup_barrier(mem_flags) { emu::warp_barrier(); }

// ---- SIMD-group functions: every lane of the group takes part (one call per lane, in step) ----
template <class T>
inline T simd_sum(T x) {
  const auto v = emu::gather(x);
  // a tree over the lanes (the hardware's order is not documented; any order is within float rounding)
  std::array<T, 32> s = v;
  const int n = emu::group_size();
  for (int i = n; i < 32; ++i) s[i] = T(0);
  for (int w = 16; w > 0; w >>= 1)
    for (int i = 0; i < w; ++i) s[i] = s[i] + s[i + w];
  return s[0];
}
template <class T>
inline T simd_max(T x) {
  const auto v = emu::gather(x);
  T m = v[0];
  for (int i = 1; i < emu::group_size(); ++i) m = std::fmax(m, v[i]);
  return m;
}
inline bool simd_any(bool b) {
  const auto v = emu::gather(b);
  bool any = false;
  for (int i = 0; i < emu::group_size(); ++i) any |= v[i];
  return any;
}
inline bool simd_all(bool b) {
  const auto v = emu::gather(b);
  bool all = true;
  for (int i = 0; i < emu::group_size(); ++i) all &= v[i];
  return all;
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask) { return emu::from_lane(x, emu::lane() ^ (mask & 31)); }
template <class T>
inline T simd_shuffle(T x, ushort lane) { return emu::from_lane(x, lane & 31); }
template <class T>
inline T simd_broadcast(T x, ushort lane) { return emu::from_lane(x, lane & 31); }
template <class T>
inline T simd_shuffle_down(T x, ushort d) { return emu::from_lane(x, emu::lane() + d); }
template <class T>
inline T simd_shuffle_up(T x, ushort d) { return emu::from_lane(x, emu::lane() - d); }

// ---- simdgroup_matrix<T, 8, 8> ----
namespace emu {
// the row and first column of the two elements lane l holds (Apple's layout, from the lane's bits)
inline int sg_row(int l) { return ((l >> 1) & 1) + 2 * ((l >> 2) & 1) + 4 * ((l >> 4) & 1); }
inline int sg_col(int l) { return 2 * (l & 1) + 4 * ((l >> 3) & 1); }
}  // namespace emu

template <class T, int R, int C>
struct simdgroup_matrix {
  static_assert(R == 8 && C == 8, "8x8 simdgroup matrices only");
  T e[2];
  T* thread_elements() { return e; }
  const T* thread_elements() const { return e; }
};
template <class T, int R, int C>
simdgroup_matrix<T, R, C> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, R, C> m;
  m.e[0] = m.e[1] = v;
  return m;
}
// d = a b + c over the SIMD group: products and sums in float, d's elements rounded to its type
template <class TD, class TA, class TB, class TC>
void simdgroup_multiply_accumulate(simdgroup_matrix<TD, 8, 8>& d, const simdgroup_matrix<TA, 8, 8>& a,
                                   const simdgroup_matrix<TB, 8, 8>& b, const simdgroup_matrix<TC, 8, 8>& c) {
  struct Mine {
    float a[2], b[2];
  } mine{{(float)a.e[0], (float)a.e[1]}, {(float)b.e[0], (float)b.e[1]}};
  const float c0 = (float)c.e[0], c1 = (float)c.e[1];
  const auto all = emu::gather(mine);
  if (emu::group_size() != 32) {
    std::fprintf(stderr, "emu: simdgroup_multiply_accumulate in a SIMD group of %d lanes\n", emu::group_size());
    std::abort();
  }
  float A[8][8], B[8][8];
  for (int l = 0; l < 32; ++l)
    for (int j = 0; j < 2; ++j) {
      A[emu::sg_row(l)][emu::sg_col(l) + j] = all[l].a[j];
      B[emu::sg_row(l)][emu::sg_col(l) + j] = all[l].b[j];
    }
  const int r = emu::sg_row(emu::lane()), c_ = emu::sg_col(emu::lane());
  float s0 = c0, s1 = c1;
  for (int k = 0; k < 8; ++k) {
    s0 += A[r][k] * B[k][c_];
    s1 += A[r][k] * B[k][c_ + 1];
  }
  d.e[0] = (TD)s0;
  d.e[1] = (TD)s1;
}

// ---- device atomics (threadgroups run one after another here) ----
struct atomic_uint {
  unsigned v;
};
enum memory_order { memory_order_relaxed };
inline uint atomic_fetch_add_explicit(device atomic_uint* p, uint v, memory_order) {
  emu::check(p, 4, 4, "atomic (device)", emu::GLOBAL);
  const uint o = p->v;
  p->v = o + v;
  return o;
}
inline void atomic_store_explicit(device atomic_uint* p, uint v, memory_order) {
  emu::check(p, 4, 4, "atomic (device)", emu::GLOBAL);
  p->v = v;
}
#endif  // RQ_METAL_EMU_H
