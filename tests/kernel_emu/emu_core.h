// The part of the CPU executor both renderings share (cuda_emu.h, metal_emu.h): the kernel body runs unchanged as
// host C++, one cooperative context per GPU thread of a block, blocks one after another in a chosen order; a barrier
// of the block (__syncthreads, threadgroup_barrier) or of a 32-lane group (a warp, a SIMD group: shuffles,
// reductions, matrix fragments) that not every live thread of its scope reaches is reported as a deadlock. Plus the
// memory the hardware checks (alignment, bounds) and the block's threadgroup memory. Slow (a context switch per
// barrier), for checking a kernel's logic without a GPU, never its speed or memory ordering.
#pragma once
#ifndef RQ_EMU_CORE_H  // also a guard: a precompiled header keeps macros, not every compiler's pragma-once state
#define RQ_EMU_CORE_H
#include <ucontext.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

struct rq_dim3 { unsigned x, y, z; };

#if defined(__x86_64__)
// a context switch without swapcontext's signal-mask system call (most of the executor's time otherwise): the
// callee-saved registers pushed on the old stack, its stack pointer stored in *from, the new one's loaded
extern "C" void rq_emu_switch(void** from, void* to);
asm(R"(
  .text
  .globl rq_emu_switch
  .type rq_emu_switch, @function
rq_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size rq_emu_switch, .-rq_emu_switch
)");
#endif

// ---------------------------------------------------------------------------------------------
// cooperative threads of one block

namespace emu {
enum State { READY, WAIT_BLOCK, WAIT_WARP, DONE };
struct Thread {
#if defined(__x86_64__)
  void* sp = nullptr;
#else
  ucontext_t ctx;
#endif
  std::vector<char> stack;
  State state = READY;
};
inline std::vector<Thread> threads;
#if defined(__x86_64__)
inline void* sched_sp = nullptr;
#else
inline ucontext_t sched;
#endif
inline int cur = 0;
inline int nthreads = 0;
inline rq_dim3 tid, bid, bdim, gdim;
inline std::function<void()> body;
inline void (*thread_exit_hook)() = nullptr;  // a backend's work left at a thread's end (cp.async copies)
inline bool deadlock = false;
inline unsigned seed = 0;
inline std::mt19937 rng;

inline void to_sched() {
#if defined(__x86_64__)
  rq_emu_switch(&threads[cur].sp, sched_sp);
#else
  swapcontext(&threads[cur].ctx, &sched);
#endif
}
inline void yield() { to_sched(); }

// the lanes of the calling thread's 32-lane group (warp / SIMD group) and how many of them the block has
inline int lane() { return cur & 31; }
inline int lane_base() { return cur & ~31; }
inline int group_size() { return std::min(32, nthreads - lane_base()); }

inline void warp_barrier() {
  const int w = lane_base();
  const int n = group_size();
  threads[cur].state = WAIT_WARP;
  int waiting = 0;
  for (int i = 0; i < n; ++i) waiting += threads[w + i].state == WAIT_WARP;
  if (waiting == n) {
    for (int i = 0; i < n; ++i) threads[w + i].state = READY;
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
  if (thread_exit_hook) thread_exit_hook();
  threads[cur].state = DONE;
  to_sched();
}

inline void start_thread(Thread& t) {
  t.stack.resize(1 << 18);
#if defined(__x86_64__)
  // a stack whose first switch to it pops six zero registers and "returns" into entry with the alignment a call
  // leaves (stack pointer 8 bytes below a 16-byte boundary)
  uintptr_t top = (reinterpret_cast<uintptr_t>(t.stack.data()) + t.stack.size()) & ~uintptr_t(15);
  void** sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                                 // entry's return address (it never returns)
  *--sp = reinterpret_cast<void*>(&entry);         // where the first switch returns to
  for (int i = 0; i < 6; ++i) *--sp = nullptr;     // rbp rbx r12 r13 r14 r15
  t.sp = sp;
#else
  getcontext(&t.ctx);
  t.ctx.uc_stack.ss_sp = t.stack.data();
  t.ctx.uc_stack.ss_size = t.stack.size();
  t.ctx.uc_link = nullptr;
  makecontext(&t.ctx, (void (*)())entry, 0);
#endif
}

inline void switch_to(int i) {
#if defined(__x86_64__)
  rq_emu_switch(&sched_sp, threads[i].sp);
#else
  swapcontext(&sched, &threads[i].ctx);
#endif
}

// run one block of n threads to completion; false on a deadlock
inline bool run_block(int n) {
  nthreads = n;
  threads.assign(n, Thread());
  for (int i = 0; i < n; ++i) start_thread(threads[i]);
  for (;;) {
    bool ran = false;
    for (int i = 0; i < n; ++i) {
      if (threads[i].state != READY) continue;
      cur = i;
      tid = {(unsigned)i, 0u, 0u};
      switch_to(i);
      ran = true;
    }
    if (ran) continue;
    int done = 0, at_block = 0;
    for (auto& t : threads) {
      done += t.state == DONE;
      at_block += t.state == WAIT_BLOCK;
    }
    if (done == n) return true;
    if (at_block + done == n) {  // every live thread is at the block's barrier: release them
      for (auto& t : threads)
        if (t.state == WAIT_BLOCK) t.state = READY;
      continue;
    }
    deadlock = true;
    std::fprintf(stderr, "emu: deadlock in block (%u, %u): %d done, %d at the block's barrier, rest at a "
                 "warp / SIMD-group barrier\n", bid.x, bid.y, done, at_block);
    return false;
  }
}

// ---- lane exchange: every lane of the group posts a value, all read each other's ----
inline uint64_t lane_slot[1024][4];

// the group's values of x (lane order), posted and read between two group barriers
template <class T>
inline std::array<T, 32> gather(const T& x) {
  static_assert(sizeof(T) <= sizeof(lane_slot[0]) && std::is_trivially_copyable_v<T>);
  std::memcpy(lane_slot[cur], &x, sizeof(T));
  warp_barrier();
  std::array<T, 32> v{};
  const int b = lane_base(), n = group_size();
  for (int i = 0; i < n; ++i) std::memcpy(&v[i], lane_slot[b + i], sizeof(T));
  for (int i = n; i < 32; ++i) v[i] = x;
  warp_barrier();
  return v;
}
// the value of lane `src` (an absent lane's: the caller's own, as undefined on the hardware)
template <class T>
inline T from_lane(const T& x, int src) {
  const auto v = gather(x);
  return src >= 0 && src < group_size() ? v[src] : x;
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

// threadgroup memory of a block, laid out as a compiler would place static threadgroup arrays: in
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

// the distinct faults, once each; true if there were none
inline bool report() {
  for (const auto& [kind, f] : faults)
    std::fprintf(stderr, "emu: %s [%ld times]\n", f.first.c_str(), f.second);
  return faults.empty();
}
}  // namespace emu
#endif  // RQ_EMU_CORE_H
