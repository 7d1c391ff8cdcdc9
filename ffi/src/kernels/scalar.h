// Scalar helpers shared by every back end. Included inside the ISA namespace (see
// isa/*.cc): no include guard, no system headers here.

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// Round to nearest even; NaN stays NaN (quiet).
inline bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16{uint16_t(u >> 16)};
}
// dst[c * 16 + l] = src[l * ld + c] for c, l < 16: a 16 x 16 block transposed (vtranspose16 of
// the back ends without a vector form).
inline void transpose16_scalar(const float* src, int64_t ld, float* dst) {
  for (int l = 0; l < 16; ++l)
    for (int c = 0; c < 16; ++c) dst[c * 16 + l] = src[l * ld + c];
}
inline void store1(float* p, float x) { *p = x; }
inline void store1(bf16* p, float x) { *p = to_bf16(x); }

// softplus with the threshold used by FLA and vLLM: x for x > 20, else log1p(exp(x)).
inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
inline float sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
inline float silu(float x) { return x / (1.f + std::exp(-x)); }
// The bf16-output SiLU of the vector back ends (vsilu_bf16: vec_avx2.h, vec_avx512.h,
// vec_neon.h): -log2(e), and 2^f on [-0.5, 0.5] as a degree-5 relative-minimax polynomial,
// highest degree first (7.5e-8; ffi/README.md, "bf16 outputs").
constexpr float kNegLog2e = -1.44269504088896341f;
constexpr float kExp2Poly5[6] = {1.327647129e-3f, 9.675540961e-3f, 5.550713092e-2f,
                                 2.402212024e-1f, 6.931469440e-1f, 1.000000119e+0f};

// Per-thread scratch of T, allocated on a thread's first call (grown if a later call needs
// more) and freed at thread exit: no allocation per call. 64-byte aligned. Tag keeps the
// buffers of different users apart. Callers read only what the same call wrote.
template <class T>
struct ThreadScratch {
  T* mem = nullptr;
  int64_t cap = 0;
  ~ThreadScratch() { delete[] mem; }
};

template <class T, int Tag>
inline T* thread_scratch(int64_t elems) {
  static thread_local ThreadScratch<T> s;
  if (elems > s.cap) {
    delete[] s.mem;
    s.mem = nullptr;
    s.cap = 0;
    s.mem = new T[size_t(elems) + 64 / sizeof(T)];
    s.cap = elems;
  }
  uintptr_t u = reinterpret_cast<uintptr_t>(s.mem);
  u = (u + 63) & ~uintptr_t(63);
  return reinterpret_cast<T*>(u);
}
