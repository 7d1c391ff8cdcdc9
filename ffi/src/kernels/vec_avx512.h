// AVX-512F 16-lane f32 vector (with AVX512-BF16 conversions when the translation unit is
// compiled for it). Included inside the ISA namespace; no include guard.

constexpr int kLanes = 16;
constexpr int kVfRegs = 1;  // machine registers one VF takes: one zmm

struct VF {
  __m512 v;
};

inline __mmask16 lane_mask(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

inline VF vzero() { return {_mm512_setzero_ps()}; }
inline VF vset1(float x) { return {_mm512_set1_ps(x)}; }
inline VF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline VF bf16_bits_to_vf(__m256i h) { return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))}; }
inline VF vload(const bf16* p) { return bf16_bits_to_vf(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline VF vload_n(const float* p, int n) { return {_mm512_maskz_loadu_ps(lane_mask(n), p)}; }
inline VF vload_n(const bf16* p, int n) { return bf16_bits_to_vf(_mm256_maskz_loadu_epi16(lane_mask(n), p)); }

#if !defined(__AVX512BF16__)
// x rounded to bf16 in the high half of each 32-bit lane (RNE in integer arithmetic; NaN ->
// quiet NaN); the low half is garbage.
inline __m512i ps_to_bf16_high(VF x) {
  const __m512i u = _mm512_castps_si512(x.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x00400000)));
}
#endif
inline __m256i vf_to_bf16_bits(VF x) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(x.v);
#else
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(ps_to_bf16_high(x), 16));
#endif
}
#if defined(__AVX512BF16__)
// bf16 dot products (VDPBF16PS), used where both operands are bf16 already (kernels/linear.h).
// VB holds 32 bf16, i.e. 16 pairs; vdot_bf16 adds pair j's two products to lane j (element
// 2j + 1's first), each product exact in f32 and each sum rounded to nearest even as an FMA
// would (denormal inputs and results flush to zero).
#define GDN_BF16_DOT 1
constexpr int kDotElems = 32;
struct VB {
  __m512bh v;
};
inline VB vload_b(const bf16* p) { return {(__m512bh)_mm512_loadu_si512(p)}; }
inline VB vload_b_n(const bf16* p, int n) {  // elements past n are zero
  return {(__m512bh)_mm512_maskz_loadu_epi16(n >= 32 ? ~__mmask32(0) : (__mmask32(1) << n) - 1u, p)};
}
inline VF vdot_bf16(VF acc, VB a, VB b) { return {_mm512_dpbf16_ps(acc.v, a.v, b.v)}; }
// Pair p[0], p[1] in every 32-bit lane (the x side of the packed projection, linear_packed.h).
inline VB vbcast_b_pair(const bf16* p) {
  int32_t u;
  std::memcpy(&u, p, sizeof u);
  return {(__m512bh)_mm512_set1_epi32(u)};
}
#endif
// 16 bf16 pairs (32 elements): lane j of even / odd = element 2j / 2j + 1, widened exactly.
inline void vload_pair_split(const bf16* p, VF* even, VF* odd) {
  const __m512i u = _mm512_loadu_si512(p);
  *even = {_mm512_castsi512_ps(_mm512_slli_epi32(u, 16))};
  *odd = {_mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(int(0xffff0000u))))};
}

// The pair order of 32 consecutive elements, over two VFs: x[0] holds the even ones (0, 2, ..,
// 30), x[1] the odd ones (vec_avx2.h has it within one VF). 64 bytes of bf16 widen to it with
// one shift and one and, and narrow from it with one two-source conversion and one word permute,
// where the plain order takes a zero-extending (lane-crossing) load and a shift per 16 values
// and a narrowing conversion per 16 (ffi/README.md, Recurrent decode / spec, "The pair order on
// AVX-512"). Kernels whose arithmetic is per column keep a full unit in this order from load to
// store; f32 pieces exchanged with it (v, o) are (de)interleaved once per K state rows.
constexpr bool kPairOrder = true;
constexpr int kPairVF = 2;  // VFs per unit of the pair order
inline void vload_pairs(const bf16* p, VF* x) { vload_pair_split(p, &x[0], &x[1]); }
inline __m512i pair_index(int first) {  // lanes first, first + 2, .., first + 30 of two vectors
  return _mm512_add_epi32(_mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0),
                          _mm512_set1_epi32(first));
}
inline void vload_pairs(const float* p, VF* x) {
  const __m512 a = _mm512_loadu_ps(p), b = _mm512_loadu_ps(p + 16);
  x[0] = {_mm512_permutex2var_ps(a, pair_index(0), b)};
  x[1] = {_mm512_permutex2var_ps(a, pair_index(1), b)};
}
// Same bits as vstore of the plain-order vectors (core test "bf16 pair order").
inline __m512i ps_pairs_to_bf16x32(const VF* x) {
#if defined(__AVX512BF16__)
  // Words 0-15: the even elements, 16-31: the odd ones; then interleaved.
  const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(x[1].v, x[0].v);
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(idx, w);
#else
  // Each 32-bit word: the odd element's rounding high, the even one's low (bit select).
  return _mm512_ternarylogic_epi32(_mm512_set1_epi32(int(0xffff0000u)), ps_to_bf16_high(x[1]),
                                   _mm512_srli_epi32(ps_to_bf16_high(x[0]), 16), 0xCA);
#endif
}
inline void vstore_pairs(bf16* p, const VF* x) { _mm512_storeu_si512(p, ps_pairs_to_bf16x32(x)); }
inline void vstream_pairs(bf16* p, const VF* x) {
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), ps_pairs_to_bf16x32(x));
}
inline void vstore_pairs(float* p, const VF* x) {
  const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_ps(p, _mm512_permutex2var_ps(x[0].v, lo, x[1].v));
  _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(x[0].v, _mm512_add_epi32(lo, _mm512_set1_epi32(8)), x[1].v));
}

inline void vstore(float* p, VF x) { _mm512_storeu_ps(p, x.v); }
inline void vstore(bf16* p, VF x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), vf_to_bf16_bits(x)); }
inline void vstore_n(float* p, VF x, int n) { _mm512_mask_storeu_ps(p, lane_mask(n), x.v); }
inline void vstore_n(bf16* p, VF x, int n) { _mm256_mask_storeu_epi16(p, lane_mask(n), vf_to_bf16_bits(x)); }

inline VF operator+(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VF operator-(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VF operator*(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF operator/(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VF vfma(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vmax(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }

// exp with ~1 ulp error over the f32 range: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2],
// degree-6 minimax polynomial; underflows to 0 below -104, overflows to inf above 88.7.
inline VF vexp(VF a) {
  const __m512 x = _mm512_max_ps(_mm512_min_ps(a.v, _mm512_set1_ps(88.7228391f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return {_mm512_scalef_ps(p, n)};
}

inline float vsum(VF a) {
  // Same pairwise order as the generic back end: halves, then quarters, ...
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// Non-temporal store of 16 lanes, for data not read again soon (no read-for-ownership of
// the destination line). p aligned to 16 elements of its type: 64 B for f32, 32 B for bf16.
// Same values as vstore. vstream_fence() orders them before later stores.
inline void vstream(float* p, VF x) { _mm512_stream_ps(p, x.v); }
inline void vstream(bf16* p, VF x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), vf_to_bf16_bits(x)); }
inline void vstream_fence() { _mm_sfence(); }

// dst[c * 16 + l] = src[l * ld + c] for c, l < 16 (scalar.h's transpose16_scalar): 16 row loads,
// four shuffle stages (32-bit, 64-bit, then 128-bit lanes twice), 16 stores.
inline void vtranspose16(const float* src, int64_t ld, float* dst) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ld);
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto lo = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  auto hi = [](__m512 a, __m512 b) { return _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b))); };
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = lo(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = hi(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = lo(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = hi(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + i * 16, r[i]);
}

// x * sigmoid(x) = x / (1 + e^-x), the conv's SiLU. vexp clamps -x to <= 88.7, so below
// x = -88 (true value under 1e-36 in magnitude) the quotient would be x / 3.4e38, not ~0:
// those lanes become x * 0, which is -0, and NaN for x = -Inf as in float64 (-Inf / Inf) and
// the other back ends; a NaN x stays NaN. (rcp14ps + a Newton step instead of the division
// measured slower on a Sapphire Rapids host: ffi/README.md, "Causal conv1d".)
inline VF vsilu(VF a) {
  const __m512 d = _mm512_add_ps(vexp(vzero() - a).v, _mm512_set1_ps(1.f));
  const __mmask16 tiny = _mm512_cmp_ps_mask(a.v, _mm512_set1_ps(-88.f), _CMP_LT_OQ);
  return {_mm512_mask_mul_ps(_mm512_div_ps(a.v, d), tiny, a.v, _mm512_setzero_ps())};
}
// SiLU for a result rounded to bf16 next (the conv with bf16 activations): vec_avx2.h's
// silu8_bf16 on 16 lanes (e^-x = 2^t, t = -x log2(e) clamped to [-126, 128], 2^(t - round(t))
// by the degree-5 polynomial, one division; relative error <= 3.6e-6), with the exponent scale
// by scalef. t = 128 scales to +Inf, so x < -88.37 gives x / Inf = -0 and x = -Inf gives NaN;
// NaN stays NaN (the clamp loses it, x keeps it).
inline VF vsilu_bf16(VF a) {
  __m512 t = _mm512_mul_ps(a.v, _mm512_set1_ps(kNegLog2e));
  t = _mm512_min_ps(_mm512_max_ps(t, _mm512_set1_ps(-126.f)), _mm512_set1_ps(128.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kExp2Poly5[0]), f, _mm512_set1_ps(kExp2Poly5[1]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly5[2]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly5[3]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly5[4]));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly5[5]));
  const __m512 d = _mm512_add_ps(_mm512_scalef_ps(p, n), _mm512_set1_ps(1.f));  // 1 + e^-x
  return {_mm512_div_ps(a.v, d)};
}
