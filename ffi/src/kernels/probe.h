// Probes: the peak-throughput loops of the benchmarks' roofline, and the vector bf16 rounding
// and bf16-output SiLU for the core tests. Included inside the ISA namespace. Each peak probe
// returns the sum of its accumulators, so the work is not optimised away and a test can check
// that the loop ran as counted (the operands are chosen so that every sum is exact).

// n values through vstore / vstore_n of a VF to bf16: the rounding every kernel's bf16 output
// and state take (the core tests compare it bit for bit with round-to-nearest-even).
inline void round_bf16(const float* x, bf16* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vload(x + i));
  if (i < n) vstore_n(y + i, vload_n(x + i, int(n - i)), int(n - i));
}

// round_bf16 with full vectors in the pair order (f32 loaded into it, bf16 stored from it), then
// y widened back to w from that order into memory order: the conversions the recurrence uses
// for a bf16 state where the ISA has the order (kPairOrder), the plain ones elsewhere.
inline void round_bf16_pairs(const float* x, bf16* y, float* w, int64_t n) {
  constexpr int U = rec_unit<kPairOrder>();  // recurrent.h
  int64_t i = 0;
  for (; i + U * kLanes <= n; i += U * kLanes) {
    VF v[U];
    rec_ld<U, true, kPairOrder>(x + i, kLanes, v);
    rec_st<U, true, kPairOrder>(y + i, v, kLanes);
    rec_ld<U, true, kPairOrder>(y + i, kLanes, v);
    rec_st<U, true, kPairOrder>(w + i, v, kLanes);
  }
  if (i < n) {
    round_bf16(x + i, y + i, n - i);  // the tail: plain order in every kernel
    vstore_n(w + i, vload_n(y + i, int(n - i)), int(n - i));
  }
}

// n values through vsilu_bf16, the conv's SiLU for bf16 outputs (its accuracy is below what
// the bf16 rounding shows; the core tests check it here, before that rounding).
inline void silu_bf16_values(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(y + i, vsilu_bf16(vload(x + i)));
  if (i < n) vstore_n(y + i, vsilu_bf16(vload_n(x + i, int(n - i))), int(n - i));
}

// f32 FMA peak: kFmaProbeChains independent chains, one FMA of a VF each per iteration
// (kFmaProbeFlops flops), accumulators in registers: 12 machine registers of chains (covers
// 4-cycle latency x 2 pipes) plus the two operands fit every back end's register file
// (8 VF chains on AVX2 took 18 ymm, spilled two accumulators through the stack and measured
// ~57 GFLOP/s per thread against the ~68 the chunk's GEMM reaches). The operands 2^-10 * 2^-10
// are read through volatiles so that no compiler folds the product into an add; every
// accumulator gains exactly 2^-20 per iteration, so the result is iters * chains * 16 * 2^-20
// (exact while that total stays below 16).
constexpr int kFmaProbeChains = 12 / kVfRegs;
constexpr int64_t kFmaProbeFlops = int64_t(kFmaProbeChains) * kLanes * 2;
inline volatile float g_fma_probe_operand = 0x1p-10f;
inline float fma_probe(int64_t iters) {
  VF acc[kFmaProbeChains];
  for (int j = 0; j < kFmaProbeChains; ++j) acc[j] = vzero();
  const VF x = vset1(g_fma_probe_operand), y = vset1(g_fma_probe_operand);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kFmaProbeChains; ++j) acc[j] = vfma(x, y, acc[j]);
  VF s = acc[0];
  for (int j = 1; j < kFmaProbeChains; ++j) s = s + acc[j];
  return vsum(s);
}

// The spec verify's state traffic, for the bandwidth probe (handlers/probe.cc, mode 3): a piece
// of n floats (a multiple of 2 kLanes) read and written back in place (x * 0.5 + 0.5: a row's
// start slot, which one of its tokens' states lands in) and the result written to the
// kSpecProbeGroup - 1 pieces after it with the stores the kernel gives the states of the row's
// other tokens (vstream: non-temporal where the ISA has them; all pieces 64-byte aligned).
// Returns the piece's first value (the probe's checksum).
inline float spec_probe_piece(float* dst, int64_t n) {
  const VF h = vset1(0.5f);
  for (int64_t i = 0; i < n; i += 2 * kLanes) {
    const VF x0 = vfma(vload(dst + i), h, h), x1 = vfma(vload(dst + i + kLanes), h, h);
    vstore(dst + i, x0);
    vstore(dst + i + kLanes, x1);
    for (int64_t c = 1; c < kSpecProbeGroup; ++c) {
      vstream(dst + c * n + i, x0);
      vstream(dst + c * n + i + kLanes, x1);
    }
  }
  vstream_fence();
  return dst[0];
}

// bf16 dot products, on the ISAs that have an instruction for them: bf16 pairs a = 1 and
// b = 2^-20 into zeroed f32 accumulators, so after `iters` iterations the result is exactly
// iters * kBf16ProbeMacs * 2^-20 (while that stays below 2^4: iters * macs <= 2^24).
constexpr uint16_t kBf16ProbeOne = 0x3f80;   // 1.0
constexpr uint16_t kBf16ProbeTiny = 0x3580;  // 2^-20

#if defined(GDN_AMX)
// AMX (real tiles, or the software model in amx_model): 4 accumulator tiles of 16 x 16 f32
// against A tiles 4-5 and B tiles 6-7 held in the tile registers (no loads in the loop), the
// GEMM's own blocking: 4 tdpbf16ps of 16 x 16 x 32 per iteration.
#define GDN_BF16_DOT_PROBE 1
constexpr int64_t kBf16ProbeMacs = 4 * 16 * 16 * 32;
inline float bf16_dot_probe(int64_t iters) {
  alignas(64) uint16_t a[16 * 32], b[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) {
    a[i] = kBf16ProbeOne;
    b[i] = kBf16ProbeTiny;
  }
  const AmxTileConfig cfg = amx_config(kTiles, kTileRows, kTileColsB);
  tile_loadconfig(&cfg);
  tile_zero<0>();
  tile_zero<1>();
  tile_zero<2>();
  tile_zero<3>();
  tile_load<4>(a, 64);
  tile_load<5>(a, 64);
  tile_load<6>(b, 64);
  tile_load<7>(b, 64);
  for (int64_t i = 0; i < iters; ++i) {
    tile_dpbf16ps<0, 4, 6>();
    tile_dpbf16ps<1, 4, 7>();
    tile_dpbf16ps<2, 5, 6>();
    tile_dpbf16ps<3, 5, 7>();
  }
  alignas(64) float c[4][16 * 16];
  tile_store<0>(c[0], 64);
  tile_store<1>(c[1], 64);
  tile_store<2>(c[2], 64);
  tile_store<3>(c[3], 64);
  tile_release();
  float s = 0.f;
  for (int t = 0; t < 4; ++t)
    for (int i = 0; i < 16 * 16; ++i) s += c[t][i];
  return s;
}
#elif defined(__AVX512BF16__)
// AVX512-BF16: kBf16ProbeChains independent chains of vdpbf16ps, each 16 lanes x 2 products.
// Two per cycle at a latency of ~6 (Zen 4) needs 12; Zen 5 needs 16: one thread in a stand-alone
// loop reached 529 GFLOP/s with 12 chains, 575 with 16 (the same from 16 on while the chains stay
// in registers), and the packed projection ran above the 12-chain probe (ffi/README.md, Limits).
#define GDN_BF16_DOT_PROBE 1
constexpr int kBf16ProbeChains = 16;
constexpr int64_t kBf16ProbeMacs = kBf16ProbeChains * 16 * 2;
inline float bf16_dot_probe(int64_t iters) {
  __m512 acc[kBf16ProbeChains];
  for (int j = 0; j < kBf16ProbeChains; ++j) acc[j] = _mm512_setzero_ps();
  const __m512bh a = (__m512bh)_mm512_set1_epi16(short(kBf16ProbeOne));
  const __m512bh b = (__m512bh)_mm512_set1_epi16(short(kBf16ProbeTiny));
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < kBf16ProbeChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  __m512 s = acc[0];
  for (int j = 1; j < kBf16ProbeChains; ++j) s = _mm512_add_ps(s, acc[j]);
  return _mm512_reduce_add_ps(s);
}
#elif defined(GDN_ARM_BF16)
// NEON BF16: 8 independent chains of BFMMLA, each a 2 x 4 by 4 x 2 product (16 MACs).
#define GDN_BF16_DOT_PROBE 1
constexpr int64_t kBf16ProbeMacs = 8 * 16;
inline float bf16_dot_probe(int64_t iters) {
  float32x4_t acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = vdupq_n_f32(0.f);
  // Through a register: GCC would otherwise materialise the constants with an FP16 `fmov`,
  // which needs FEAT_FP16 (not implied by +bf16).
  uint16_t one = kBf16ProbeOne, tiny = kBf16ProbeTiny;
  __asm__("" : "+r"(one), "+r"(tiny));
  const bfloat16x8_t a = vreinterpretq_bf16_u16(vdupq_n_u16(one));
  const bfloat16x8_t b = vreinterpretq_bf16_u16(vdupq_n_u16(tiny));
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < 8; ++j) acc[j] = vbfmmlaq_f32(acc[j], a, b);
  float32x4_t s = acc[0];
  for (int j = 1; j < 8; ++j) s = vaddq_f32(s, acc[j]);
  return vaddvq_f32(s);
}
#endif
