// CUDA prelude: maps the spellings the kernel bodies use onto CUDA (rendered for mx.fast.cuda_kernel).
// The bodies and common.h are shared with Metal; only this file and prelude_metal.h differ.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
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
// the softmax's weights in the main loop: the hardware's approximation (relative error ~2^-22; results under 2^-126,
// which no weight needs, flush to zero), without exp2f's fix-ups for them
INLINE float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
INLINE float rsqrt_f(float x) { return rsqrtf(x); }
INLINE float sqrt_f(float x) { return sqrtf(x); }  // IEEE (kv_append's norm, as MLX's sqrt)
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
INLINE float4 zero_f4() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }
INLINE float log2_f(float x) { return log2f(x); }
#define NEG_INF_F __int_as_float(0xff800000)
// ---- matrix fragments: mma.sync m16n8k16, f16 inputs, f32 accumulators (PTX ISA fragment layouts) ----
#define MMA_M 16
#define MMA_N 8
#define MMA_K 16
#define FRAG_A_ROWS 2   // A rows (m) a thread holds
#define FRAG_A_PAIRS 2  // pairs of adjacent k per A row a thread holds
#define FRAG_B_PAIRS 2  // B registers, each two elements
#define FRAG_C_N 4
typedef __half2 h2;
struct FragA { uint x[4]; };
struct FragB { uint x[2]; };
struct FragC { float x[4]; };
INLINE h2 make_h2(float a, float b) { return __floats2half2_rn(a, b); }
INLINE float round_half(float x) { return __half2float(__float2half_rn(x)); }
INLINE int frag_a_row(int lane, int i) { return (lane >> 2) + 8 * i; }
INLINE int frag_a_k0(int lane, int q) { return 2 * (lane & 3) + 8 * q; }
INLINE int frag_klane(int lane) { return lane & 3; }
INLINE int frag_mlane(int lane) { return lane >> 2; }
INLINE int k_lane_of(int kk) { return (kk & 7) >> 1; }
INLINE int k_j_of(int kk) { return (kk & 1) + 2 * (kk >> 3); }
INLINE int m_lane_of(int m) { return m & 7; }
INLINE int m_i_of(int m) { return m >> 3; }
INLINE int frag_b_k(int lane, int e) { return 2 * (lane & 3) + (e & 1) + 8 * (e >> 1); }
INLINE int frag_b_n(int lane, int e) { return lane >> 2; }
INLINE int frag_c_m(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
INLINE int frag_c_n(int lane, int e) { return 2 * (lane & 3) + (e & 1); }
INLINE void frag_a_set(THR FragA& a, int i, int q, h2 v) { a.x[i + 2 * q] = *reinterpret_cast<THR uint*>(&v); }
INLINE void frag_b_set(THR FragB& b, int r, h2 v) { b.x[r] = *reinterpret_cast<THR uint*>(&v); }
// B register r (k x n) from C elements 2r, 2r + 1 of the same matrix held with k as the C's m (tokens x rows): an 8x8
// transpose in registers (movmatrix, sm_75+), so the softmax's weights reach the value mma without threadgroup memory
INLINE uint movm_trans(uint x) {
  uint y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
INLINE void frag_b_from_c(THR FragB& b, int r, h2 v) { b.x[r] = movm_trans(*reinterpret_cast<THR uint*>(&v)); }
INLINE void frag_c_zero(THR FragC& c) { c.x[0] = 0.0f; c.x[1] = 0.0f; c.x[2] = 0.0f; c.x[3] = 0.0f; }
INLINE float frag_c_get(THR FragC& c, int e) { return c.x[e]; }
INLINE void frag_c_scale(THR FragC& c, int e, float f) { c.x[e] *= f; }
INLINE void mma_f16(THR FragC& c, THR const FragA& a, THR const FragB& b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c.x[0]), "+f"(c.x[1]), "+f"(c.x[2]), "+f"(c.x[3])
               : "r"(a.x[0]), "r"(a.x[1]), "r"(a.x[2]), "r"(a.x[3]), "r"(b.x[0]), "r"(b.x[1]));
}
INLINE float to_float(float x) { return x; }
// ---- the fused kernel's split merge: device-scope counter, fences, loads of other blocks' partials, typed stores ----
INLINE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
INLINE void store_f(float* p, float v) { *p = v; }
INLINE void store_f(__half* p, float v) { *p = __float2half_rn(v); }
INLINE void store_f(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }
// every write of this thread is visible device-wide before its later writes/atomics (release side)
#define DEVICE_FENCE() __threadfence()
// the counter lives in an input buffer (MLX passes inputs as const): the kernel owns it, see kernels.py
INLINE uint atomic_inc_dev(DEV const uint* p) { return atomicAdd(const_cast<uint*>(p), 1u); }
INLINE void atomic_zero_dev(DEV const uint* p) { atomicExch(const_cast<uint*>(p), 0u); }
// a block's arrival at the split counter: release of the partials its threads wrote before the barrier that
// precedes it, acquire of the other blocks' (one acq_rel atomic at device scope; no fences needed around it)
INLINE uint count_arrive(DEV const uint* p) {
  uint old;
  asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(const_cast<uint*>(p)) : "memory");
  return old;
}
#define COUNT_RELEASE()
#define COUNT_ACQUIRE()
// loads of data other blocks wrote in this launch: through L2, never a stale L1 line
INLINE float ld_dev(DEV const float* p) { return __ldcg(p); }
INLINE float4 ld_dev4(DEV const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
INLINE void st_dev4(DEV float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
// ---- warp-level streaming: rows of a C fragment, warp sync and vote, a single half ----
#define FRAG_C_NR 2  // distinct query rows (n) a thread holds in a C fragment: frag_c_n(lane, r), r < FRAG_C_NR
INLINE int frag_c_r(int e) { return e & 1; }  // which of them element e belongs to
// reduce over the lanes that hold the same rows (they differ in the m index: lane bits 2, 3, 4)
INLINE float frag_c_red_max(float x) {
  UNROLL for (int m = 4; m < 32; m <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, m));
  return x;
}
INLINE float frag_c_red_sum(float x) {
  UNROLL for (int m = 4; m < 32; m <<= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}
#define SYNCWARP() __syncwarp()
INLINE bool simd_any_b(bool b) { return __any_sync(0xffffffffu, b) != 0; }
typedef __half hf;
INLINE hf hf_zero() { return __float2half_rn(0.0f); }
// bytes of {b:a} picked by the 4 selector nibbles (low 3 bits each); a half2's bits and back
INLINE uint byte_perm(uint a, uint b, uint s) { return __byte_perm(a, b, s); }
INLINE uint h2_bits(h2 v) { return *reinterpret_cast<THR uint*>(&v); }
INLINE h2 bits_h2(uint u) { return *reinterpret_cast<THR h2*>(&u); }
// asynchronous 16-byte copies device -> threadgroup memory (cp.async, L2 only), committed as a group;
// cp_async_wait<N>: until at most N of this thread's groups are pending
INLINE void cp_async16(TG uint* dst, DEV const uint* src) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
}
INLINE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
INLINE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// threadgroup memory the hardware reserves below a block's own (sm_80 on); a threadgroup address (32-bit shared
// window offset) and a 4-byte load at one (base: unused here, Metal's rendering indexes from it)
#define TG_RESERVED 1024
#define TG_ALIGN_LUT 1
#define NAN_F __int_as_float(0x7fffffff)
INLINE uint tg_addr(TG const void* p) { return (uint)__cvta_generic_to_shared(p); }
INLINE h2 tg_load_h2(TG const h2* base, uint addr) {
  uint v;
  asm("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return bits_h2(v);
}
//--- body ---
const uint TID = threadIdx.x;
const uint NT = blockDim.x;
const uint BX = blockIdx.x;
const uint BY = blockIdx.y;
const uint NBX = gridDim.x;
const uint NBY = gridDim.y;
