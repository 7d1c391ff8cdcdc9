// AMX-BF16 micro-GEMM with the contract of chunk.h's gemm_vf (included by chunk.h in the
// AMX translation units, after gemm_vf; amx_tiles.h is included before). Same f32 inputs
// and outputs, same addressing, same triangular shapes:
//
//   Cout(i, c) = (crs ? crs[i] * Cin(i, c) : 0) + sum_p A(i, p) * B(p, c),  N % 16 == 0.
//
// Tiles hold bf16, so each f32 operand is split into bf16 parts and the part products that
// matter are summed with f32 accumulation in the tiles (kernels/bf16_split.h: 2 parts / 3
// products for bf16 activations, measured ~4.5e-6 rel RMSE per GEMM; 3 parts / 6 products for
// f32 activations, ~1e-7; parts that are zero for a whole operand are skipped). Design notes
// and errors: ffi/README.md, AMX-BF16.
//
// Blocking: 2 x 2 tiles of C (32 x 32 f32) in tmm0..3, two A tiles (tmm4, 5: 16 rows x 32
// bf16 of depth) and two B tiles (tmm6, 7: 16 VNNI rows of 16 column pairs); every tile is
// configured 16 rows x 64 bytes once per call. A is packed into 1 KiB tiles (row tile, depth
// block of 32, part), once per call or once for several calls (GemmA, gemm_prepared: one B
// block packed for up to two A); B one 32-column block at a time (VNNI: tile row k
// holds B(2k, c) and B(2k+1, c) side by side for the 16 columns c). Tails are zero-padded
// in the packed copies (rows past M, depth past P, a missing second column tile); C tiles
// are stored in place when f32 without a C term and whole in M, else through a 32 x 32
// staging block, so only rows < M and columns < N are written.

#include "kernels/bf16_split.h"  // SplitPairs, split16, split_scratch, split_parts

constexpr int kAmxTileElems = 512;  // bf16 per 16 x 64-byte tile

// Tile (row tile mt, depth block d, part t) of packed A: A(mt * 16 + r, d * 32 + j) at
// [r * 32 + j]. Rows >= M and depth >= P are zero. Only parts t < Stored are written (an
// operand exact in bf16 has one).
template <int Parts, int Stored = Parts>
inline void amx_pack_a(int M, int P, const float* A, int64_t rsa, int64_t csa, bf16* out, int mtiles, int nd) {
  for (int mt = 0; mt < mtiles; ++mt)
    for (int d = 0; d < nd; ++d) {
      const int p0 = d * 32;
      // csa != 1: the 16 x 32 block gathered first, as two 16 x 16 halves (row r of half h at
      // blk[h][16 r]). With rsa = 1 (the state update's K^T read from K) a whole half is a
      // vector transpose; element by element it was ~40% of that GEMM's time.
      alignas(64) float blk[2][16 * 16];
      if (csa != 1) {
        for (int h = 0; h < 2; ++h) {
          const int q0 = p0 + 16 * h;
          if (rsa == 1 && mt * 16 + 16 <= M && q0 + 16 <= P) {
            vtranspose16(A + int64_t(mt * 16) + int64_t(q0) * csa, csa, blk[h]);
            continue;
          }
          for (int r = 0; r < 16; ++r)
            for (int j = 0; j < 16; ++j) {
              const int i = mt * 16 + r, p = q0 + j;
              blk[h][r * 16 + j] = (i < M && p < P) ? A[int64_t(i) * rsa + int64_t(p) * csa] : 0.f;
            }
        }
      }
      for (int r = 0; r < 16; ++r) {
        const int i = mt * 16 + r;
        for (int h = 0; h < 2; ++h) {
          VF x;
          if (csa != 1) x = vload(&blk[h][r * 16]);
          else x = i < M ? split_load_n(A + int64_t(i) * rsa + p0 + h * 16, P - p0 - h * 16) : vzero();
          bf16* dst[Stored];
          for (int t = 0; t < Stored; ++t)
            dst[t] = out + (int64_t(mt * nd + d) * Parts + t) * kAmxTileElems + r * 32 + h * 16;
          split16<Stored>(x, dst);
        }
      }
    }
}

// One 16-column tile of B (the panel at `panel`, row stride ld) in VNNI form: tile (d, t) at
// out + (d * Parts + t) * 512, row k = [B(d*32+2k, c), B(d*32+2k+1, c)] for c = 0..15, i.e.
// the 32-bit word c of row k holds depth 2k in its low half and 2k + 1 in its high half.
// Depth >= P, or a column tile past N (present == false), is zero. A row is vstore_pairs of
// the two depth rows (on AVX-512 one two-source conversion and one word permute; narrowing
// each row and interleaving words after was ~10% of the AMX chunk), and the next part's
// residual is taken from the row just stored (the same bits as split16 on each depth row).
template <int Parts>
inline void amx_pack_b(int P, const float* panel, int64_t ld, bool present, bf16* out, int nd) {
  for (int d = 0; d < nd; ++d)
    for (int k = 0; k < 16; ++k) {
      const int p0 = d * 32 + 2 * k;
      VF x[2] = {present && p0 < P ? vload(panel + int64_t(p0) * ld) : vzero(),
                 present && p0 + 1 < P ? vload(panel + int64_t(p0 + 1) * ld) : vzero()};
      for (int t = 0; t < Parts; ++t) {
        bf16* row = out + (int64_t(d) * Parts + t) * kAmxTileElems + k * 32;
        vstore_pairs(row, x);
        if (t + 1 < Parts) {
          VF e, o;
          vload_pair_split(row, &e, &o);
          x[0] = x[0] - e;
          x[1] = x[1] - o;
        }
      }
    }
}

// C tiles 0..3 (+)= A tiles 4, 5 x B tiles 6, 7 over depth blocks [0, nd), for the part
// pairs whose parts are present.
template <int Parts>
inline void amx_tile_block(const bf16* a0, const bf16* a1, const bf16* b0, const bf16* b1, int nd,
                           const bool* a_has, const bool* b_has) {
  using Pairs = SplitPairs<Parts>;
  for (int d = 0; d < nd; ++d) {
    int la = -1, lb = -1;  // parts now in the A and B tiles
    for (int j = 0; j < Pairs::n; ++j) {
      const int pa = Pairs::a[j], pb = Pairs::b[j];
      if (!a_has[pa] || !b_has[pb]) continue;
      const int64_t oa = (int64_t(d) * Parts + pa) * kAmxTileElems, ob = (int64_t(d) * Parts + pb) * kAmxTileElems;
      if (pa != la) {
        tile_load<4>(a0 + oa, 64);
        tile_load<5>(a1 + oa, 64);
        la = pa;
      }
      if (pb != lb) {
        tile_load<6>(b0 + ob, 64);
        tile_load<7>(b1 + ob, 64);
        lb = pb;
      }
      tile_dpbf16ps<0, 4, 6>();
      tile_dpbf16ps<1, 4, 7>();
      tile_dpbf16ps<2, 5, 6>();
      tile_dpbf16ps<3, 5, 7>();
    }
  }
}

// An A operand split and packed once (amx_pack_a's tiles at `packed`, room for up to 3 parts)
// for several products: chunk.h prepares q^, k^ and k^T once per chunk and key head (GemmA).
struct GemmA {
  int M, P;
  const bf16* packed;
  int mtiles, nd;
  bool has[3];  // parts present (a part zero over the whole operand is skipped)
};

// bf16 elements a prepared M x P operand needs (any activation dtype: 3 parts).
constexpr int64_t gemm_a_elems(int64_t M, int64_t P) {
  return (M + 31) / 32 * 2 * ((P + 31) / 32) * 3 * kAmxTileElems;
}

// kExact: the caller knows A is exact in bf16 (its low parts zero): only part 0 is packed.
template <int Parts, bool kExact = false>
inline GemmA amx_prepare_a(int M, int P, const float* A, int64_t rsa, int64_t csa, bf16* out) {
  GemmA a{M, P, out, (M + 31) / 32 * 2, P > 0 ? (P + 31) / 32 : 0, {true, false, false}};
  amx_pack_a<Parts, kExact ? 1 : Parts>(M, P, A, rsa, csa, out, a.mtiles, a.nd);
  for (int t = 1; t < Parts && !kExact; ++t)
    for (int mt = 0; mt < a.mtiles && !a.has[t]; ++mt)
      for (int d = 0; d < a.nd && !a.has[t]; ++d)
        a.has[t] = split_any_nonzero(out + (int64_t(mt * a.nd + d) * Parts + t) * kAmxTileElems, kAmxTileElems);
  return a;
}

// Cout[j] = (crs ? crs[i] * Cin : 0) + A[j] B for the na prepared operands A[j] (same depth P),
// each 32-column block of B split and packed once for all of them (at bpack: 2 * nd * Parts
// tiles).
template <int Parts, class TO>
inline void gemm_amx_run(const GemmA* As, const Mat<TO>* Couts, int na, int N, Mat<const float> B,
                         Mat<const float> Cin, const float* crs, GemmShape shape, bf16* bpack) {
  if (N <= 0) return;
  const int P = As[0].P, nd = As[0].nd;
  const AmxTileConfig cfg = amx_config(kTiles, kTileRows, kTileColsB);
  tile_loadconfig(&cfg);
  alignas(64) float stage[32 * 32];
  for (int c0 = 0; c0 < N; c0 += 32) {
    const int64_t cb = c0 / kLanes;  // first 16-column block
    const bool has1 = c0 + 16 < N;
    amx_pack_b<Parts>(P, B.p + cb * B.bs, B.ld, true, bpack, nd);
    amx_pack_b<Parts>(P, has1 ? B.p + (cb + 1) * B.bs : B.p, B.ld, has1, bpack + int64_t(nd) * Parts * kAmxTileElems, nd);
    bool b_has[Parts];
    b_has[0] = true;
    for (int t = 1; t < Parts; ++t) {
      b_has[t] = false;
      for (int ct = 0; ct < 2 && !b_has[t]; ++ct)
        for (int d = 0; d < nd && !b_has[t]; ++d)
          b_has[t] = split_any_nonzero(bpack + ((int64_t(ct) * nd + d) * Parts + t) * kAmxTileElems, kAmxTileElems);
    }
    for (int j = 0; j < na; ++j) {
      const GemmA& a = As[j];
      const Mat<TO>& Cout = Couts[j];
      for (int i0 = 0; i0 < a.M; i0 += 32) {
        if (shape == kGemmTriCols && c0 > i0) continue;  // every row i < i0 + 32 <= c0: not needed
        int np = P;
        if (shape == kGemmTriDepth && i0 + 32 < np) np = i0 + 32;
        const int ndi = np > 0 ? (np + 31) / 32 : 0;
        const int mt = i0 / 16;
        tile_zero<0>();
        tile_zero<1>();
        tile_zero<2>();
        tile_zero<3>();
        amx_tile_block<Parts>(a.packed + int64_t(mt) * nd * Parts * kAmxTileElems,
                              a.packed + int64_t(mt + 1) * nd * Parts * kAmxTileElems, bpack,
                              bpack + int64_t(nd) * Parts * kAmxTileElems, ndi, a.has, b_has);
        // C goes through the staging block where it needs a conversion, the C term or row
        // clipping; an f32 result without them is stored from the tiles in place.
        if constexpr (std::is_same<TO, float>::value) {
          if (crs == nullptr && i0 + 32 <= a.M) {
            float* const c00 = Cout.p + cb * Cout.bs + int64_t(i0) * Cout.ld;
            float* const c10 = c00 + 16 * Cout.ld;
            const int64_t stride = Cout.ld * int64_t(sizeof(float));
            tile_store<0>(c00, stride);
            if (has1 && !(shape == kGemmTriCols && c0 + 16 > i0)) tile_store<1>(c00 + Cout.bs, stride);
            tile_store<2>(c10, stride);
            if (has1) tile_store<3>(c10 + Cout.bs, stride);
            continue;
          }
        }
        tile_store<0>(stage, 32 * 4);
        tile_store<1>(stage + 16, 32 * 4);
        tile_store<2>(stage + 16 * 32, 32 * 4);
        tile_store<3>(stage + 16 * 32 + 16, 32 * 4);
        for (int r = 0; r < 32 && i0 + r < a.M; ++r) {
          const int i = i0 + r;
          for (int ct = 0; ct < 2; ++ct) {
            const int c = c0 + 16 * ct;
            if (c >= N) continue;
            if (shape == kGemmTriCols && c > i0 + 16 * (r / 16)) continue;  // block right of the diagonal
            VF acc = vload(stage + r * 32 + 16 * ct);
            if (crs != nullptr) acc = vfma(vset1(crs[i]), vload(Cin.p + (cb + ct) * Cin.bs + int64_t(i) * Cin.ld), acc);
            vstore(Cout.p + (cb + ct) * Cout.bs + int64_t(i) * Cout.ld, acc);
          }
        }
      }
    }
  }
  tile_release();
}

template <int Parts>
inline bf16* amx_b_scratch(int P, int64_t a_elems, bf16** apack) {
  const int64_t b_elems = 2 * int64_t(P > 0 ? (P + 31) / 32 : 0) * Parts * kAmxTileElems;
  bf16* const s = split_scratch(a_elems + b_elems);
  if (apack != nullptr) *apack = s;
  return s + a_elems;
}

template <int Parts, class TO>
inline void gemm_amx(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, Mat<const float> B,
                     Mat<const float> Cin, const float* crs, Mat<TO> Cout, GemmShape shape) {
  if (M <= 0 || N <= 0) return;
  const int64_t a_elems = int64_t((M + 31) / 32 * 2) * (P > 0 ? (P + 31) / 32 : 0) * Parts * kAmxTileElems;
  bf16* apack = nullptr;
  bf16* const bpack = amx_b_scratch<Parts>(P, a_elems, &apack);
  const GemmA a = amx_prepare_a<Parts>(M, P, A, rsa, csa, apack);
  gemm_amx_run<Parts, TO>(&a, &Cout, 1, N, B, Cin, crs, shape, bpack);
}

// The precision follows the activation dtype TA (split_parts, kernels/bf16_split.h).
template <class TO, class TA = float>
inline void gemm(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, Mat<const float> B,
                 Mat<const float> Cin, const float* crs, Mat<TO> Cout, GemmShape shape) {
  gemm_amx<split_parts<TA>(), TO>(M, N, P, A, rsa, csa, B, Cin, crs, Cout, shape);
}

// chunk.h's products with prepared operands (see GemmA): the same values as gemm() on them.
template <class TA, bool kExact = false>
inline GemmA gemm_prepare_a(int M, int P, const float* A, int64_t rsa, int64_t csa, bf16* buf) {
  return amx_prepare_a<split_parts<TA>(), kExact>(M, P, A, rsa, csa, buf);
}
template <class TO, class TA>
inline void gemm_prepared(const GemmA* As, const Mat<TO>* Couts, int na, int N, Mat<const float> B,
                          Mat<const float> Cin, const float* crs, GemmShape shape) {
  if (na <= 0 || As[0].M <= 0 || N <= 0) return;
  constexpr int Parts = split_parts<TA>();
  gemm_amx_run<Parts, TO>(As, Couts, na, N, B, Cin, crs, shape, amx_b_scratch<Parts>(As[0].P, 0, nullptr));
}
