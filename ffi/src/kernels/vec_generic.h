// Portable 16-lane f32 vector: four GNU vectors of the baseline register width (16 bytes:
// SSE2 on x86-64, NEON on aarch64; GCC, Clang), each operation written once over the four.
// Per-lane loops over 16 floats compiled 2-3x slower (every one unrolled, then SLP-vectorised)
// into the same code; one 64-byte GNU vector is split through memory by the compiler (3x
// slower kernels). Included inside the ISA namespace; no include guard.

constexpr int kLanes = 16;
constexpr int kVfRegs = 4;  // machine registers one VF takes: four 16-byte SSE2 / NEON vectors
constexpr bool kPairOrder = false;  // the pair order of vec_avx2.h / vec_avx512.h (no vload_pairs here)
constexpr int kPairVF = 1;

typedef float V4 __attribute__((vector_size(16)));
typedef uint32_t VU4 __attribute__((vector_size(16)));
typedef int32_t VI4 __attribute__((vector_size(16)));
typedef uint16_t VH4 __attribute__((vector_size(8)));

struct VF {
  V4 q[4];
};

#define GDN_VF_MAP(expr) \
  VF r;                  \
  for (int j = 0; j < 4; ++j) r.q[j] = (expr); \
  return r

inline VF vzero() { GDN_VF_MAP(V4{}); }
inline VF vset1(float x) { GDN_VF_MAP(V4{} + x); }
// Per 16-byte piece: a memcpy of the whole VF went through a stack copy.
inline V4 load4(const float* p) { V4 r; std::memcpy(&r, p, sizeof r); return r; }
inline VF vload(const float* p) { GDN_VF_MAP(load4(p + 4 * j)); }
// bf16 -> f32 is the 16 bits moved to the top of an f32 (as to_f32).
inline V4 widen4(const bf16* p) {
  VH4 h;
  std::memcpy(&h, p, sizeof h);
  return (V4)(__builtin_convertvector(h, VU4) << 16);
}
inline VF vload(const bf16* p) { GDN_VF_MAP(widen4(p + 4 * j)); }
// 16 bf16 pairs (32 elements): lane j of even / odd = element 2j / 2j + 1, widened exactly.
inline void vload_pair_split(const bf16* p, VF* even, VF* odd) {
  for (int j = 0; j < 4; ++j) {
    VU4 u;
    std::memcpy(&u, p + 8 * j, sizeof u);
    even->q[j] = (V4)(u << 16);
    odd->q[j] = (V4)(u & 0xffff0000u);
  }
}
template <class T>
inline VF vload_n(const T* p, int n) {
  float t[kLanes] = {};
  for (int i = 0; i < n; ++i) t[i] = to_f32(p[i]);
  return vload(t);
}
inline void vstore(float* p, VF x) { for (int j = 0; j < 4; ++j) std::memcpy(p + 4 * j, &x.q[j], sizeof x.q[j]); }
// Round to nearest even, NaN stays NaN (quiet): to_bf16 on every lane.
inline void narrow4(bf16* p, V4 x) {
  const VU4 u = (VU4)x;
  const VU4 nan = (VU4)((VI4)(u & 0x7fffffffu) > 0x7f800000);
  const VU4 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const VU4 quiet = (u >> 16) | 0x40u;
  const VH4 h = __builtin_convertvector((rounded & ~nan) | (quiet & nan), VH4);
  std::memcpy(p, &h, sizeof h);
}
inline void vstore(bf16* p, VF x) { for (int j = 0; j < 4; ++j) narrow4(p + 4 * j, x.q[j]); }
template <class T>
inline void vstore_n(T* p, VF x, int n) {
  float t[kLanes];
  vstore(t, x);
  for (int i = 0; i < n; ++i) store1(p + i, t[i]);
}
// vstore_pairs' interleave (vec_avx512.h): element 2j from even lane j, 2j + 1 from odd lane j,
// each rounded as vstore. No kernel here keeps the pair order; AMX's model packs VNNI rows with it.
inline void vstore_pairs(bf16* p, const VF* x) {
  bf16 e[kLanes], o[kLanes];
  vstore(e, x[0]);
  vstore(o, x[1]);
  for (int j = 0; j < kLanes; ++j) {
    p[2 * j] = e[j];
    p[2 * j + 1] = o[j];
  }
}

#define GDN_VF_BINOP(op) \
  inline VF operator op(VF a, VF b) { GDN_VF_MAP(a.q[j] op b.q[j]); }
GDN_VF_BINOP(+)
GDN_VF_BINOP(-)
GDN_VF_BINOP(*)
GDN_VF_BINOP(/)
#undef GDN_VF_BINOP

// a * b + c. Not std::fma: on a baseline target without FMA hardware that is a slow library
// call; the compiler may still contract this where the target has FMA.
inline VF vfma(VF a, VF b, VF c) { GDN_VF_MAP(a.q[j] * b.q[j] + c.q[j]); }
// a > b ? a : b per lane (a NaN in a gives b).
inline V4 max4(V4 a, V4 b) {
  const VU4 m = (VU4)(a > b);
  return (V4)(((VU4)a & m) | ((VU4)b & ~m));
}
inline VF vmax(VF a, VF b) { GDN_VF_MAP(max4(a.q[j], b.q[j])); }
#undef GDN_VF_MAP
inline VF vexp(VF a) {
  float t[kLanes];
  vstore(t, a);
  for (int i = 0; i < kLanes; ++i) t[i] = std::exp(t[i]);
  return vload(t);
}
// Sum of lanes in a fixed pairwise order (the same on every back end).
inline float vsum(VF a) {
  float t[kLanes];
  vstore(t, a);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] += t[i + w];
  return t[0];
}

// Non-temporal store of 16 lanes, for data not read again soon (bypasses the caches on the
// x86 back ends; p aligned to 16 elements of its type: 64 B for f32, 32 B for bf16). Same
// values as vstore. vstream_fence() orders them before later stores (call it before other
// threads may read the data). Here: plain stores, nothing to fence.
inline void vstream(float* p, VF x) { vstore(p, x); }
inline void vstream(bf16* p, VF x) { vstore(p, x); }
inline void vstream_fence() {}
// A 16 x 16 block transposed (chunk_prep's k^T): the scalar loop of scalar.h.
inline void vtranspose16(const float* src, int64_t ld, float* dst) { transpose16_scalar(src, ld, dst); }

// x * sigmoid(x) = x / (1 + e^-x), the conv's SiLU.
inline VF vsilu(VF a) { return a / (vset1(1.f) + vexp(vzero() - a)); }
// SiLU for a bf16-rounded result: the portable back end keeps the full one (vec_avx2.h,
// vec_neon.h have a cheaper form).
inline VF vsilu_bf16(VF a) { return vsilu(a); }
