// Armv8.6 BFMMLA micro-GEMM with the contract of chunk.h's gemm_vf (included by chunk.h in
// the neon_bf16 translation unit, GDN_ARM_BF16, after gemm_vf). Same f32 inputs and outputs,
// same addressing, same triangular shapes:
//
//   Cout(i, c) = (crs ? crs[i] * Cin(i, c) : 0) + sum_p A(i, p) * B(p, c),  N % 16 == 0.
//
// BFMMLA (vbfmmlaq_f32(c, a, b)) adds to a 2 x 2 f32 block c = [c00 c01 c10 c11] the product
// of a 2 x 4 bf16 block a (row 0 depth 0..3, row 1 depth 0..3) and the 4 x 2 block whose
// columns are b's halves (column 0 depth 0..3, column 1 depth 0..3). The operands are f32, so
// each is split into bf16 parts and the part products that matter are summed (2 parts / 3
// products for bf16 activations, 3 parts / 6 for f32; parts zero for a whole operand are
// skipped): kernels/bf16_split.h, the same policy as the AMX GEMM. BFMMLA ignores FPCR: its
// sums are rounded to odd and denormal inputs and results are flushed (Armv8.6 without
// FEAT_EBF16); bf16 x bf16 products are exact in f32, so only the accumulation differs from
// an f32 FMA chain (~1 ulp per add instead of 1/2). Errors: ffi/README.md, ARM NEON-BF16.
//
// Blocking: a micro-tile is 8 rows x 8 columns: 4 row pairs x 4 column pairs = 16 accumulator
// q registers of 2 x 2; per 4-deep step and part pair it loads 4 A and 4 B registers for 16
// BFMMLA (24 of the 32 q registers live). A 6 x 16 tile (24 accumulators, 3 A + 8 B loads
// per 24 BFMMLA) was tried first: GCC 12 hoisted all 8 B loads and spilled 4 accumulators
// inside the depth loop. One call of the tile kernel computes a row tile's 8 x 16 block of
// one panel (two micro-tiles, the packed A re-read from L1).
//
// Packing (per-thread scratch, split_scratch: no allocation per call):
//   A once per call: row tile mt (rows 8 mt .. 8 mt + 7), part t, depth block d (4 deep) is 32
//     bf16 at ((mt * Parts + t) * nd + d) * 32: row pair rp at [rp * 8], its even row's 4
//     depths then its odd row's 4 depths (BFMMLA's a operand). Rows >= M and depth >= P are
//     zero. Rows contiguous in depth (csa = 1) are loaded 16 at a time; other strides (K^T
//     read from K) are gathered 16 at a time first.
//   B one 16-column panel at a time: part t, depth block d is 64 bf16 at (t * nd + d) * 64,
//     column c at [c * 4] with its 4 depths (column pair cp = BFMMLA's b operand at [cp * 8]),
//     i.e. a 4 x 16 -> 16 x 4 transposition, one ST4 per 8 columns. Depth >= P is zero.
// The accumulators go through an 8 x 16 staging block (rows interleaved back from
// the 2 x 2 blocks with ZIP1/ZIP2 on 64-bit lanes); the epilogue adds crs[i] * Cin and writes
// only rows < M and, for triangular columns, only panels with c0 <= i.

constexpr int kBfRows = 8;        // rows per micro-tile (4 BFMMLA row pairs)
constexpr int kBfAElems = 32;     // bf16 per (row tile, part, depth block): 4 row pairs x 8
constexpr int kBfBElems = 64;     // bf16 per (panel, part, depth block): 8 column pairs x 8

#include "kernels/bf16_split.h"  // SplitPairs, split16, split_scratch, split_parts

inline bfloat16x8_t bf_load8(const bf16* p) { return vreinterpretq_bf16_u16(vld1q_u16(reinterpret_cast<const uint16_t*>(p))); }

// Packed A: see above. nd = depth blocks of 4 (P padded with zeros).
template <int Parts>
inline void bf_pack_a(int M, int P, const float* A, int64_t rsa, int64_t csa, bf16* out, int mtiles, int nd) {
  const int nc = (nd + 3) / 4;  // depth chunks of 16
  for (int mt = 0; mt < mtiles; ++mt)
    for (int ch = 0; ch < nc; ++ch) {
      const int p0 = ch * 16;
      alignas(64) bf16 parts[kBfRows][Parts][16];
      for (int r = 0; r < kBfRows; ++r) {
        const int i = mt * kBfRows + r;
        VF x;
        if (i >= M) {
          x = vzero();
        } else if (csa == 1) {
          x = split_load_n(A + int64_t(i) * rsa + p0, P - p0);
        } else {  // e.g. A = K^T read from K (rsa = 1)
          alignas(64) float g[16];
          for (int j = 0; j < 16; ++j) g[j] = p0 + j < P ? A[int64_t(i) * rsa + int64_t(p0 + j) * csa] : 0.f;
          x = vload(g);
        }
        bf16* dst[Parts];
        for (int t = 0; t < Parts; ++t) dst[t] = parts[r][t];
        split16<Parts>(x, dst);
      }
      for (int t = 0; t < Parts; ++t)
        for (int j = 0; j < 4 && ch * 4 + j < nd; ++j) {
          bf16* o = out + ((int64_t(mt) * Parts + t) * nd + ch * 4 + j) * kBfAElems;
          for (int rp = 0; rp < kBfRows / 2; ++rp) {
            std::memcpy(o + rp * 8, &parts[2 * rp][t][4 * j], 8);
            std::memcpy(o + rp * 8 + 4, &parts[2 * rp + 1][t][4 * j], 8);
          }
        }
    }
}

// Packed B for the 16-column panel at `panel` (row stride ld): see above.
template <int Parts>
inline void bf_pack_b(int P, const float* panel, int64_t ld, bf16* out, int nd) {
  for (int d = 0; d < nd; ++d) {
    alignas(64) bf16 e[Parts][4][16];
    for (int k = 0; k < 4; ++k) {
      const int p = 4 * d + k;
      const VF x = p < P ? vload(panel + int64_t(p) * ld) : vzero();
      bf16* dst[Parts];
      for (int t = 0; t < Parts; ++t) dst[t] = e[t][k];
      split16<Parts>(x, dst);
    }
    for (int t = 0; t < Parts; ++t) {
      uint16_t* o = reinterpret_cast<uint16_t*>(out + (int64_t(t) * nd + d) * kBfBElems);
      for (int h = 0; h < 2; ++h) {  // columns 8h .. 8h + 7: o[c * 4 + k] = e[t][k][c]
        uint16x8x4_t v;
        for (int k = 0; k < 4; ++k) v.val[k] = vld1q_u16(reinterpret_cast<const uint16_t*>(&e[t][k][8 * h]));
        vst4q_u16(o + 32 * h, v);
      }
    }
  }
}

// One 8 x 16 block: stage = sum over the np part pairs j of (A part at a + aoff[j]) x (B part
// at b + boff[j]) over depth blocks [0, nd), as two 8 x 8 micro-tiles (column pairs 0..3, then
// 4..7). The leading pair (x0 y0) and the low-order pairs (j >= 1) are accumulated in two
// passes and added at the end: one accumulator for all pairs would round the full-size sum
// once more per low-order product, with BFMMLA's round-to-odd (measured: 3-part GEMM error
// 4-8e-7 that way, 0.3-1e-7 with the split). Not inlined, so that the accumulators
// stay in registers (as chunk.h's gemm_tile).
__attribute__((noinline)) inline void bf_tile(int nd, int np, const bf16* a, const int64_t* aoff, const bf16* b,
                                              const int64_t* boff, float* stage) {
  for (int h = 0; h < 2; ++h)
    for (int pass = 0; pass < 2; ++pass) {
      const int j0 = pass, j1 = pass == 0 ? 1 : np;
      if (j1 <= j0) break;  // a single pair: nothing of low order
      float32x4_t acc[4][4];
      for (int rp = 0; rp < 4; ++rp)
        for (int cp = 0; cp < 4; ++cp) acc[rp][cp] = vdupq_n_f32(0.f);
      for (int j = j0; j < j1; ++j) {
        const bf16* ap = a + aoff[j];
        const bf16* bp = b + boff[j] + 32 * h;
        for (int d = 0; d < nd; ++d, ap += kBfAElems, bp += kBfBElems) {
          bfloat16x8_t av[4], bv[4];
          for (int rp = 0; rp < 4; ++rp) av[rp] = bf_load8(ap + rp * 8);
          for (int cp = 0; cp < 4; ++cp) bv[cp] = bf_load8(bp + cp * 8);
          for (int rp = 0; rp < 4; ++rp)
            for (int cp = 0; cp < 4; ++cp) acc[rp][cp] = vbfmmlaq_f32(acc[rp][cp], av[rp], bv[cp]);
        }
      }
      // acc[rp][cp] = [C(2rp, 2cp) C(2rp, 2cp+1) C(2rp+1, 2cp) C(2rp+1, 2cp+1)] (cp within the
      // half): the 64-bit lanes of two neighbouring column pairs zip into 4 columns of each row.
      for (int rp = 0; rp < 4; ++rp)
        for (int q = 0; q < 2; ++q) {
          const float64x2_t x = vreinterpretq_f64_f32(acc[rp][2 * q]), y = vreinterpretq_f64_f32(acc[rp][2 * q + 1]);
          float* r0 = stage + (2 * rp) * 16 + 8 * h + 4 * q;
          float* r1 = r0 + 16;
          float32x4_t v0 = vreinterpretq_f32_f64(vzip1q_f64(x, y)), v1 = vreinterpretq_f32_f64(vzip2q_f64(x, y));
          if (pass == 1) {
            v0 = vaddq_f32(vld1q_f32(r0), v0);
            v1 = vaddq_f32(vld1q_f32(r1), v1);
          }
          vst1q_f32(r0, v0);
          vst1q_f32(r1, v1);
        }
    }
}

template <int Parts, class TO>
inline void gemm_bfmmla(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, Mat<const float> B,
                        Mat<const float> Cin, const float* crs, Mat<TO> Cout, GemmShape shape) {
  if (M <= 0 || N <= 0) return;
  const int nd = P > 0 ? (P + 3) / 4 : 0;           // depth blocks of 4
  const int mtiles = (M + kBfRows - 1) / kBfRows;  // row tiles of 8
  const int64_t a_tile = int64_t(Parts) * nd * kBfAElems;  // one row tile, all parts
  const int64_t a_elems = mtiles * a_tile, b_elems = int64_t(Parts) * nd * kBfBElems;
  bf16* const apack = split_scratch(a_elems + b_elems);
  bf16* const bpack = apack + a_elems;

  bf_pack_a<Parts>(M, P, A, rsa, csa, apack, mtiles, nd);
  bool a_has[Parts];
  a_has[0] = true;
  for (int t = 1; t < Parts; ++t) {
    a_has[t] = false;
    for (int mt = 0; mt < mtiles && !a_has[t]; ++mt)
      a_has[t] = split_any_nonzero(apack + mt * a_tile + int64_t(t) * nd * kBfAElems, int64_t(nd) * kBfAElems);
  }

  using Pairs = SplitPairs<Parts>;
  alignas(64) float stage[kBfRows * 16];
  for (int c0 = 0; c0 < N; c0 += kLanes) {
    const int64_t cb = c0 / kLanes;
    bf_pack_b<Parts>(P, B.p + cb * B.bs, B.ld, bpack, nd);
    bool b_has[Parts];
    b_has[0] = true;
    for (int t = 1; t < Parts; ++t) b_has[t] = split_any_nonzero(bpack + int64_t(t) * nd * kBfBElems, int64_t(nd) * kBfBElems);
    int64_t aoff[Pairs::n], boff[Pairs::n];
    int np = 0;
    for (int j = 0; j < Pairs::n; ++j) {
      if (!a_has[Pairs::a[j]] || !b_has[Pairs::b[j]]) continue;
      aoff[np] = int64_t(Pairs::a[j]) * nd * kBfAElems;
      boff[np] = int64_t(Pairs::b[j]) * nd * kBfBElems;
      ++np;
    }
    for (int mt = 0; mt < mtiles; ++mt) {
      const int i0 = mt * kBfRows;
      const int mr = M - i0 < kBfRows ? M - i0 : kBfRows;
      if (shape == kGemmTriCols && c0 > i0 + mr - 1) continue;  // every row of the tile is left of c0
      int pd = P;
      if (shape == kGemmTriDepth && i0 + mr < pd) pd = i0 + mr;  // A(i, p) = 0 for p > i
      bf_tile(pd > 0 ? (pd + 3) / 4 : 0, np, apack + mt * a_tile, aoff, bpack, boff, stage);
      for (int r = 0; r < mr; ++r) {
        const int i = i0 + r;
        if (shape == kGemmTriCols && c0 > i) continue;
        VF acc = vload(stage + r * 16);
        if (crs != nullptr) acc = vfma(vset1(crs[i]), vload(Cin.p + cb * Cin.bs + int64_t(i) * Cin.ld), acc);
        vstore(Cout.p + cb * Cout.bs + int64_t(i) * Cout.ld, acc);
      }
    }
  }
}

// The precision follows the activation dtype TA (split_parts, kernels/bf16_split.h).
template <class TO, class TA = float>
inline void gemm(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, Mat<const float> B,
                 Mat<const float> Cin, const float* crs, Mat<TO> Cout, GemmShape shape) {
  gemm_bfmmla<split_parts<TA>(), TO>(M, N, P, A, rsa, csa, B, Cin, crs, Cout, shape);
}
