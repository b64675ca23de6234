// Helpers shared by every kernel body, written once for Metal and CUDA (spellings from prelude_*.h).
// Layout and math: docs/FORMAT.md. Scores run in log2 units where noted (exp2 is the fast path on both).
#define NEG_BIG (-1.0e30f)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

INLINE int imin(int a, int b) { return a < b ? a : b; }
constexpr int imax_c(int a, int b) { return a > b ? a : b; }  // for constant expressions

// A lane-replicated pair table holds entry c of lane l at c * 32 + l (4-byte entries), so entry c's bytes
// start at c << 7. pair_off: the fw-bit pair index at bit p (< 32) of the 64-bit hi:lo as that byte offset,
// in one shift and one mask (index, scale and address were a shift, a mask and a multiply-add).
INLINE uint pair_off(uint lo, uint hi, int p, int fw) {
  const uint m = ((1u << fw) - 1u) << 7;
  if (p < 7) return (lo << (7 - p)) & m;
  if (p + fw <= 32) return (lo >> (p - 7)) & m;
  return funnel_r(lo, hi, (uint)(p - 7)) & m;
}

// Word k of the mask of the even b-bit fields (fields 0, 2, 4, ...) of a run of b-bit codes.
INLINE uint even_fields(int k, int b) {
  uint m = 0u;
  UNROLL for (int i = 0; i < 32; ++i) m |= (((32 * k + i) % (2 * b)) < b ? 1u : 0u) << i;
  return m;
}

// Normalised Sylvester WHT, in place, on nrows rows of D floats in threadgroup memory.
// Every thread of the group must call it (it holds barriers).
template <int D>
INLINE void wht_rows(TG float* x, int nrows, uint tid, uint nt) {
  for (int h = 1; h < D; h <<= 1) {
    for (int p = (int)tid; p < nrows * (D / 2); p += (int)nt) {
      const int r = p / (D / 2);
      const int t = p % (D / 2);
      const int i = r * D + (t / h) * 2 * h + (t % h);
      const float a = x[i];
      const float b = x[i + h];
      x[i] = a + b;
      x[i + h] = a - b;
    }
    BARRIER();
  }
  const float s = rsqrt_f((float)D);
  for (int e = (int)tid; e < nrows * D; e += (int)nt) x[e] *= s;
  BARRIER();
}

// wht_rows with its loops kept rolled: for a kernel's tail (an inverse rotation), where the
// unrolled copy raised the whole kernel's register count from 128 to 168 (nvcc 13, sm_90).
template <int D>
INLINE void wht_rows_lean(TG float* x, int nrows, uint tid, uint nt) {
  _Pragma("unroll 1") for (int h = 1; h < D; h <<= 1) {
    _Pragma("unroll 1") for (int p = (int)tid; p < nrows * (D / 2); p += (int)nt) {
      const int r = p / (D / 2);
      const int t = p % (D / 2);
      const int i = r * D + (t / h) * 2 * h + (t % h);
      const float a = x[i];
      const float b = x[i + h];
      x[i] = a + b;
      x[i + h] = a - b;
    }
    BARRIER();
  }
  const float s = rsqrt_f((float)D);
  for (int e = (int)tid; e < nrows * D; e += (int)nt) x[e] *= s;
  BARRIER();
}

// A row's WHT with the row spread over a warp: lane l holds dims l*DPL .. l*DPL + DPL - 1 in x. Strides below DPL
// inside the lane, the others across lanes by shuffles (no threadgroup memory, no barrier); normalised.
template <int DPL>
INLINE void wht_lane(THR float* x, int lane) {
  UNROLL for (int h = 1; h < DPL; h <<= 1) {
    UNROLL for (int i = 0; i < DPL; ++i) {
      if ((i & h) == 0) {
        const float a = x[i];
        const float b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
  }
  UNROLL for (int hl = 1; hl < 32; hl <<= 1) {
    const bool up = (lane & hl) != 0;
    UNROLL for (int i = 0; i < DPL; ++i) {
      const float o = shfl_xor_f(x[i], hl);
      x[i] = up ? o - x[i] : x[i] + o;
    }
  }
  const float s = rsqrt_f((float)(32 * DPL));
  UNROLL for (int i = 0; i < DPL; ++i) x[i] *= s;
}

// The SO(4) blocks of a lane's DPL dims (DPL a multiple of 4; m: this lane's DPL/4 blocks of 16, loaded by the
// caller), forward (M_j·v) or transposed (M_jᵀ·v), in place.
template <int DPL, bool TRANSPOSE>
INLINE void so4_lane(THR float* x, THR const float* m) {
  UNROLL for (int j = 0; j < DPL / 4; ++j) {
    float y[4];
    UNROLL for (int a = 0; a < 4; ++a) {
      y[a] = 0.0f;
      UNROLL for (int b = 0; b < 4; ++b) y[a] += (TRANSPOSE ? m[16 * j + 4 * b + a] : m[16 * j + 4 * a + b]) * x[4 * j + b];
    }
    UNROLL for (int a = 0; a < 4; ++a) x[4 * j + a] = y[a];
  }
}

// attn_fused's split partials in the accumulator fragments' own order: position ((e * 32 + lane) * NMT + mt) holds
// element e of lane `lane`'s tile mt (NMT = D / MMA_M tiles; rows n >= R hold zeros). A warp's fragments go to a
// slab without bank conflicts, and the 4 positions of a float4 (NMT % 4 == 0) share one query row.
template <int D>
INLINE int frag_pos_n(int p) {
  constexpr int NMT = D / MMA_M;
  return frag_c_n((p / NMT) % 32, p / (NMT * 32));
}
template <int D>
INLINE int frag_pos_d(int p) {
  constexpr int NMT = D / MMA_M;
  const int m = frag_c_m((p / NMT) % 32, p / (NMT * 32));
  return m_lane_of(m) * (D / 8) + FRAG_A_ROWS * (p % NMT) + m_i_of(m);
}

// Element i of M_j·v (or M_jᵀ·v) for the 4-block j = i/4 of one row; mats: this kv head's [D/4][4][4].
template <bool TRANSPOSE>
INLINE float so4_elem(DEV const float* mats, TG const float* row, int i) {
  const int j = i >> 2;
  const int a = i & 3;
  DEV const float* M = mats + j * 16;
  TG const float* v = row + 4 * j;
  if (TRANSPOSE) return M[a] * v[0] + M[4 + a] * v[1] + M[8 + a] * v[2] + M[12 + a] * v[3];
  return M[4 * a] * v[0] + M[4 * a + 1] * v[1] + M[4 * a + 2] * v[2] + M[4 * a + 3] * v[3];
}

// Element i of P·v (or Pᵀ·v) for a dense D×D rotation P (row-major, this kv head's [D][D]): TurboQuant.
template <int D, bool TRANSPOSE>
INLINE float dense_elem(DEV const float* P, TG const float* row, int i) {
  float s = 0.0f;
  if (TRANSPOSE) {
    for (int k = 0; k < D; ++k) s += P[k * D + i] * row[k];
  } else {
    for (int k = 0; k < D; ++k) s += P[i * D + k] * row[k];
  }
  return s;
}

// Field i (b bits) of a little-endian bit stream held in words w (a field may straddle two words).
INLINE uint stream_field(THR const uint* w, int i, int b) {
  const int bit = i * b;
  const int wi = bit >> 5;
  const int sh = bit & 31;
  uint c = w[wi] >> sh;
  if (sh + b > 32) c |= w[wi + 1] << (32 - sh);
  return c & ((1u << b) - 1u);
}

// Kernel A's inner loop: TPT keys per thread (packed rows in kw, W words each), all R query rows of
// the group at once, so each code is decoded once and serves R rows. qs is [D][R]; acc is [TPT][R].
template <int D, int BITS, int R, int TPT, int W>
INLINE void dot_codes(THR const uint* kw, TG const float* qs, TG const float* lv, THR float* acc) {
  UNROLL for (int e = 0; e < TPT * R; ++e) acc[e] = 0.0f;
  UNROLL for (int i = 0; i < D; ++i) {
    float qv[R];
    if (R % 4 == 0) {
      UNROLL for (int r = 0; r < R; r += 4) {
        const float4 q4 = load_f4(qs + i * R + r);
        qv[r] = q4.x;
        qv[r + 1] = q4.y;
        qv[r + 2] = q4.z;
        qv[r + 3] = q4.w;
      }
    } else {
      UNROLL for (int r = 0; r < R; ++r) qv[r] = qs[i * R + r];
    }
    UNROLL for (int a = 0; a < TPT; ++a) {
      const float l = lv[stream_field(kw + a * W, i, BITS)];
      UNROLL for (int r = 0; r < R; ++r) acc[a * R + r] += qv[r] * l;
    }
  }
}

// Kernel A's inner product with pair codebooks: field i (FB bits) of a row indexes the point
// (pts[2c], pts[2c + 1]) that stands for coordinates 2i and 2i + 1.
template <int D, int FB, int R, int TPT, int W>
INLINE void dot_pairs(THR const uint* kw, TG const float* qs, TG const float* pts, THR float* acc) {
  UNROLL for (int e = 0; e < TPT * R; ++e) acc[e] = 0.0f;
  UNROLL for (int i = 0; i < D / 2; ++i) {
    float q0[R];
    float q1[R];
    UNROLL for (int r = 0; r < R; ++r) {
      q0[r] = qs[2 * i * R + r];
      q1[r] = qs[(2 * i + 1) * R + r];
    }
    UNROLL for (int a = 0; a < TPT; ++a) {
      const uint c = stream_field(kw + a * W, i, FB);
      const float x = pts[2 * c];
      const float y = pts[2 * c + 1];
      UNROLL for (int r = 0; r < R; ++r) acc[a * R + r] += q0[r] * x + q1[r] * y;
    }
  }
}

// Kernel C's inner step, dimension-parallel: this lane's DPL codes of one value row (already shifted
// to bit 0 of `bits`) times the R weights wt[r * wstride].
template <int DPL, int BITS, int R>
INLINE void accum_codes(uint bits, TG const float* lv, TG const float* wt, int wstride, THR float* acc) {
  constexpr uint MASK = (1u << BITS) - 1u;
  float v[DPL];
  UNROLL for (int k = 0; k < DPL; ++k) v[k] = lv[(bits >> (k * BITS)) & MASK];
  UNROLL for (int r = 0; r < R; ++r) {
    const float w = wt[r * wstride];
    UNROLL for (int k = 0; k < DPL; ++k) acc[r * DPL + k] += w * v[k];
  }
}

// Kernel C's inner step, dimension-parallel, pair codebooks: this lane's DPL / 2 fields (FB bits each, shifted to
// bit 0 of `bits`) as DPL coordinates, times the R weights wt[r * wstride].
template <int DPL, int FB, int R>
INLINE void accum_pairs(uint bits, TG const float* pts, TG const float* wt, int wstride, THR float* acc) {
  constexpr uint MASK = (1u << FB) - 1u;
  float v[DPL];
  UNROLL for (int k = 0; k < DPL / 2; ++k) {
    const uint c = (bits >> (k * FB)) & MASK;
    v[2 * k] = pts[2 * c];
    v[2 * k + 1] = pts[2 * c + 1];
  }
  UNROLL for (int r = 0; r < R; ++r) {
    const float w = wt[r * wstride];
    UNROLL for (int k = 0; k < DPL; ++k) acc[r * DPL + k] += w * v[k];
  }
}

// Kernel C's inner step, word-parallel: 32 codes held in BITS whole words, one weight.
template <int BITS>
INLINE void accum_chunk32(THR const uint* w, float wt, TG const float* lv, THR float* acc) {
  UNROLL for (int i = 0; i < 32; ++i) acc[i] += wt * lv[stream_field(w, i, BITS)];
}

// Kernel C's inner step, word-parallel, pair codebooks: 32 coordinates as 16 FB-bit fields from bit 0 of w, one weight.
template <int FB>
INLINE void accum_pairs32(THR const uint* w, float wt, TG const float* pts, THR float* acc) {
  UNROLL for (int i = 0; i < 16; ++i) {
    const uint c = stream_field(w, i, FB);
    acc[2 * i] += wt * pts[2 * c];
    acc[2 * i + 1] += wt * pts[2 * c + 1];
  }
}

// attn_fused_window: the cache's fp16 window (its newest NW <= 128 tokens, unquantized, in the model's
// space) as ONE MORE SPLIT: split 0, the first dispatched, done by its own block beside the packed splits
// (attending it in the merging block's tail instead cost +18 us a layer on the H200, constant in
// context). Writes this split's partials in the packed splits' convention, so the last block merges it like
// any other and rotates back: m, l of 2^(score) with scores in log2 units; o = sum_j 2^(s_j - m) * sqrt(D) *
// Rot(v_j) (packed values decode to sqrt(D)-scaled rotated vectors; Rot as the query's: signs (ROT bit 8), WHT,
// then the SO(4) blocks or the dense P; mats: this head's parameters). q: this group's first query row at qb,
// strides qsh (head), qsl (query), qsd (dim); window rows at wkb / wvb, row strides wks / wvs, element strides
// wkd / wvd. WCAUSAL: query row n sees
// window token j <= NW - LQ + n % LQ. qw: R*D floats, sc: R*128 floats of threadgroup memory; ow may be qw (the query
// rows are dead once the scores are). Writes the MMA_N x DV partials of dims d0 .. d0 + DV at o_part + ob (attn_fused's
// value-dim halves at head dim 512) and, with wml, the rows' (m, l); every thread of the block calls it (barriers).
template <int D, int DV, int R, int LQ, int ROT, int WCAUSAL, int THREADS, typename TQ, typename TW>
INLINE void window_split(DEV const TQ* q, int qb, int qsh, int qsl, int qsd, DEV const TW* wk, int wkb, int wks,
                         int wkd, DEV const TW* wv, int wvb, int wvs, int wvd, int NW, float wscale,
                         DEV const float* mats, TG float* qw, TG float* sc, TG float* ow, DEV float* o_part,
                         DEV float* ml_part, int pbase, int ob, int d0, bool wml, uint tid) {
  constexpr int NWARP = THREADS / 32;
  constexpr int WT = 128;  // sc's row stride
  constexpr int WJ = 4;    // window tokens a warp holds per round
  constexpr int DL = D / 32;
  constexpr int WV = 32;   // window tokens a thread holds per round (values)
  const int lane = (int)(tid & 31u);
  const int warp = (int)(tid >> 5);
  // the first round's keys are requested together with the query rows. Registers are the constraint here, not
  // latency (the block runs beside the packed splits): holding the first values too (32 more) and 8 tokens a warp
  // raised the whole kernel to 167 registers (nvcc 13, sm_90), one block per SM instead of two
  float kv[WJ][DL];
  UNROLL for (int t = 0; t < WJ; ++t) {
    const int j = warp + t * NWARP;
    UNROLL for (int u = 0; u < DL; ++u) kv[t][u] = j < NW ? to_float(wk[wkb + j * wks + (lane + 32 * u) * wkd]) : 0.0f;
  }
  for (int e = (int)tid; e < R * D; e += THREADS) {
    const int n = e / D;
    qw[e] = wscale * to_float(q[qb + (n / LQ) * qsh + (n % LQ) * qsl + (e % D) * qsd]);
  }
  BARRIER();
  // scores: a warp per window token, lanes across the head dim (coalesced rows), a warp sum per query row
  for (int jb = warp; jb < NW; jb += NWARP * WJ) {
    if (jb != warp) {
      UNROLL for (int t = 0; t < WJ; ++t) {
        const int j = jb + t * NWARP;
        UNROLL for (int u = 0; u < DL; ++u) kv[t][u] = j < NW ? to_float(wk[wkb + j * wks + (lane + 32 * u) * wkd]) : 0.0f;
      }
    }
    UNROLL for (int t = 0; t < WJ; ++t) {
      const int j = jb + t * NWARP;
      UNROLL for (int r = 0; r < R; ++r) {
        float s = 0.0f;
        UNROLL for (int u = 0; u < DL; ++u) s += qw[r * D + lane + 32 * u] * kv[t][u];
        s = simd_sum_f(s);
        const bool ok = WCAUSAL == 0 || j <= NW - LQ + (r % LQ);
        if (lane == 0 && j < NW) sc[r * WT + j] = ok ? s : NEG_BIG;
      }
    }
  }
  BARRIER();
  // per query row: the max m and the sum l of 2^(s - m); sc becomes the weights
  for (int r = warp; r < R; r += NWARP) {
    float mloc = NEG_BIG;
    for (int j = lane; j < NW; j += 32) mloc = fmax_f(mloc, sc[r * WT + j]);
    const float m = simd_max_f(mloc);
    float l = 0.0f;
    for (int j = lane; j < NW; j += 32) {
      const float s = sc[r * WT + j];
      const float p = s > 0.5f * NEG_BIG ? exp2_f(s - m) : 0.0f;
      sc[r * WT + j] = p;
      l += p;
    }
    l = simd_sum_f(l);
    if (lane == 0 && wml) {
      ml_part[(pbase + r) * 2] = m;
      ml_part[(pbase + r) * 2 + 1] = l;
    }
  }
  BARRIER();
  // values: a thread per head dim (coalesced across threads), all R rows at once
  const float sd = sqrt_f((float)D);
  for (int c = (int)tid; c < D; c += THREADS) {
    float a[R];
    UNROLL for (int r = 0; r < R; ++r) a[r] = 0.0f;
    for (int jb = 0; jb < NW; jb += WV) {
      float vv[WV];
      UNROLL for (int u = 0; u < WV; ++u) vv[u] = jb + u < NW ? to_float(wv[wvb + (jb + u) * wvs + c * wvd]) : 0.0f;
      UNROLL for (int u = 0; u < WV; ++u) {
        UNROLL for (int r = 0; r < R; ++r) a[r] += (jb + u < NW ? sc[r * WT + jb + u] : 0.0f) * vv[u];
      }
    }
    const float sg = (ROT & 8) != 0 ? mats[4 * D + c] : 1.0f;  // D_s before the WHT (rwht_so4): mats' head signs
    UNROLL for (int r = 0; r < R; ++r) ow[r * D + c] = sd * sg * a[r];
  }
  BARRIER();
  // into the packed values' space, as the query was rotated: WHT, then the SO(4) blocks (or the dense P)
  if ((ROT & 1) != 0) wht_rows_lean<D>(ow, R, tid, THREADS);
  // the split's MMA_N x DV partials in the fragments' order (frag_pos_n / frag_pos_d)
  for (int p = (int)tid; p < MMA_N * DV; p += THREADS) {
    const int n = frag_pos_n<DV>(p);
    const int d = d0 + frag_pos_d<DV>(p);
    o_part[ob + p] = n >= R                ? 0.0f
                     : ((ROT & 4) != 0) ? dense_elem<D, false>(mats, ow + n * D, d)
                     : ((ROT & 2) != 0) ? so4_elem<false>(mats, ow + n * D, d)
                                        : ow[n * D + d];
  }
}
