// ISA-neutral pieces of the split-bf16 micro-GEMMs (kernels/amx_gemm.h on AMX tiles,
// kernels/neon_bf16_gemm.h on Armv8.6 BFMMLA), included by each of them inside the ISA
// namespace (no include guard, no system headers; only one of the two GEMMs per TU).
//
// The GEMMs multiply bf16 but their operands are f32, so each operand is split into bf16
// parts, x = x0 + x1 (+ x2) + r with x0 = bf16(x), x1 = bf16(x - x0), x2 = bf16(x - x0 - x1)
// (each rounded to nearest even; x - x0 is exact in f32; |r| <= 2^-16 |x| with two parts,
// 2^-24 |x| with three), and the product is formed from the part products that matter, with
// f32 accumulation:
//   bf16 activations: 2 parts, A0 B0 + A0 B1 + A1 B0 (3 products; what is dropped is
//                     <= ~3 * 2^-16 of each product);
//   f32 activations:  3 parts, the 6 products of total order <= 2 (f32-grade).
// A part that is zero for the whole operand (an operand already exact in bf16) is skipped by
// the GEMMs: the same values, fewer products. Measured errors: ffi/README.md (AMX-BF16, ARM
// NEON-BF16).

// Part products kept for a split into `Parts` bf16 parts: A part a[j] times B part b[j].
template <int Parts>
struct SplitPairs;
template <>
struct SplitPairs<1> {  // plain bf16 GEMM (operands rounded once): tests and measurements only
  static constexpr int n = 1;
  static constexpr int a[1] = {0}, b[1] = {0};
};
template <>
struct SplitPairs<2> {  // bf16 activations: x0 y0 + x0 y1 + x1 y0
  static constexpr int n = 3;
  static constexpr int a[3] = {0, 0, 1}, b[3] = {0, 1, 0};
};
template <>
struct SplitPairs<3> {  // f32 activations: 24 bits per operand, all products of total order <= 2
  static constexpr int n = 6;
  static constexpr int a[6] = {0, 0, 1, 0, 1, 2}, b[6] = {0, 1, 0, 2, 1, 0};
};

// The back ends' choice (see the README, AMX-BF16): bf16 activations -> 2 parts (the GEMM
// error ~5e-6 is far below the bf16 budget); f32 activations -> 3 parts (f32-grade, so the
// f32 budget keeps its margin over long sequences).
template <class TA>
constexpr int split_parts() { return std::is_same<TA, bf16>::value ? 2 : 3; }

// Per-thread packing buffer (see thread_scratch in scalar.h).
inline bf16* split_scratch(int64_t elems) { return thread_scratch<bf16, 1>(elems); }

// 16 floats -> Parts bf16 vectors at out[t] (x = out[0] + out[1] + ... + residual). x - x0
// is exact in f32 (the rounding error of a coarser format).
template <int Parts>
inline void split16(VF x, bf16* const* out) {
  for (int t = 0; t < Parts; ++t) {
    vstore(out[t], x);
    if (t + 1 < Parts) x = x - vload(out[t]);
  }
}

// Up to 16 floats from p (n of them; zero beyond n, all zero for n <= 0).
inline VF split_load_n(const float* p, int n) {
  if (n >= kLanes) return vload(p);
  if (n <= 0) return vzero();
  return vload_n(p, n);
}

// Part t is not exactly zero somewhere in [p, p + n): bf16 zeros and denormals, which both
// the AMX tile unit and BFMMLA treat as zero, do not count.
inline bool split_any_nonzero(const bf16* p, int64_t n) {
  uint32_t any = 0;
  for (int64_t i = 0; i < n; ++i) any |= p[i].bits & 0x7f80u;
  return any != 0;
}
