// A CPU executor for the CUDA rendering of the kernels (benchmarks/emulate_kernel.py): the kernel body
// runs unchanged as host C++, one cooperative context (ucontext) per CUDA thread of a block, blocks one
// after another in a chosen order. __syncthreads, warp shuffles and mma.sync m16n8k16 (fragment
// layouts written from the PTX ISA, independently of metal/prelude_cuda.h) are emulated; a barrier that
// not every live thread of its scope reaches is reported as a deadlock. Slow (a context switch per
// barrier), for checking a kernel's logic without a GPU, never its speed or memory ordering.
#pragma once
#include <ucontext.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__

// alignments as CUDA's headers declare them (vector_types.h, cuda_fp16.hpp): the layout and the alignment
// checks below depend on them
struct alignas(2) __half { _Float16 v; };
struct alignas(4) __half2 { __half x, y; };
struct alignas(2) __nv_bfloat16 { uint16_t v; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float __half2float(__half h) { return (float)h.v; }
inline __half __float2half_rn(float f) { return {(_Float16)f}; }
inline __half2 __floats2half2_rn(float a, float b) { return {{(_Float16)a}, {(_Float16)b}}; }
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = (uint32_t)b.v << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even (finite inputs)
  return {(uint16_t)(u >> 16)};
}
inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned sh) {
  return (unsigned)((((uint64_t)hi << 32) | lo) >> (sh & 31u));
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __ldcg(const float* p) { return *p; }
inline float4 __ldcg(const float4* p) { return *p; }
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  unsigned o = *p;
  *p = o + v;
  return o;
}
inline unsigned atomicExch(unsigned* p, unsigned v) {
  unsigned o = *p;
  *p = v;
  return o;
}

struct rq_dim3 { unsigned x, y, z; };

// ---------------------------------------------------------------------------------------------
// cooperative threads of one block

namespace emu {
enum State { READY, WAIT_BLOCK, WAIT_WARP, DONE };
struct Thread {
  ucontext_t ctx;
  std::vector<char> stack;
  State state = READY;
};
inline std::vector<Thread> threads;
inline ucontext_t sched;
inline int cur = 0;
inline int nthreads = 0;
inline rq_dim3 tid, bid, bdim, gdim;
inline std::function<void()> body;
inline unsigned warp_u[1024];
inline float warp_f[1024];
inline bool deadlock = false;

inline void yield() { swapcontext(&threads[cur].ctx, &sched); }

inline void warp_barrier() {
  const int w = cur / 32;
  const int n = std::min(32, nthreads - 32 * w);
  threads[cur].state = WAIT_WARP;
  int waiting = 0;
  for (int i = 0; i < n; ++i) waiting += threads[32 * w + i].state == WAIT_WARP;
  if (waiting == n) {
    for (int i = 0; i < n; ++i) threads[32 * w + i].state = READY;
    return;  // the last lane to arrive goes on at once
  }
  yield();
}

inline void block_barrier() {
  threads[cur].state = WAIT_BLOCK;
  yield();
}

inline void entry() {
  body();
  threads[cur].state = DONE;
  swapcontext(&threads[cur].ctx, &sched);
}

// run one block of n threads to completion; false on a deadlock
inline bool run_block(int n) {
  nthreads = n;
  threads.assign(n, Thread());
  for (int i = 0; i < n; ++i) {
    threads[i].stack.resize(1 << 18);
    getcontext(&threads[i].ctx);
    threads[i].ctx.uc_stack.ss_sp = threads[i].stack.data();
    threads[i].ctx.uc_stack.ss_size = threads[i].stack.size();
    threads[i].ctx.uc_link = nullptr;
    makecontext(&threads[i].ctx, (void (*)())entry, 0);
  }
  for (;;) {
    bool ran = false;
    for (int i = 0; i < n; ++i) {
      if (threads[i].state != READY) continue;
      cur = i;
      tid = {(unsigned)i, 0u, 0u};
      swapcontext(&sched, &threads[i].ctx);
      ran = true;
    }
    if (ran) continue;
    int done = 0, at_block = 0;
    for (auto& t : threads) {
      done += t.state == DONE;
      at_block += t.state == WAIT_BLOCK;
    }
    if (done == n) return true;
    if (at_block + done == n) {  // every live thread is at __syncthreads: release them
      for (auto& t : threads)
        if (t.state == WAIT_BLOCK) t.state = READY;
      continue;
    }
    deadlock = true;
    std::fprintf(stderr, "emu: deadlock in block (%u, %u): %d done, %d at __syncthreads, rest at a warp barrier\n",
                 bid.x, bid.y, done, at_block);
    return false;
  }
}
}  // namespace emu

#define threadIdx emu::tid
#define blockIdx emu::bid
#define blockDim emu::bdim
#define gridDim emu::gdim

inline void __syncthreads() { emu::block_barrier(); }
inline float __shfl_xor_sync(unsigned, float x, int m) {
  const int lane = emu::cur & 31;
  const int base = emu::cur & ~31;
  emu::warp_f[emu::cur] = x;
  emu::warp_barrier();
  const float y = emu::warp_f[base + (lane ^ m)];
  emu::warp_barrier();
  return y;
}

inline void __syncwarp() { emu::warp_barrier(); }  // attn_v5
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
}
inline int __any_sync(unsigned, int b) {
  const int base = emu::cur & ~31;
  emu::warp_f[emu::cur] = b ? 1.0f : 0.0f;
  emu::warp_barrier();
  int any = 0;
  for (int i = 0; i < std::min(32, emu::nthreads - base); ++i) any |= emu::warp_f[base + i] != 0.0f;
  emu::warp_barrier();
  return any;
}

// mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32, from the PTX ISA's fragment layouts
// (groupID = lane >> 2, tig = lane % 4):
//   A 16x16: reg 0 = (g, 2t..2t+1), reg 1 = (g + 8, 2t..), reg 2 = (g, 2t + 8..), reg 3 = (g + 8, 2t + 8..)
//   B 16x8:  reg 0 = (k 2t..2t+1, n g), reg 1 = (k 2t + 8.., n g)
//   C 16x8:  c0, c1 = (g, 2t..2t+1), c2, c3 = (g + 8, 2t..2t+1)
namespace emu {
inline unsigned mma_a[1024][4], mma_b[1024][2];  // per thread: warps interleave
inline float h_lo(unsigned u) {
  _Float16 h;
  uint16_t s = (uint16_t)(u & 0xffffu);
  std::memcpy(&h, &s, 2);
  return (float)h;
}
inline float h_hi(unsigned u) { return h_lo(u >> 16); }
inline void mma(float c[4], const unsigned a[4], const unsigned b[2]) {
  const int lane = cur & 31;
  const int base = cur & ~31;
  for (int i = 0; i < 4; ++i) mma_a[cur][i] = a[i];
  for (int i = 0; i < 2; ++i) mma_b[cur][i] = b[i];
  warp_barrier();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l >> 2, t = l & 3;
    for (int r = 0; r < 4; ++r) {
      const int row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
      A[row][col] = h_lo(mma_a[base + l][r]);
      A[row][col + 1] = h_hi(mma_a[base + l][r]);
    }
    for (int r = 0; r < 2; ++r) {
      B[2 * t + 8 * r][g] = h_lo(mma_b[base + l][r]);
      B[2 * t + 8 * r + 1][g] = h_hi(mma_b[base + l][r]);
    }
  }
  warp_barrier();
  const int g = lane >> 2, t = lane & 3;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    float s = c[e];
    for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
    c[e] = s;
  }
}
// movmatrix.sync.aligned.m8n8.trans.b16, from the PTX ISA: an 8x8 matrix of 16-bit elements, lane l holding row
// l >> 2, columns 2 (l % 4) and 2 (l % 4) + 1 (low half first); each lane gets the same places of the transpose
inline unsigned movm_trans(unsigned x) {
  const int lane = cur & 31;
  const int base = cur & ~31;
  mma_b[cur][0] = x;
  warp_barrier();
  unsigned y = 0;
  for (int j = 0; j < 2; ++j) {  // the transpose's (row lane >> 2, col 2 (lane % 4) + j) = source (2 (lane % 4) + j, lane >> 2)
    const int row = 2 * (lane & 3) + j, col = lane >> 2;
    const unsigned src = mma_b[base + 4 * row + (col >> 1)][0];
    y |= ((src >> (16 * (col & 1))) & 0xffffu) << (16 * j);
  }
  warp_barrier();
  return y;
}
}  // namespace emu

// ---------------------------------------------------------------------------------------------
// Memory the hardware checks: a vector access (uint4, float4, half2 ... through a cast) and a cp.async
// 16-byte copy fault on a GPU ("misaligned address") unless each address is aligned to the access size.
// The executor runs every block to the end and reports each distinct fault once (emu::report).
namespace emu {
struct Region {
  const char* base;
  size_t bytes;
  std::string name;
  bool shared;
};
inline std::vector<Region> regions;  // global buffers (inputs, outputs) and threadgroup arrays
inline std::map<std::string, std::pair<std::string, long>> faults;  // kind -> (first instance, count)
enum Space { ANY, GLOBAL, SHARED };

inline const Region* find_region(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (const auto& r : regions)
    if (c >= r.base && c < r.base + r.bytes) return &r;
  return nullptr;
}

inline void fault(const std::string& kind, const std::string& msg) {
  auto& f = faults[kind];
  if (f.second++ == 0) f.first = msg;
}

// threadgroup memory of a block, laid out as a compiler would place static __shared__ arrays: in
// declaration order, each aligned only to its type (alignof). worst_layout: each array at an odd multiple
// of its alignment (aligned to it and to nothing more), so no access may rely on accidental alignment.
alignas(4096) inline unsigned char smem[232448];
inline size_t smem_top = 0;
inline bool worst_layout = false;
template <class T>
T& shared_alloc(size_t align, const char* name) {
  size_t off = (smem_top + align - 1) / align * align;
  if (worst_layout && align < 4096 && off % (2 * align) == 0) off += align;
  if (off + sizeof(T) > sizeof(smem)) {
    std::fprintf(stderr, "emu: threadgroup memory over %zu bytes\n", sizeof(smem));
    std::abort();
  }
  smem_top = off + sizeof(T);
  regions.push_back({reinterpret_cast<const char*>(smem + off), sizeof(T), name, true});
  return *reinterpret_cast<T*>(smem + off);
}

inline std::string where(const void* p) {
  const Region* r = find_region(p);
  const size_t a = reinterpret_cast<uintptr_t>(p);
  if (!r) return "thread-local or unknown memory (address % 16 = " + std::to_string(a % 16) + ")";
  const size_t off = static_cast<const char*>(p) - r->base;
  const size_t base = r->shared ? static_cast<size_t>(r->base - reinterpret_cast<const char*>(smem)) : 0;
  return std::string(r->shared ? "threadgroup array " : "buffer ") + r->name + " + " + std::to_string(off) + " B" +
         (r->shared ? " (threadgroup byte " + std::to_string(base + off) + ")" : "") +
         " (address % 16 = " + std::to_string(a % 16) + ")";
}

// an access of n bytes at p that must be aligned to `align` and lie in one buffer of space `sp`
inline void check(const void* p, size_t n, size_t align, const char* what, Space sp) {
  const size_t a = reinterpret_cast<uintptr_t>(p);
  if (a % align != 0) {
    fault(std::string("misaligned ") + what + " @" + (find_region(p) ? find_region(p)->name : "?") + " %" +
              std::to_string(a % align),
          std::string("misaligned address: ") + what + " (" + std::to_string(n) + " B, needs " +
              std::to_string(align) + "-byte alignment) at " + where(p));
  }
  if (sp == ANY && n < 8) return;  // scalar-sized reinterpretations of registers: alignment only
  const Region* r = find_region(p);
  const bool ok = r && static_cast<const char*>(p) + n <= r->base + r->bytes &&
                  (sp == ANY || r->shared == (sp == SHARED));
  if (!ok && !(sp == ANY && !r))
    fault(std::string("out of bounds ") + what, std::string("out of bounds / wrong space: ") + what + " (" +
                                                    std::to_string(n) + " B) at " + where(p));
}

// reinterpret_cast<P>(q) of the preludes, with the access it is made for checked (P's pointee)
template <class P, class Q>
inline P checked_cast(const char* fn, Q* q) {
  using T = std::remove_cv_t<std::remove_pointer_t<P>>;
  check(q, sizeof(T), alignof(T), fn, ANY);
  return reinterpret_cast<P>(q);
}

// cp.async.cg.shared.global 16 bytes: source in global memory, destination in threadgroup memory,
// both 16-byte aligned (PTX ISA: cp.async), completed at once here
inline void cp_async16(void* dst, const void* src) {
  check(src, 16, 16, "cp.async source (global)", GLOBAL);
  check(dst, 16, 16, "cp.async destination (threadgroup)", SHARED);
  std::memcpy(dst, src, 16);
}

// the distinct faults, once each; true if there were none
inline bool report() {
  for (const auto& [kind, f] : faults)
    std::fprintf(stderr, "emu: %s [%ld times]\n", f.first.c_str(), f.second);
  return faults.empty();
}
}  // namespace emu
