// Portable 16-lane f32 vector: plain loops that any C++17 compiler vectorises for its
// baseline target. Included inside the ISA namespace; no include guard.

constexpr int kLanes = 16;
constexpr int kVfRegs = 4;  // machine registers one VF takes: four 16-byte SSE2 / NEON vectors

struct VF {
  float v[kLanes];
};

inline VF vzero() { VF r; for (int i = 0; i < kLanes; ++i) r.v[i] = 0.f; return r; }
inline VF vset1(float x) { VF r; for (int i = 0; i < kLanes; ++i) r.v[i] = x; return r; }
inline VF vload(const float* p) { VF r; for (int i = 0; i < kLanes; ++i) r.v[i] = p[i]; return r; }
inline VF vload(const bf16* p) { VF r; for (int i = 0; i < kLanes; ++i) r.v[i] = to_f32(p[i]); return r; }
template <class T>
inline VF vload_n(const T* p, int n) {
  VF r = vzero();
  for (int i = 0; i < n; ++i) r.v[i] = to_f32(p[i]);
  return r;
}
inline void vstore(float* p, VF x) { for (int i = 0; i < kLanes; ++i) p[i] = x.v[i]; }
inline void vstore(bf16* p, VF x) { for (int i = 0; i < kLanes; ++i) p[i] = to_bf16(x.v[i]); }
template <class T>
inline void vstore_n(T* p, VF x, int n) { for (int i = 0; i < n; ++i) store1(p + i, x.v[i]); }

#define GDN_VF_BINOP(op)                                                  \
  inline VF operator op(VF a, VF b) {                                     \
    VF r;                                                                 \
    for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] op b.v[i];           \
    return r;                                                             \
  }
GDN_VF_BINOP(+)
GDN_VF_BINOP(-)
GDN_VF_BINOP(*)
GDN_VF_BINOP(/)
#undef GDN_VF_BINOP

// a * b + c. Not std::fma: on a baseline target without FMA hardware that is a slow library
// call; the compiler may still contract this where the target has FMA.
inline VF vfma(VF a, VF b, VF c) { VF r; for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i]; return r; }
inline VF vmax(VF a, VF b) { VF r; for (int i = 0; i < kLanes; ++i) r.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i]; return r; }
inline VF vexp(VF a) { VF r; for (int i = 0; i < kLanes; ++i) r.v[i] = std::exp(a.v[i]); return r; }
// Sum of lanes in a fixed pairwise order (the same on every back end).
inline float vsum(VF a) {
  float t[kLanes];
  for (int i = 0; i < kLanes; ++i) t[i] = a.v[i];
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

// x * sigmoid(x) = x / (1 + e^-x), the conv's SiLU.
inline VF vsilu(VF a) { return a / (vset1(1.f) + vexp(vzero() - a)); }
// SiLU for a bf16-rounded result: the portable back end keeps the full one (vec_avx2.h,
// vec_neon.h have a cheaper form).
inline VF vsilu_bf16(VF a) { return vsilu(a); }
