// AVX2 + FMA 16-lane f32 vector held as two __m256. Included inside the ISA namespace; no
// include guard.

constexpr int kLanes = 16;
constexpr int kVfRegs = 2;  // machine registers one VF takes: two ymm

struct VF {
  __m256 lo, hi;
};

inline __m256i tail_mask8(int n) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota);
}

inline VF vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VF vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline VF vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8_to_ps(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
// Two 128-bit loads that fold into vpmovzxwd's memory operand (a 256-bit load + extract
// costs two more uops per 16 lanes; a 256-bit load + vpermq + two unpacks with zero was no
// faster on Zen 3: decode B=8 bf16 state, 2026-12-02).
inline VF vload(const bf16* p) {
  return {bf16x8_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          bf16x8_to_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline VF vload_n(const float* p, int n) {
  if (n >= 16) return vload(p);
  return {_mm256_maskload_ps(p, tail_mask8(n)), _mm256_maskload_ps(p + 8, tail_mask8(n - 8))};
}
inline VF vload_n(const bf16* p, int n) {
  if (n >= 16) return vload(p);
  alignas(32) bf16 t[16] = {};
  for (int i = 0; i < n; ++i) t[i] = p[i];
  return vload(t);
}

// Round to nearest even in integer arithmetic, for lanes that are not NaN (±Inf stays Inf,
// overflow rounds to Inf). Returns the bf16 bits in the high half of each 32-bit lane (the
// low half is what the rounding left there).
inline __m256i ps_to_bf16_high_not_nan(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
}
// The same for any lane: NaN -> quiet NaN (the rounding add could carry a NaN's low
// mantissa bits into Inf or into the sign).
inline __m256i ps_to_bf16_high(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(ps_to_bf16_high_not_nan(x), _mm256_or_si256(u, _mm256_set1_epi32(0x00400000)), nan);
}
// Both halves of a VF rounded, the bf16 bits in the high half of each lane. One unordered
// compare of the two halves finds a NaN in either; only then do the lanes take the NaN blend
// (3 of the ~18 operations per 16 values; on NaN-free data the branch is never taken). Same
// bits either way (core test "bf16 rounding").
inline void ps_to_bf16_high2(VF x, __m256i* lo, __m256i* hi) {
  const __m256 unord = _mm256_cmp_ps(x.lo, x.hi, _CMP_UNORD_Q);
  if (__builtin_expect(_mm256_movemask_ps(unord) == 0, 1)) {
    *lo = ps_to_bf16_high_not_nan(x.lo);
    *hi = ps_to_bf16_high_not_nan(x.hi);
  } else {
    *lo = ps_to_bf16_high(x.lo);
    *hi = ps_to_bf16_high(x.hi);
  }
}
// 16 lanes -> 16 bf16 in one 256-bit register: one in-lane pack of both halves, then the
// 64-bit quarters back in order (cheaper than packing each half across its 128-bit lanes).
inline __m256i ps_to_bf16x16(VF x) {
  __m256i lo, hi;
  ps_to_bf16_high2(x, &lo, &hi);
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(_mm256_srli_epi32(lo, 16), _mm256_srli_epi32(hi, 16)), 0xD8);
}

// 16 bf16 pairs (32 elements): lane j of even / odd = element 2j / 2j + 1, widened exactly
// (the plain lane order, unlike vload_pairs).
inline void vload_pair_split(const bf16* p, VF* even, VF* odd) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i hi = _mm256_set1_epi32(int(0xffff0000u));
  *even = {_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
  *odd = {_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi))};
}

// The pair order of 16 consecutive elements: lo holds the even ones (0, 2, .., 14), hi the odd
// ones. 32 bytes of bf16 widen to it with one shift and one and (the odd element of each
// 32-bit word already sits in its high half), and narrow from it with one shift and one word
// blend after the rounding: per 16 values 4 shifts, a blend and no shuffle, against 6 shifts
// and 4 shuffles (zero-extends, pack, lane permute) in the plain order. Kernels whose
// arithmetic is per column (the recurrence's state block: ffi/README.md, "Recurrent decode /
// spec") keep a full piece in this order from load to store; f32 pieces they exchange with it
// (v, o) are (de)interleaved on the way, once per K state rows.
constexpr bool kPairOrder = true;
constexpr int kPairVF = 1;  // VFs per unit of the pair order (two on AVX-512)
inline void vload_pairs(const bf16* p, VF* x) {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  x[0] = {_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)),
          _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(int(0xffff0000u))))};
}
inline void vload_pairs(const float* p, VF* x) {
  const __m256 a = _mm256_loadu_ps(p), b = _mm256_loadu_ps(p + 8);
  // In-lane picks give [0 2 8 10 | 4 6 12 14]; the 64-bit permute puts the quarters in order.
  const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0));
  const __m256 o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  x[0] = {_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8)),
          _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8))};
}
// Same bits as vstore of the plain-order vector (core test "bf16 pair order").
inline __m256i ps_pairs_to_bf16x16(VF x) {
  __m256i e, o;
  ps_to_bf16_high2(x, &e, &o);
  return _mm256_blend_epi16(_mm256_srli_epi32(e, 16), o, 0xAA);
}
inline void vstore_pairs(bf16* p, const VF* x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ps_pairs_to_bf16x16(x[0]));
}
inline void vstream_pairs(bf16* p, const VF* x) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), ps_pairs_to_bf16x16(x[0]));
}
inline void vstore_pairs(float* p, const VF* x) {
  // [0-3 | 8-11], [4-7 | 12-15]
  const __m256 a = _mm256_unpacklo_ps(x[0].lo, x[0].hi), b = _mm256_unpackhi_ps(x[0].lo, x[0].hi);
  _mm256_storeu_ps(p, _mm256_permute2f128_ps(a, b, 0x20));
  _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(a, b, 0x31));
}

inline void vstore(float* p, VF x) { _mm256_storeu_ps(p, x.lo); _mm256_storeu_ps(p + 8, x.hi); }
inline void vstore(bf16* p, VF x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), ps_to_bf16x16(x)); }
inline void vstore_n(float* p, VF x, int n) {
  if (n >= 16) return vstore(p, x);
  _mm256_maskstore_ps(p, tail_mask8(n), x.lo);
  _mm256_maskstore_ps(p + 8, tail_mask8(n - 8), x.hi);
}
inline void vstore_n(bf16* p, VF x, int n) {
  if (n >= 16) return vstore(p, x);
  alignas(32) bf16 t[16];
  vstore(t, x);
  for (int i = 0; i < n; ++i) p[i] = t[i];
}

#define GDN_VF_BINOP(op, fn) \
  inline VF operator op(VF a, VF b) { return {fn(a.lo, b.lo), fn(a.hi, b.hi)}; }
GDN_VF_BINOP(+, _mm256_add_ps)
GDN_VF_BINOP(-, _mm256_sub_ps)
GDN_VF_BINOP(*, _mm256_mul_ps)
GDN_VF_BINOP(/, _mm256_div_ps)
#undef GDN_VF_BINOP
inline VF vfma(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline VF vmax(VF a, VF b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }

// e^x = p * 2^n for x already clamped to the range the caller can scale: n = round(x / ln 2)
// and p = e^r, r = x - n ln 2 (ln 2 in two parts), by the polynomial of the AVX-512 exp
// (vec_avx512.h). Returns p, n in *n_out.
inline __m256 exp8_reduced(__m256 x, __m256* n_out) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  *n_out = n;
  return _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
}
// 2^n for integral n in [-126, 127], built in the exponent field.
inline __m256 pow2_8(__m256i n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

// Same algorithm and constants as the AVX-512 exp (vec_avx512.h).
inline __m256 exp8(__m256 a) {
  const __m256 x = _mm256_max_ps(_mm256_min_ps(a, _mm256_set1_ps(88.7228391f)), _mm256_set1_ps(-87.3f));
  __m256 n;
  const __m256 p = exp8_reduced(x, &n);
  // n in [-126, 128]: split 2^n = 2^(n/2) * 2^(n - n/2) so neither factor overflows.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256 res = _mm256_mul_ps(_mm256_mul_ps(p, pow2_8(n1)), pow2_8(n2));
  // Below the clamp the true value is < 2^-126: flush to 0 like the other back ends' underflow.
  return _mm256_and_ps(res, _mm256_cmp_ps(a, _mm256_set1_ps(-87.3f), _CMP_GE_OQ));
}
inline VF vexp(VF a) { return {exp8(a.lo), exp8(a.hi)}; }

// x * sigmoid(x) = x / (1 + e^-x), the conv's SiLU (its hot spot). Cheaper than through
// vexp and a division, same accuracy class (a few ulp): e^-x with the argument clamped to
// [-87.3, 88] so that one exponent scale suffices (for x < -88 the true value is below
// 1e-36 in magnitude), and 1 / (1 + e) as rcpps refined by one Newton step (~2^-22). rcpps
// flushes tiny results to 0, so a huge negative x gives 0, not x times a denormal.
inline __m256 silu8(__m256 x) {
  const __m256 a = _mm256_max_ps(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(88.f)),
                                 _mm256_set1_ps(-87.3f));
  __m256 n;
  const __m256 p = exp8_reduced(a, &n);
  const __m256 d = _mm256_fmadd_ps(p, pow2_8(_mm256_cvtps_epi32(n)), _mm256_set1_ps(1.f));  // 1 + e^-x
  __m256 y = _mm256_rcp_ps(d);
  y = _mm256_mul_ps(y, _mm256_fnmadd_ps(d, y, _mm256_set1_ps(2.f)));
  return _mm256_mul_ps(x, y);
}
inline VF vsilu(VF a) { return {silu8(a.lo), silu8(a.hi)}; }

// SiLU for a result that is rounded to bf16 next (the conv with bf16 activations): e^-x = 2^t,
// t = -x log2(e) clamped to [-126, 128], 2^(t - round(t)) by a degree-5 relative-minimax
// polynomial (7.5e-8), then one division: 15 operations per 8 lanes against silu8's 22, and
// ~1.4x its throughput. Relative error <= 3.6e-6 (the f32 rounding of t at large |x|), RMS
// 4.3e-8 on N(0, 2): its bf16 outputs round like the exact SiLU's (core test "silu bf16";
// a degree-3 polynomial, ~5% faster, rounded 0.4% of them the other way). From t = 127.5 on
// 2^n is +Inf (exponent field 255), so x < -88.37 gives x / Inf = -0 (true value below 4e-37);
// NaN stays NaN.
inline __m256 silu8_bf16(__m256 x) {
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kNegLog2e));
  t = _mm256_min_ps(_mm256_max_ps(t, _mm256_set1_ps(-126.f)), _mm256_set1_ps(128.f));
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kExp2Poly5[0]), f, _mm256_set1_ps(kExp2Poly5[1]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly5[2]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly5[3]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly5[4]));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly5[5]));
  const __m256 d = _mm256_fmadd_ps(p, pow2_8(_mm256_cvtps_epi32(n)), _mm256_set1_ps(1.f));  // 1 + e^-x
  return _mm256_div_ps(x, d);
}
inline VF vsilu_bf16(VF a) { return {silu8_bf16(a.lo), silu8_bf16(a.hi)}; }

inline float vsum(VF a) {
  // Same pairwise order as the generic back end.
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}

// Non-temporal store of 16 lanes, for data not read again soon (no read-for-ownership of
// the destination line). p aligned to 16 elements of its type: 64 B for f32, 32 B for bf16.
// Same values as vstore. vstream_fence() orders them before later stores.
inline void vstream(float* p, VF x) {
  _mm256_stream_ps(p, x.lo);
  _mm256_stream_ps(p + 8, x.hi);
}
inline void vstream(bf16* p, VF x) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), ps_to_bf16x16(x));
}
inline void vstream_fence() { _mm_sfence(); }
// A 16 x 16 block transposed (chunk_prep's k^T): the scalar loop of scalar.h.
inline void vtranspose16(const float* src, int64_t ld, float* dst) { transpose16_scalar(src, ld, dst); }
