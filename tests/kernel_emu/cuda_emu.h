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
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __grid_constant__

struct __half { _Float16 v; };
struct __half2 { __half x, y; };
struct __nv_bfloat16 { uint16_t v; };
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
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
}  // namespace emu
