// AArch64 NEON 16-lane f32 vector held as four float32x4_t. Compiled twice: plain Armv8-A
// (neon) and Armv8.6-A+bf16 (neon_bf16), where f32 -> bf16 uses the hardware BFCVTN.
// Included inside the ISA namespace; no include guard.

constexpr int kLanes = 16;
constexpr int kVfRegs = 4;  // machine registers one VF takes: four q registers
constexpr bool kPairOrder = false;  // the pair order of vec_avx2.h / vec_avx512.h (no vload_pairs here)
constexpr int kPairVF = 1;

struct VF {
  float32x4_t v[4];
};

inline VF vzero() { const float32x4_t z = vdupq_n_f32(0.f); return {{z, z, z, z}}; }
inline VF vset1(float x) { const float32x4_t s = vdupq_n_f32(x); return {{s, s, s, s}}; }
inline VF vload(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline float32x4_t bf16x4_to_f32(uint16x4_t h) { return vreinterpretq_f32_u32(vshll_n_u16(h, 16)); }
inline VF vload(const bf16* p) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(p);
  const uint16x8_t a = vld1q_u16(u), b = vld1q_u16(u + 8);
  return {{bf16x4_to_f32(vget_low_u16(a)), bf16x4_to_f32(vget_high_u16(a)), bf16x4_to_f32(vget_low_u16(b)),
           bf16x4_to_f32(vget_high_u16(b))}};
}
// 16 bf16 pairs (32 elements): lane j of even / odd = element 2j / 2j + 1, widened exactly.
inline void vload_pair_split(const bf16* p, VF* even, VF* odd) {
  const uint32_t* u = reinterpret_cast<const uint32_t*>(p);
  for (int j = 0; j < 4; ++j) {
    const uint32x4_t w = vld1q_u32(u + 4 * j);
    even->v[j] = vreinterpretq_f32_u32(vshlq_n_u32(w, 16));
    odd->v[j] = vreinterpretq_f32_u32(vandq_u32(w, vdupq_n_u32(0xffff0000u)));
  }
}
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
// bf16 dot products (BFDOT), used where both operands are bf16 already (kernels/linear.h,
// linear_packed.h). VB holds 32 bf16, i.e. 16 pairs, as four q registers; vdot_bf16 adds pair
// j's two products to lane j. The products are exact in f32; on Armv8.6 without FEAT_EBF16
// (FPCR ignored) the pair's sum and its addition to the lane are each rounded to odd, and
// denormal inputs and results flush to zero (ffi/README.md, "ARM NEON-BF16").
#define GDN_BF16_DOT 1
constexpr int kDotElems = 32;
struct VB {
  bfloat16x8_t v[4];
};
inline VB vload_b(const bf16* p) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(p);
  return {{vreinterpretq_bf16_u16(vld1q_u16(u)), vreinterpretq_bf16_u16(vld1q_u16(u + 8)),
           vreinterpretq_bf16_u16(vld1q_u16(u + 16)), vreinterpretq_bf16_u16(vld1q_u16(u + 24))}};
}
inline VB vload_b_n(const bf16* p, int n) {  // elements past n are zero
  if (n >= kDotElems) return vload_b(p);
  alignas(16) bf16 t[kDotElems];
  std::memset(static_cast<void*>(t), 0, sizeof(t));
  for (int i = 0; i < n; ++i) t[i] = p[i];
  return vload_b(t);
}
inline VF vdot_bf16(VF acc, VB a, VB b) {
  return {{vbfdotq_f32(acc.v[0], a.v[0], b.v[0]), vbfdotq_f32(acc.v[1], a.v[1], b.v[1]),
           vbfdotq_f32(acc.v[2], a.v[2], b.v[2]), vbfdotq_f32(acc.v[3], a.v[3], b.v[3])}};
}
// Pair p[0], p[1] in every 32-bit lane (the x side of the packed projection, linear_packed.h).
inline VB vbcast_b_pair(const bf16* p) {
  uint32_t u;
  std::memcpy(&u, p, sizeof u);
  const bfloat16x8_t b = vreinterpretq_bf16_u32(vdupq_n_u32(u));
  return {{b, b, b, b}};
}
#endif
template <class T>
inline VF vload_n(const T* p, int n) {
  if (n >= kLanes) return vload(p);
  alignas(16) T t[kLanes];
  std::memset(static_cast<void*>(t), 0, sizeof(t));
  for (int i = 0; i < n; ++i) t[i] = p[i];
  return vload(t);
}

inline uint16x4_t f32x4_to_bf16(float32x4_t x) {
#if defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC) || defined(__ARM_FEATURE_BF16)
  return vreinterpret_u16_bf16(vcvt_bf16_f32(x));
#else
  // Round to nearest even; NaN -> quiet NaN.
  const uint32x4_t u = vreinterpretq_u32_f32(x);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  uint32x4_t r = vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7fff), lsb));
  const uint32x4_t is_num = vceqq_f32(x, x);
  r = vbslq_u32(is_num, r, vorrq_u32(u, vdupq_n_u32(0x00400000)));
  return vshrn_n_u32(r, 16);
#endif
}
inline void vstore(float* p, VF x) { for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, x.v[i]); }
inline void vstore(bf16* p, VF x) {
  uint16_t* u = reinterpret_cast<uint16_t*>(p);
  for (int i = 0; i < 4; ++i) vst1_u16(u + 4 * i, f32x4_to_bf16(x.v[i]));
}
template <class T>
inline void vstore_n(T* p, VF x, int n) {
  if (n >= kLanes) return vstore(p, x);
  alignas(16) T t[kLanes];
  vstore(t, x);
  for (int i = 0; i < n; ++i) p[i] = t[i];
}

#define GDN_VF_BINOP(op, fn)                                                                  \
  inline VF operator op(VF a, VF b) {                                                         \
    return {{fn(a.v[0], b.v[0]), fn(a.v[1], b.v[1]), fn(a.v[2], b.v[2]), fn(a.v[3], b.v[3])}}; \
  }
GDN_VF_BINOP(+, vaddq_f32)
GDN_VF_BINOP(-, vsubq_f32)
GDN_VF_BINOP(*, vmulq_f32)
GDN_VF_BINOP(/, vdivq_f32)
#undef GDN_VF_BINOP
inline VF vfma(VF a, VF b, VF c) {
  return {{vfmaq_f32(c.v[0], a.v[0], b.v[0]), vfmaq_f32(c.v[1], a.v[1], b.v[1]), vfmaq_f32(c.v[2], a.v[2], b.v[2]),
           vfmaq_f32(c.v[3], a.v[3], b.v[3])}};
}
inline VF vmax(VF a, VF b) {
  return {{vmaxq_f32(a.v[0], b.v[0]), vmaxq_f32(a.v[1], b.v[1]), vmaxq_f32(a.v[2], b.v[2]), vmaxq_f32(a.v[3], b.v[3])}};
}

// Same algorithm and constants as the x86 exp (vec_avx512.h).
inline float32x4_t exp4(float32x4_t a) {
  const float32x4_t x = vmaxq_f32(vminq_f32(a, vdupq_n_f32(88.7228391f)), vdupq_n_f32(-87.3f));
  const float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.9875691500e-4f);
  p = vfmaq_f32(vdupq_n_f32(1.3981999507e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(8.3334519073e-3f), p, r);
  p = vfmaq_f32(vdupq_n_f32(4.1665795894e-2f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.6666665459e-1f), p, r);
  p = vfmaq_f32(vdupq_n_f32(5.0000001201e-1f), p, r);
  p = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.f)), p, vmulq_f32(r, r));
  const int32x4_t ni = vcvtq_s32_f32(n);
  const int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
  const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
  const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
  const float32x4_t res = vmulq_f32(vmulq_f32(p, s1), s2);
  const uint32x4_t keep = vcgeq_f32(a, vdupq_n_f32(-87.3f));
  return vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(res), keep));
}
inline VF vexp(VF a) { return {{exp4(a.v[0]), exp4(a.v[1]), exp4(a.v[2]), exp4(a.v[3])}}; }

inline float vsum(VF a) {
  // Same pairwise order as the generic back end: lanes i + 8, then i + 4, i + 2, i + 1.
  const float32x4_t h0 = vaddq_f32(a.v[0], a.v[2]), h1 = vaddq_f32(a.v[1], a.v[3]);
  const float32x4_t q = vaddq_f32(h0, h1);
  const float32x2_t d = vadd_f32(vget_low_f32(q), vget_high_f32(q));
  return vget_lane_f32(d, 0) + vget_lane_f32(d, 1);
}

// Non-temporal store of 16 lanes, for data not read again soon (the x86 back ends bypass the
// caches; p aligned to 16 elements of its type). Same values as vstore. vstream_fence()
// orders them before later stores. Here: plain stores, nothing to fence.
inline void vstream(float* p, VF x) { vstore(p, x); }
inline void vstream(bf16* p, VF x) { vstore(p, x); }
inline void vstream_fence() {}
// A 16 x 16 block transposed (chunk_prep's k^T): the scalar loop of scalar.h.
inline void vtranspose16(const float* src, int64_t ld, float* dst) { transpose16_scalar(src, ld, dst); }

// x * sigmoid(x) = x / (1 + e^-x), the conv's SiLU.
inline VF vsilu(VF a) { return a / (vset1(1.f) + vexp(vzero() - a)); }
// SiLU for a result rounded to bf16 next: the algorithm of vec_avx2.h's silu8_bf16 (constants:
// scalar.h) (2^t with a degree-5 polynomial, one division; relative error <= 3.6e-6), fewer
// operations than vsilu's full-range exp. FMAX/FMIN propagate a NaN, so NaN stays NaN.
inline float32x4_t silu4_bf16(float32x4_t x) {
  float32x4_t t = vmulq_f32(x, vdupq_n_f32(kNegLog2e));
  t = vminq_f32(vmaxq_f32(t, vdupq_n_f32(-126.f)), vdupq_n_f32(128.f));
  const float32x4_t n = vrndnq_f32(t);
  const float32x4_t f = vsubq_f32(t, n);
  float32x4_t p = vfmaq_f32(vdupq_n_f32(kExp2Poly5[1]), vdupq_n_f32(kExp2Poly5[0]), f);
  p = vfmaq_f32(vdupq_n_f32(kExp2Poly5[2]), p, f);
  p = vfmaq_f32(vdupq_n_f32(kExp2Poly5[3]), p, f);
  p = vfmaq_f32(vdupq_n_f32(kExp2Poly5[4]), p, f);
  p = vfmaq_f32(vdupq_n_f32(kExp2Poly5[5]), p, f);
  const float32x4_t s = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
  return vdivq_f32(x, vfmaq_f32(vdupq_n_f32(1.f), p, s));  // x / (1 + e^-x); 2^128 = +Inf
}
inline VF vsilu_bf16(VF a) { return {{silu4_bf16(a.v[0]), silu4_bf16(a.v[1]), silu4_bf16(a.v[2]), silu4_bf16(a.v[3])}}; }
