// Helpers shared by every kernel body, written once for Metal and CUDA (spellings from prelude_*.h).
// Layout and math: docs/FORMAT.md. Scores run in log2 units where noted (exp2 is the fast path on both).
#define NEG_BIG (-1.0e30f)
#define LOG2E 1.4426950408889634f
#define LN2 0.6931471805599453f

INLINE int imin(int a, int b) { return a < b ? a : b; }

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

// wht_rows with its loops kept rolled: for a kernel's tail (attn_v4's inverse rotation), where the
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

// Kernel A's inner loop: TPT keys per thread (packed rows in kw, W words each), all R query rows of
// the group at once, so each code is decoded once and serves R rows. qs is [D][R]; acc is [TPT][R].
template <int D, int BITS, int R, int TPT, int W>
INLINE void dot_codes(THR const uint* kw, TG const float* qs, TG const float* lv, THR float* acc) {
  constexpr uint MASK = (1u << BITS) - 1u;
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
    const int bit = i * BITS;
    const int wi = bit >> 5;
    const int sh = bit & 31;
    UNROLL for (int a = 0; a < TPT; ++a) {
      uint c = kw[a * W + wi] >> sh;
      if (sh + BITS > 32) c |= kw[a * W + wi + 1] << (32 - sh);
      const float l = lv[c & MASK];
      UNROLL for (int r = 0; r < R; ++r) acc[a * R + r] += qv[r] * l;
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

// Kernel C's inner step, word-parallel: 32 codes held in BITS whole words, one weight.
template <int BITS>
INLINE void accum_chunk32(THR const uint* w, float wt, TG const float* lv, THR float* acc) {
  constexpr uint MASK = (1u << BITS) - 1u;
  UNROLL for (int i = 0; i < 32; ++i) {
    const int bit = i * BITS;
    const int wi = bit >> 5;
    const int sh = bit & 31;
    uint c = w[wi] >> sh;
    if (sh + BITS > 32) c |= w[wi + 1] << (32 - sh);
    acc[i] += wt * lv[c & MASK];
  }
}
