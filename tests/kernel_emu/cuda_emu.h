// A CPU executor for the CUDA rendering of the kernels: the kernel body runs unchanged as host C++ on the
// cooperative threads of emu_core.h (one context per CUDA thread of a block, blocks one after another in a chosen
// order). __syncthreads, warp shuffles and votes are emulated across the 32 lanes of a warp, and the inline PTX of
// the prelude is executed by its semantics (emu::Ptx below: mma.sync m16n8k16 and movmatrix with the PTX ISA's
// per-lane fragment layouts, written independently of metal/prelude_cuda.h; cp.async as deferred copies with
// commit / wait_group; ex2.approx; atom; ld.shared), its operands bound as the asm statement lists them.
#pragma once
#ifndef RQ_CUDA_EMU_H  // also a guard: a precompiled header keeps macros, not every compiler's pragma-once state
#define RQ_CUDA_EMU_H
#include "emu_core.h"

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

#define threadIdx emu::tid
#define blockIdx emu::bid
#define blockDim emu::bdim
#define gridDim emu::gdim

inline void __syncthreads() { emu::block_barrier(); }
inline float __shfl_xor_sync(unsigned, float x, int m) { return emu::from_lane(x, emu::lane() ^ m); }
inline void __syncwarp() { emu::warp_barrier(); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const uint64_t v = ((uint64_t)y << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned)((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
}
inline int __any_sync(unsigned, int b) {
  const auto v = emu::gather(b != 0);
  int any = 0;
  for (int i = 0; i < emu::group_size(); ++i) any |= v[i];
  return any;
}

// ---------------------------------------------------------------------------------------------
// Shared-memory window addresses: sm_80 and later reserve the first 1 KiB of a block's shared memory for the
// system, so the block's own arrays start at window offset 1024 (CUDA programming guide, shared memory).
namespace emu {
inline constexpr unsigned SHARED_RESERVED = 1024;
inline unsigned char* shared_ptr(uint64_t addr, size_t n, const char* what) {
  if (addr < SHARED_RESERVED || addr - SHARED_RESERVED + n > sizeof(smem)) {
    fault(std::string("shared window ") + what, std::string("out of bounds / wrong space: ") + what +
                                                    " at shared address " + std::to_string(addr));
    static unsigned char sink[64];
    return sink;
  }
  return smem + (addr - SHARED_RESERVED);
}
}  // namespace emu
inline size_t __cvta_generic_to_shared(const void* p) {
  const char* c = static_cast<const char*>(p);
  const char* b = reinterpret_cast<const char*>(emu::smem);
  if (c < b || c >= b + sizeof(emu::smem)) emu::fault("cvta", "__cvta_generic_to_shared of a non-shared address");
  return (size_t)(c - b) + emu::SHARED_RESERVED;
}

// ---------------------------------------------------------------------------------------------
// Inline PTX, executed by its semantics. emulate.py rewrites each `asm [volatile] ("..." : outs : ins : clobbers)`
// of the source into a call of emu::Ptx::run with the operands bound in the statement's order (%0, %1, ...), so
// the instruction text and the operand list are both what runs: a register swapped in either changes the result.
namespace emu {
struct PtxArg {
  void* out;      // the bound lvalue of an output ("=" / "+"), else null
  uint64_t bits;  // the value (an input, or a "+" output's value on entry)
  int size;
  char kind;      // the constraint's letter: f r l h n
};
template <class T>
inline PtxArg ptx_out(T& x, char kind) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8);
  PtxArg a{&x, 0, (int)sizeof(T), kind};
  std::memcpy(&a.bits, &x, sizeof(T));
  return a;
}
template <class T>
inline PtxArg ptx_in(const T& x, char kind) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8);
  PtxArg a{nullptr, 0, (int)sizeof(T), kind};
  std::memcpy(&a.bits, &x, sizeof(T));
  return a;
}

// cp.async: copies queued per thread, grouped by commit_group, each landing either at once or only when a
// wait_group retires its group (chosen at random per copy from the run's seed): a kernel that reads a copy's
// destination before waiting for it, or refills a slot others may still read, sees the difference
struct Copy {
  void* dst;
  const void* src;
  int n;
  bool landed;
};
struct CpState {
  std::vector<Copy> open;
  std::vector<std::vector<Copy>> groups;
};
inline CpState cp_state[1024];
inline void land(std::vector<Copy>& g) {
  for (auto& c : g)
    if (!c.landed) std::memcpy(c.dst, c.src, c.n);
  g.clear();
}
inline void cp_land_all() {
  auto& st = cp_state[cur];
  for (auto& g : st.groups) land(g);
  st.groups.clear();
  land(st.open);
}
inline const bool cp_hook = (thread_exit_hook = &cp_land_all, true);

inline float f32_of(const PtxArg& a) {
  float f;
  uint32_t u = (uint32_t)a.bits;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t u32_of(const PtxArg& a) { return (uint32_t)a.bits; }
inline float h_lo(uint32_t u) {
  _Float16 h;
  uint16_t s = (uint16_t)(u & 0xffffu);
  std::memcpy(&h, &s, 2);
  return (float)h;
}
inline float h_hi(uint32_t u) { return h_lo(u >> 16); }
inline bool is_denormal(float x) { return x != 0.0f && std::fabs(x) < 1.17549435e-38f; }

class Ptx {
  struct Opd {
    char kind;              // 'r' register %N, 'v' vector {%a, %b, ...}, 'm' memory [%N], 'i' immediate
    std::vector<int> regs;  // operand numbers
    long long imm = 0;
  };
  struct Ins {
    std::string op;
    std::vector<Opd> args;
  };
  std::vector<Ins> ins_;
  std::string text_;

  [[noreturn]] void bad(const std::string& why) const {
    std::fprintf(stderr, "emu: PTX not emulated (%s): %s\n", why.c_str(), text_.c_str());
    std::abort();
  }
  static std::string trim(const std::string& s) {
    size_t a = s.find_first_not_of(" \t\n"), b = s.find_last_not_of(" \t\n");
    return a == std::string::npos ? "" : s.substr(a, b - a + 1);
  }
  static std::vector<int> regs_in(const std::string& s) {
    std::vector<int> r;
    for (size_t i = 0; i < s.size(); ++i)
      if (s[i] == '%') r.push_back(std::atoi(s.c_str() + i + 1));
    return r;
  }

 public:
  explicit Ptx(const char* text) : text_(text) {
    std::string t = text_;
    size_t pos = 0;
    while (pos < t.size()) {
      size_t end = t.find(';', pos);
      if (end == std::string::npos) end = t.size();
      const std::string stmt = trim(t.substr(pos, end - pos));
      pos = end + 1;
      if (stmt.empty()) continue;
      Ins in;
      const size_t sp = stmt.find_first_of(" \t");
      in.op = stmt.substr(0, sp);
      std::string rest = sp == std::string::npos ? "" : stmt.substr(sp);
      int depth = 0;
      std::string cur_arg;
      auto flush = [&]() {
        const std::string a = trim(cur_arg);
        cur_arg.clear();
        if (a.empty()) return;
        Opd o;
        if (a[0] == '{') o.kind = 'v', o.regs = regs_in(a);
        else if (a[0] == '[') o.kind = 'm', o.regs = regs_in(a);
        else if (a[0] == '%') o.kind = 'r', o.regs = regs_in(a);
        else o.kind = 'i', o.imm = std::strtoll(a.c_str(), nullptr, 0);
        in.args.push_back(o);
      };
      for (char c : rest) {
        if (c == '{' || c == '[') ++depth;
        if (c == '}' || c == ']') --depth;
        if (c == ',' && depth == 0) flush();
        else cur_arg += c;
      }
      flush();
      ins_.push_back(in);
    }
  }

  void run(PtxArg* a, int n) const {
    for (const Ins& in : ins_) exec(in, a, n);
  }

 private:
  const PtxArg& arg(PtxArg* a, int n, int i, char kind, int size) const {
    if (i < 0 || i >= n) bad("operand %" + std::to_string(i) + " not bound");
    if (kind && a[i].kind != kind && !(kind == 'r' && a[i].kind == 'n'))
      bad("operand %" + std::to_string(i) + " has constraint " + a[i].kind + ", wants " + kind);
    if (size && a[i].size != size) bad("operand %" + std::to_string(i) + " size " + std::to_string(a[i].size));
    return a[i];
  }
  void set(PtxArg* a, int n, int i, uint64_t v, char kind, int size) const {
    const PtxArg& x = arg(a, n, i, kind, size);
    if (!x.out) bad("operand %" + std::to_string(i) + " written but bound as an input");
    std::memcpy(x.out, &v, x.size);
  }
  void set_f(PtxArg* a, int n, int i, float f) const {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    set(a, n, i, u, 'f', 4);
  }
  const Opd& want(const Ins& in, size_t k, char kind, size_t nregs) const {
    if (k >= in.args.size() || in.args[k].kind != kind || (nregs && in.args[k].regs.size() != nregs))
      bad("operand " + std::to_string(k) + " of " + in.op);
    return in.args[k];
  }
  static bool starts(const std::string& s, const char* p) { return s.rfind(p, 0) == 0; }

  void exec(const Ins& in, PtxArg* a, int n) const {
    const std::string& op = in.op;
    if (op == "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32") {
      // PTX ISA, mma.m16n8k16 with .f16 A/B and .f32 C/D (groupID = lane >> 2, threadID_in_group = lane % 4):
      //   A (16 x 16, row): a0,a1: (groupID, 2 tig + {0,1}); a2,a3: (groupID + 8, ...); a4,a5: (groupID, 2 tig + 8
      //     + {0,1}); a6,a7: (groupID + 8, 2 tig + 8 + ...): register i holds elements 2i, 2i + 1 (low half first)
      //   B (16 x 8, col): b0,b1: (k 2 tig + {0,1}, n groupID); b2,b3: (k 2 tig + 8 + {0,1}, n groupID)
      //   C, D (16 x 8): c0,c1: (groupID, 2 tig + {0,1}); c2,c3: (groupID + 8, 2 tig + {0,1})
      const Opd& d = want(in, 0, 'v', 4);
      const Opd& ra = want(in, 1, 'v', 4);
      const Opd& rb = want(in, 2, 'v', 2);
      const Opd& rc = want(in, 3, 'v', 4);
      struct Frag { uint32_t a[4], b[2]; } mine;
      for (int i = 0; i < 4; ++i) mine.a[i] = u32_of(arg(a, n, ra.regs[i], 'r', 4));
      for (int i = 0; i < 2; ++i) mine.b[i] = u32_of(arg(a, n, rb.regs[i], 'r', 4));
      float c[4];
      for (int i = 0; i < 4; ++i) c[i] = f32_of(arg(a, n, rc.regs[i], 'f', 4));
      const auto all = gather(mine);
      float A[16][16], B[16][8];
      for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        for (int e = 0; e < 8; ++e) {  // element e of the lane's A fragment, in register e / 2
          const int row = g + ((e & 2) ? 8 : 0), col = 2 * t + (e & 1) + ((e & 4) ? 8 : 0);
          const uint32_t r = all[l].a[e >> 1];
          A[row][col] = (e & 1) ? h_hi(r) : h_lo(r);
        }
        for (int e = 0; e < 4; ++e) {
          const int k = 2 * t + (e & 1) + ((e & 2) ? 8 : 0);
          const uint32_t r = all[l].b[e >> 1];
          B[k][g] = (e & 1) ? h_hi(r) : h_lo(r);
        }
      }
      const int g = lane() >> 2, t = lane() & 3;
      for (int e = 0; e < 4; ++e) {
        const int row = g + ((e & 2) ? 8 : 0), col = 2 * t + (e & 1);
        float s = c[e];
        for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
        set_f(a, n, d.regs[e], s);
      }
    } else if (op == "movmatrix.sync.aligned.m8n8.trans.b16") {
      // PTX ISA, movmatrix: an 8 x 8 matrix of 16-bit elements, lane l holding row l >> 2, columns 2 (l % 4) and
      // 2 (l % 4) + 1 (low half first); with .trans each lane receives the same places of the transpose
      const Opd& d = want(in, 0, 'r', 1);
      const Opd& s = want(in, 1, 'r', 1);
      const auto all = gather(u32_of(arg(a, n, s.regs[0], 'r', 4)));
      uint32_t y = 0;
      for (int j = 0; j < 2; ++j) {  // the transpose's (row, col) = (lane >> 2, 2 (lane % 4) + j) is source (col, row)
        const int row = lane() >> 2, col = 2 * (lane() & 3) + j;
        const uint32_t src = all[4 * col + (row >> 1)];
        y |= ((src >> (16 * (row & 1))) & 0xffffu) << (16 * j);
      }
      set(a, n, d.regs[0], y, 'r', 4);
    } else if (op == "ex2.approx.ftz.f32") {
      // 2^x, subnormal inputs and results flushed to sign-preserving zero (the approximation's error, ~2^-22
      // relative, is not modelled)
      float x = f32_of(arg(a, n, want(in, 1, 'r', 1).regs[0], 'f', 4));
      if (is_denormal(x)) x = 0.0f;
      float y = std::exp2(x);
      if (is_denormal(y)) y = std::copysign(0.0f, y);
      set_f(a, n, want(in, 0, 'r', 1).regs[0], y);
    } else if (op == "cp.async.cg.shared.global") {
      // [dst] a shared-window address, [src] a global one, cp-size 16 (the only one .cg takes), both aligned to it
      const uint64_t da = arg(a, n, want(in, 0, 'm', 1).regs[0], 0, 0).bits;
      const uint64_t sa = arg(a, n, want(in, 1, 'm', 1).regs[0], 0, 0).bits;
      if (in.args.size() < 3) bad("cp-size");
      const Opd& sz = in.args[2];
      const long long bytes = sz.kind == 'i' ? sz.imm : (long long)arg(a, n, sz.regs.at(0), 0, 0).bits;
      if (bytes != 16) bad("cp-size");
      void* dst = shared_ptr(da, bytes, "cp.async destination (threadgroup)");
      const void* src = reinterpret_cast<const void*>(sa);
      check(src, bytes, bytes, "cp.async source (global)", GLOBAL);
      check(dst, bytes, bytes, "cp.async destination (threadgroup)", SHARED);
      const bool now = (rng() & 1u) != 0;
      if (now) std::memcpy(dst, src, bytes);
      cp_state[cur].open.push_back({dst, src, (int)bytes, now});
    } else if (op == "cp.async.commit_group") {
      auto& st = cp_state[cur];
      st.groups.push_back(std::move(st.open));
      st.open.clear();
    } else if (op == "cp.async.wait_group") {
      // until at most N of this thread's most recent committed groups are pending: the older ones land
      const Opd& o = in.args.at(0);
      const long long keep = o.kind == 'i' ? o.imm : (long long)arg(a, n, o.regs.at(0), 'n', 0).bits;
      auto& st = cp_state[cur];
      while ((long long)st.groups.size() > keep) {
        land(st.groups.front());
        st.groups.erase(st.groups.begin());
      }
    } else if (starts(op, "atom.") && op.size() > 8 && op.compare(op.size() - 8, 8, ".add.u32") == 0 &&
               op.find(".global") != std::string::npos) {
      // atom{.sem}{.scope}.global.add.u32 d, [a], b: d = old *a, *a += b (blocks run one after another here)
      uint32_t* p = reinterpret_cast<uint32_t*>(arg(a, n, want(in, 1, 'm', 1).regs[0], 'l', 8).bits);
      check(p, 4, 4, "atom (global)", GLOBAL);
      if (in.args.size() != 3) bad("operands of " + op);
      const Opd& ob = in.args[2];
      const uint32_t b = ob.kind == 'i' ? (uint32_t)ob.imm : u32_of(arg(a, n, want(in, 2, 'r', 1).regs[0], 'r', 4));
      const uint32_t old = *p;
      *p = old + b;
      set(a, n, want(in, 0, 'r', 1).regs[0], old, 'r', 4);
    } else if (op == "ld.shared.b32") {
      const uint64_t addr = u32_of(arg(a, n, want(in, 1, 'm', 1).regs[0], 'r', 4));
      const unsigned char* p = shared_ptr(addr, 4, "ld.shared");
      check(p, 4, 4, "ld.shared.b32", SHARED);
      uint32_t v;
      std::memcpy(&v, p, 4);
      set(a, n, want(in, 0, 'r', 1).regs[0], v, 'r', 4);
    } else {
      bad("unknown instruction " + op);
    }
  }
};
}  // namespace emu

// reinterpret_cast<P>(q) of the preludes, with the access it is made for checked (P's pointee)
namespace emu {
template <class P, class Q>
inline P checked_cast(const char* fn, Q* q) {
  using T = std::remove_cv_t<std::remove_pointer_t<P>>;
  check(q, sizeof(T), alignof(T), fn, ANY);
  return reinterpret_cast<P>(q);
}
}  // namespace emu
#endif  // RQ_CUDA_EMU_H
