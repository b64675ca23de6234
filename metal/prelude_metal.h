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
INLINE float exp2_fast(float x) { return exp2(x); }  // Metal's exp2 is the fast one already
INLINE float rsqrt_f(float x) { return rsqrt(x); }
INLINE float sqrt_f(float x) { return sqrt(x); }
INLINE float simd_sum_f(float x) { return simd_sum(x); }
INLINE float simd_max_f(float x) { return simd_max(x); }
INLINE float shfl_xor_f(float x, int m) { return simd_shuffle_xor(x, ushort(m)); }
// bits [sh, sh + 32) of the 64-bit value hi:lo (sh < 32)
INLINE uint funnel_r(uint lo, uint hi, uint sh) { return sh == 0u ? lo : ((lo >> sh) | (hi << (32u - sh))); }
INLINE uint4 load_u4(DEV const uint* p) { return *((DEV const uint4*)p); }
INLINE float4 load_f4(TG const float* p) { return *((TG const float4*)p); }
INLINE float4 zero_f4() { return float4(0.0f, 0.0f, 0.0f, 0.0f); }
INLINE float log2_f(float x) { return log2(x); }
#define NEG_INF_F (-INFINITY)
// ---- matrix fragments: simdgroup_matrix 8x8x8, half inputs, float accumulators ----
// (thread -> element layout as in MLX's steel MMA fragments: two adjacent columns of one row)
#define MMA_M 8
#define MMA_N 8
#define MMA_K 8
#define FRAG_A_ROWS 1
#define FRAG_A_PAIRS 1
#define FRAG_B_PAIRS 1
#define FRAG_C_N 2
typedef half2 h2;
typedef simdgroup_matrix<half, 8, 8> FragA;
typedef simdgroup_matrix<half, 8, 8> FragB;
typedef simdgroup_matrix<float, 8, 8> FragC;
INLINE h2 make_h2(float a, float b) { return h2(half(a), half(b)); }
INLINE float round_half(float x) { return float(half(x)); }
INLINE int frag_fm(int lane) { return ((lane >> 2) & 4) + ((lane >> 1) & 3); }
INLINE int frag_fn(int lane) { return ((lane >> 2) & 2) * 2 + (lane & 1) * 2; }
INLINE int frag_a_row(int lane, int i) { return frag_fm(lane); }
INLINE int frag_a_k0(int lane, int q) { return frag_fn(lane); }
INLINE int frag_klane(int lane) { return frag_fn(lane) >> 1; }
INLINE int frag_mlane(int lane) { return frag_fm(lane); }
INLINE int k_lane_of(int kk) { return kk >> 1; }
INLINE int k_j_of(int kk) { return kk & 1; }
INLINE int m_lane_of(int m) { return m; }
INLINE int m_i_of(int m) { return 0; }
INLINE int frag_b_k(int lane, int e) { return frag_fm(lane); }
INLINE int frag_b_n(int lane, int e) { return frag_fn(lane) + e; }
INLINE int frag_c_m(int lane, int e) { return frag_fm(lane); }
INLINE int frag_c_n(int lane, int e) { return frag_fn(lane) + e; }
INLINE void frag_a_set(THR FragA& a, int i, int q, h2 v) { a.thread_elements()[0] = v.x; a.thread_elements()[1] = v.y; }
INLINE void frag_b_set(THR FragB& b, int r, h2 v) { b.thread_elements()[0] = v.x; b.thread_elements()[1] = v.y; }
// B register r (k x n) from C elements 2r, 2r + 1 of the same matrix held with k as the C's m: on simdgroup matrices
// a lane holds the same (m, n) of C as (k, n) of B, so no data moves
INLINE void frag_b_from_c(THR FragB& b, int r, h2 v) { b.thread_elements()[0] = v.x; b.thread_elements()[1] = v.y; }
INLINE void frag_c_zero(THR FragC& c) { c = make_filled_simdgroup_matrix<float, 8, 8>(0.0f); }
INLINE float frag_c_get(THR FragC& c, int e) { return c.thread_elements()[e]; }
INLINE void frag_c_scale(THR FragC& c, int e, float f) { c.thread_elements()[e] *= f; }
INLINE void mma_f16(THR FragC& c, THR const FragA& a, THR const FragB& b) { simdgroup_multiply_accumulate(c, a, b, c); }
INLINE float to_float(float x) { return x; }
// ---- the fused kernel's split merge: device-scope counter, fences, loads of other blocks' partials, typed stores ----
INLINE float to_float(bfloat16_t x) { return float(x); }
template <typename T> INLINE void store_f(DEV T* p, float v) { *p = static_cast<T>(v); }
// device-memory ordering across the threadgroup; Metal (< 3.2) has no stronger fence spelled portably
#define DEVICE_FENCE() threadgroup_barrier(mem_flags::mem_device)
// the counter lives in an input buffer (MLX passes inputs as const device): the kernel owns it
INLINE uint atomic_inc_dev(DEV const uint* p) {
  return atomic_fetch_add_explicit((DEV atomic_uint*)p, 1u, memory_order_relaxed);
}
INLINE void atomic_zero_dev(DEV const uint* p) { atomic_store_explicit((DEV atomic_uint*)p, 0u, memory_order_relaxed); }
// a block's arrival at the split counter (CUDA: one acq_rel atomic); here fences on both sides of a relaxed one
INLINE uint count_arrive(DEV const uint* p) { return atomic_inc_dev(p); }
#define COUNT_RELEASE() DEVICE_FENCE()
#define COUNT_ACQUIRE() DEVICE_FENCE()
INLINE float ld_dev(DEV const float* p) { return *((DEV const volatile float*)p); }
INLINE float4 ld_dev4(DEV const float* p) { return float4(ld_dev(p), ld_dev(p + 1), ld_dev(p + 2), ld_dev(p + 3)); }
INLINE void st_dev4(DEV float* p, float4 v) { *((DEV float4*)p) = v; }
// ---- warp-level streaming: rows of a C fragment, SIMD-group sync and vote, a single half ----
#define FRAG_C_NR 2  // distinct query rows (n) a thread holds in a C fragment: frag_c_n(lane, r), r < FRAG_C_NR
INLINE int frag_c_r(int e) { return e; }  // which of them element e belongs to
// reduce over the lanes that hold the same rows (they differ in the m index: lane bits 1, 2, 4)
INLINE float frag_c_red_max(float x) {
  x = fmax(x, simd_shuffle_xor(x, ushort(2)));
  x = fmax(x, simd_shuffle_xor(x, ushort(4)));
  return fmax(x, simd_shuffle_xor(x, ushort(16)));
}
INLINE float frag_c_red_sum(float x) {
  x += simd_shuffle_xor(x, ushort(2));
  x += simd_shuffle_xor(x, ushort(4));
  return x + simd_shuffle_xor(x, ushort(16));
}
#define SYNCWARP() simdgroup_barrier(mem_flags::mem_threadgroup)
INLINE bool simd_any_b(bool b) { return simd_any(b); }
typedef half hf;
INLINE hf hf_zero() { return half(0.0f); }
// bytes of {b:a} picked by the 4 selector nibbles (low 3 bits each); a half2's bits and back
INLINE uint byte_perm(uint a, uint b, uint s) {
  const ulong x = (ulong(b) << 32) | ulong(a);
  uint r = 0u;
  for (int n = 0; n < 4; ++n) r |= uint((x >> (8u * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
  return r;
}
INLINE uint h2_bits(h2 v) { return as_type<uint>(v); }
INLINE h2 bits_h2(uint u) { return as_type<h2>(u); }
// asynchronous 16-byte copies device -> threadgroup memory: plain copies on Metal (the group calls do nothing)
INLINE void cp_async16(TG uint* dst, DEV const uint* src) {
  dst[0] = src[0];
  dst[1] = src[1];
  dst[2] = src[2];
  dst[3] = src[3];
}
INLINE void cp_async_commit() {}
template <int N>
INLINE void cp_async_wait() {}
// threadgroup addresses as the bodies use them: offsets from the array they index (CUDA: the shared window's)
#define TG_RESERVED 0
#define TG_ALIGN_LUT 0
#define NAN_F NAN
INLINE uint tg_addr(TG const void* p) { return 0u; }
INLINE h2 tg_load_h2(TG const h2* base, uint addr) { return base[addr >> 2]; }
//--- body ---
const uint TID = thread_position_in_threadgroup.x;
const uint NT = threads_per_threadgroup.x;
const uint BX = threadgroup_position_in_grid.x;
const uint BY = threadgroup_position_in_grid.y;
const uint NBX = threadgroups_per_grid.x;
const uint NBY = threadgroups_per_grid.y;
