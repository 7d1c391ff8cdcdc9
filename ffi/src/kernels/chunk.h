// Chunked (WY, chunk 32 or 64) gated delta rule prefill over varlen sequences.
// Included inside the ISA namespace (no include guard, no system headers).
//
// Work item = (sequence, value head); the chunks of one item run in order because the
// state carries across them. Products and sums are f32 (but Q S0 and K S0 on bf16 pairs
// where bf16_state_products allows); the decay cumsum is kept in double so that
// exp(Gc_i - Gc_j) keeps its relative accuracy when the cumsums are large. Design notes and
// flop counts: ffi/README.md, "Chunked prefill".

// ---------------------------------------------------------------------------------------
// f32 micro-GEMM on VF
// ---------------------------------------------------------------------------------------
//
// Cout(i, c) = (crs ? crs[i] * Cin(i, c) : 0) + sum_p A(i, p) * B(p, c),  N % 16 == 0, depth
// P >= 1 (every product here has one: a chunk holds at least one token, K >= 16).
//
// A(i, p) = A[i * rsa + p * csa]: any strides, A is broadcast one element at a time.
// B, Cin, Cout are addressed per 16-column block: element (r, c) of a Mat lives at
// p[(c / 16) * bs + r * ld + c % 16]. A row-major matrix is {p, ld = N, bs = 16}; a
// "panel" matrix of R rows is {p, ld = 16, bs = 16 R}: each 16-column block is one
// contiguous R x 16 panel. B operands are kept as panels so that the depth loop reads
// consecutive cache lines (a row stride of 512 B puts a 128-row column block in 8 of the
// 64 L1 sets, which cannot hold it: ~20% slower at K = V = 128).
//
// Register tile: kGemmMR rows x kGemmNV vectors of accumulators; per depth step the tile
// loads kGemmNV vectors of B and broadcasts kGemmMR elements of A. Cin may alias Cout (a
// tile reads its C block before writing it); Cin is not read when crs is null.

#if defined(__AVX512F__)
constexpr int kGemmMR = 6, kGemmNV = 2;  // VF = one zmm: 12 accumulators of 32
#else
constexpr int kGemmMR = 6, kGemmNV = 1;  // AVX2: VF = two ymm, 12 accumulators of 16
#endif
static_assert(kGemmMR >= 1 && kGemmMR <= 6 && kGemmNV >= 1 && kGemmNV <= 2, "tile dispatch below");

template <class T>
struct Mat {
  T* p;
  int64_t ld, bs;  // row stride; stride between 16-column blocks
};
template <class T>
inline Mat<T> row_major(T* p, int64_t ld) { return {p, ld, kLanes}; }
template <class T>
inline Mat<T> panels(T* p, int64_t rows) { return {p, kLanes, kLanes * rows}; }

enum GemmShape {
  kGemmFull = 0,
  kGemmTriCols = 1,   // only columns j <= i are needed (column blocks right of the tile skipped)
  kGemmTriDepth = 2,  // A lower triangular incl. diagonal, zeros stored above: depth p <= i
};

// One product's operands, built once per gemm_vf call; its tiles read them by reference.
// Passing the three Mat by value to every tile made GCC copy each with a 16-byte load of two
// 8-byte stores just made (a store-forwarding stall per tile call: ~3% of the Zen 4 prefill).
template <class TO>
struct GemmOperands {
  const float* A;
  int64_t rsa, csa;
  Mat<const float> B, Cin;
  const float* crs;
  Mat<TO> Cout;
};

// A tile's accumulators at its start (crs[i] * Cin, or zero) and at its end (into Cout); shared
// by the f32 tile and the bf16-pair one, inlined into each.
template <int MR, int NV, bool kScaleC>
__attribute__((always_inline)) inline void gemm_acc_start(VF (&acc)[MR][NV], const Mat<const float>& Cin,
                                                          const float* crs, int i0, int64_t cb) {
  if constexpr (kScaleC) {
    const float* cin = Cin.p + cb * Cin.bs + i0 * Cin.ld;
    for (int r = 0; r < MR; ++r) {
      const VF s = vset1(crs[i0 + r]);
      for (int c = 0; c < NV; ++c) acc[r][c] = s * vload(cin + c * Cin.bs + r * Cin.ld);
    }
  } else {
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  }
}

template <int MR, int NV, class TO>
__attribute__((always_inline)) inline void gemm_acc_store(const VF (&acc)[MR][NV], const Mat<TO>& Cout, int i0,
                                                          int64_t cb) {
  // Strides in locals: read through the reference, GCC reloaded them after every store.
  const int64_t ld = Cout.ld, bs = Cout.bs;
  TO* out = Cout.p + cb * bs + i0 * ld;
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) vstore(out + c * bs + r * ld, acc[r][c]);
}

// Rows [i0, i0 + MR) x column blocks [cb, cb + NV) of Cout, depth np. Not inlined: inlined
// into a large caller, GCC stopped keeping the accumulator array in registers (spills inside
// the depth loop, half the speed). kScaleC (crs != null) is a template parameter, so that a
// tile has one straight-line start.
template <int MR, int NV, bool kScaleC, class TO>
__attribute__((noinline)) void gemm_tile(const GemmOperands<TO>& g, int i0, int64_t cb, int np) {
  // Without this GCC kept a copy of the accumulators on the stack for np = 0 (the loop not
  // run), storing and reloading all of them around every tile.
  if (np < 1) __builtin_unreachable();
  const float* A = g.A + i0 * g.rsa;
  const int64_t rsa = g.rsa, csa = g.csa;
  const float* B = g.B.p + cb * g.B.bs;
  const int64_t bld = g.B.ld, bbs = g.B.bs;
  VF acc[MR][NV];
  gemm_acc_start<MR, NV, kScaleC>(acc, g.Cin, g.crs, i0, cb);
  for (int p = 0; p < np; ++p) {
    VF b[NV];
    for (int c = 0; c < NV; ++c) b[c] = vload(B + c * bbs + p * bld);
    const float* a = A + p * csa;
    for (int r = 0; r < MR; ++r) {
      const VF av = vset1(a[r * rsa]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(av, b[c], acc[r][c]);
    }
  }
  gemm_acc_store<MR, NV>(acc, g.Cout, i0, cb);
}

#if defined(GDN_CHUNK_BF16_STATE)
#if !defined(GDN_BF16_DOT)
#error "GDN_CHUNK_BF16_STATE needs the bf16 dot product of the vector header (GDN_BF16_DOT)"
#endif
// Products with the state on bf16 pairs (bf16 activations on AVX512-BF16; chunk_head):
// Cout = (crs ? crs[i] * Cin : 0) + A B with A and B in bf16 (there: q or k as they came, S0
// rounded once), each pair's two products summed in f32 by VDPBF16PS (twice the f32 FMA's
// rate) and accumulated in f32.
// A(i, 2q) and A(i, 2q + 1) are the two bf16 at A + 2 (i rsa + q csa) (strides in pairs);
// B is kept as pair panels: depth rows 2q and 2q + 1 of 16-column block cb are the 32 bf16 at
// B + cb bbs + 32 q, interleaved (element 2j of row 2q, then of row 2q + 1: ps_pairs_to_bf16x32).
struct GemmPairOperands {
  const bf16* A;
  int64_t rsa, csa;
  const bf16* B;
  int64_t bbs;
  Mat<const float> Cin;
  const float* crs;
  Mat<float> Cout;
};

// gemm_tile's register tile over depth pairs (nq of them).
template <int MR, int NV, bool kScaleC>
__attribute__((noinline)) void gemm_tile(const GemmPairOperands& g, int i0, int64_t cb, int nq) {
  if (nq < 1) __builtin_unreachable();
  const bf16* A = g.A + 2 * i0 * g.rsa;
  const int64_t rsa2 = 2 * g.rsa, csa2 = 2 * g.csa;
  const bf16* B = g.B + cb * g.bbs;
  const int64_t bbs = g.bbs;
  VF acc[MR][NV];
  gemm_acc_start<MR, NV, kScaleC>(acc, g.Cin, g.crs, i0, cb);
  for (int q = 0; q < nq; ++q) {
    VB b[NV];
    for (int c = 0; c < NV; ++c) b[c] = vload_b(B + c * bbs + q * kDotElems);
    const bf16* a = A + q * csa2;
    for (int r = 0; r < MR; ++r) {
      const VB av = vbcast_b_pair(a + r * rsa2);
      for (int c = 0; c < NV; ++c) acc[r][c] = vdot_bf16(acc[r][c], av, b[c]);
    }
  }
  gemm_acc_store<MR, NV>(acc, g.Cout, i0, cb);
}
#endif

template <int NV, bool kScaleC, class G>
inline void gemm_tile_rows(int mr, const G& g, int i0, int64_t cb, int np) {
  switch (mr) {
    case 6: gemm_tile<6, NV, kScaleC>(g, i0, cb, np); break;
    case 5: gemm_tile<5, NV, kScaleC>(g, i0, cb, np); break;
    case 4: gemm_tile<4, NV, kScaleC>(g, i0, cb, np); break;
    case 3: gemm_tile<3, NV, kScaleC>(g, i0, cb, np); break;
    case 2: gemm_tile<2, NV, kScaleC>(g, i0, cb, np); break;
    default: gemm_tile<1, NV, kScaleC>(g, i0, cb, np); break;
  }
}

// M x N result, depth P. Column blocks outermost: the B column block (P x 16 NV floats)
// stays in L1 while the row tiles stream A. Tiles of kGemmMR rows, except that a remainder of
// 1-3 rows is merged with the last full tile and split in two (32 rows: 6 6 6 6 4 4, not
// 6 6 6 6 6 2): a 2-row tile keeps too few accumulator chains to fill the FMA pipes over their
// latency (ffi/README.md, Chunked prefill, "Tile heights").
template <bool kScaleC, class G>
inline void gemm_vf_blocks(int M, int N, int P, const G& g, GemmShape shape) {
  for (int c0 = 0; c0 < N; c0 += kGemmNV * kLanes) {
    const int nv = N - c0 >= kGemmNV * kLanes ? kGemmNV : (N - c0) / kLanes;
    const int64_t cb = c0 / kLanes;
    for (int i0 = 0, mr = 0; i0 < M; i0 += mr) {
      const int rest = M - i0;
      mr = rest < kGemmMR ? rest : kGemmMR;
      if (rest > kGemmMR && rest < kGemmMR + 4) mr = (rest + 1) / 2;  // 7-9 rows: 4+3, 4+4, 5+4
      if (shape == kGemmTriCols && i0 + mr - 1 < c0) continue;
      int np = P;
      if (shape == kGemmTriDepth && i0 + mr < np) np = i0 + mr;
      if (nv == 2) gemm_tile_rows<2 <= kGemmNV ? 2 : 1, kScaleC>(mr, g, i0, cb, np);
      else gemm_tile_rows<1, kScaleC>(mr, g, i0, cb, np);
    }
  }
}

template <class G>
inline void gemm_vf_run(int M, int N, int P, const G& g, GemmShape shape) {
  if (g.crs != nullptr) gemm_vf_blocks<true>(M, N, P, g, shape);
  else gemm_vf_blocks<false>(M, N, P, g, shape);
}

template <class TO>
inline void gemm_vf(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, Mat<const float> B,
                    Mat<const float> Cin, const float* crs, Mat<TO> Cout, GemmShape shape) {
  gemm_vf_run(M, N, P, GemmOperands<TO>{A, rsa, csa, B, Cin, crs, Cout}, shape);
}

// gemm(): the micro-GEMM every product below calls; TA is the call's activation dtype. The
// AMX translation units (GDN_AMX) provide it on tiles (kernels/amx_gemm.h) and the Armv8.6
// BF16 one (GDN_ARM_BF16) with BFMMLA (kernels/neon_bf16_gemm.h), both with the same contract
// and split-bf16 operands whose precision follows TA (kernels/bf16_split.h); the others use
// gemm_vf and ignore TA.
#if defined(GDN_AMX)
#include "kernels/amx_gemm.h"
#elif defined(GDN_ARM_BF16)
#include "kernels/neon_bf16_gemm.h"
#else
template <class TO, class TA = float>
inline void gemm(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, Mat<const float> B,
                 Mat<const float> Cin, const float* crs, Mat<TO> Cout, GemmShape shape) {
  gemm_vf<TO>(M, N, P, A, rsa, csa, B, Cin, crs, Cout, shape);
}
#endif

// Operands used by several products of a chunk (q^ and k^ in the raw scores and in Q S0, K S0;
// k^T in the state update), prepared once per chunk and key head: on AMX (amx_gemm.h) split
// and packed into tiles once, with each block of a B shared by two A packed once too (kExact:
// the operand is exact in bf16, one part packed); here the operand itself, and gemm_prepared is
// gemm() per operand, in order.
#if !defined(GDN_AMX)
struct GemmA {
  const float* A;
  int64_t rsa, csa;
  int M, P;
};
constexpr int64_t gemm_a_elems(int64_t, int64_t) { return 0; }
template <class TA, bool kExact = false>
inline GemmA gemm_prepare_a(int M, int P, const float* A, int64_t rsa, int64_t csa, bf16*) {
  return {A, rsa, csa, M, P};
}
template <class TO, class TA>
inline void gemm_prepared(const GemmA* As, const Mat<TO>* Couts, int na, int N, Mat<const float> B,
                          Mat<const float> Cin, const float* crs, GemmShape shape) {
  for (int j = 0; j < na; ++j)
    gemm<TO, TA>(As[j].M, N, As[j].P, As[j].A, As[j].rsa, As[j].csa, B, Cin, crs, Couts[j], shape);
}
#endif

// Whether Q S0 and K S0 may run on bf16 pairs (GemmPairOperands): with bf16 activations on a
// unit that sets GDN_CHUNK_BF16_STATE, in sequences of kPairsMinTokens or more. They are 59%
// of the chunk's flops at C = 32. S0's rounding adds ~1.6e-3 to outputs that come mostly from the
// state; a long sequence's error stays near its mean (2.2-2.3e-3 against the 3e-3 budget), a
// short one's spreads past the budget. The state update stays f32: on bf16 pairs it took the
// final state past its budget (ffi/README.md, "bf16 products with the state").
constexpr int64_t kPairsMinTokens = 129;
// The lowest gate the chunk's cumsum takes (chunk_head): e^-110 is 0 in f32, so a decay across
// a lower gate is 0 either way; the reference clamps the same (reference.GATE_FLOOR).
constexpr double kGateFloor = -110.0;
template <class TA>
constexpr bool bf16_state_products() {
#if defined(GDN_CHUNK_BF16_STATE)
  return std::is_same<TA, bf16>::value;
#else
  return false;
#endif
}

// Whether q and k enter the products as they came, their factors (q^ = rq q, k^ = rk k: the
// l2norm and the scale) applied to the products' rows and columns after: with bf16
// activations where gemm() splits f32 operands into bf16 parts (AMX, Armv8.6 BF16). Exact in
// one part, they drop the part products of their second (the GEMMs skip a part that is zero
// over an operand): the scores take one product instead of three, Q S0, K S0 and the state
// update two instead of three, and each loses the rounding of q^ and k^ to their parts.
template <class TA>
constexpr bool raw_qk_operands() {
#if defined(GDN_AMX) || defined(GDN_ARM_BF16)
  return std::is_same<TA, bf16>::value;
#else
  return false;
#endif
}

// ---------------------------------------------------------------------------------------
// chunked prefill
// ---------------------------------------------------------------------------------------

// Chunk size C: a template parameter (32 or 64), chosen per sequence in chunk_impl() below.

// Per-thread scratch (thread_scratch in scalar.h): no allocation per call. Every byte a
// work item reads from it was written by that work item first, so results do not depend on
// which thread ran it.
inline float* chunk_scratch(int64_t floats) { return thread_scratch<float, 0>(floats); }

// Layout of one thread's scratch (floats) for head dims K, V and a group of gsz value heads
// sharing one key head. "Panels" = 16-column blocks, each a contiguous rows x 16 block.
template <int C>
struct ChunkBufs {
  float* S;        // gsz x [K][V] as V/16 panels of K rows: the f32 working states
  float *Qc, *Kc;  // [C][K] row-major: q^ (scale folded in) and k^ of the chunk; q and k as
                   // they came where raw_qk_operands
  float* KcT;      // [K][C] as C/16 panels of K rows: Kc transposed, columns >= n zero
  float *SQ, *SK;  // [C][C] raw scores Q K^T, K K^T (shared by the group)
  float *P, *A;    // [C][C] lower_incl(Q K^T o Gamma), strict_lower(diag(beta) K K^T o Gamma)
  float* Tm;       // [C][C] (I + A)^-1
  float *XQ, *XK;  // [C][V] panels: Q S0 and K S0; XK becomes R = diag(beta)(V - diag(e^Gc) K S0)
  float* Vn;       // [C][V] panels: V_new = T R, then scaled by e^(G_last - Gc)
  float* eg;       // [C] e^Gc
  float* dg;       // [C] e^(G_last - Gc)
  float *gh, *gl;  // [C] the in-chunk cumsum Gc (double) as float hi + lo
  float* decay;    // [K] e^G_last repeated (row scale of the state update)
  // Q S0 and K S0 on bf16 pairs (bf16_state_products; else null): q and k as they came (exact
  // in bf16), their rows' scales (q^ = rq q, k^ = rk k) applied to the products' rows after.
  bf16 *Qb, *Kb;  // [C][K]: q, k (A: pairs along K)
  bf16* Sb;       // S0 of one head as pair panels (B)
  bool pairs;     // Q S0 and K S0 on bf16 pairs (Qb, Kb, Sb are set)
  // With pairs or raw_qk_operands (else null): q^ = rq q, k^ = rk k, applied to the products after.
  float *rq, *rk; // [C] the factors (rk zero past the chunk's tokens)
  float* egq;     // [C] e^Gc rq (row scale of X_Q in O)
  bf16 *Qp, *Kp, *KTp;  // q^, k^ and k^T prepared (GemmA; gemm_a_elems, null where 0)
  int64_t total;

  ChunkBufs(float* base, int64_t K, int64_t V, int64_t gsz, bool bf16_products, bool raw_qk) {
    int64_t off = 0;
    auto take = [&](int64_t n) {
      float* p = base == nullptr ? nullptr : base + off;
      off += (n + 15) / 16 * 16;
      return p;
    };
    S = take(gsz * K * V);
    Qc = take(C * K);
    Kc = take(C * K);
    KcT = take(K * C);
    SQ = take(C * C);
    SK = take(C * C);
    P = take(C * C);
    A = take(C * C);
    Tm = take(C * C);
    XQ = take(C * V);
    XK = take(C * V);
    Vn = take(C * V);
    eg = take(C);
    dg = take(C);
    gh = take(C);
    gl = take(C);
    decay = take(K);
    Qb = Kb = Sb = nullptr;
    rq = rk = egq = nullptr;
    pairs = bf16_products;
    if (bf16_products) {  // two bf16 per float
      Qb = reinterpret_cast<bf16*>(take(C * K / 2));
      Kb = reinterpret_cast<bf16*>(take(C * K / 2));
      Sb = reinterpret_cast<bf16*>(take(K * V / 2));
    }
    if (bf16_products || raw_qk) {
      rq = take(C);
      rk = take(C);
      egq = take(C);
    }
    Qp = Kp = KTp = nullptr;
    if (gemm_a_elems(C, K) > 0) {  // two bf16 per float
      Qp = reinterpret_cast<bf16*>(take(gemm_a_elems(C, K) / 2));
      Kp = reinterpret_cast<bf16*>(take(gemm_a_elems(C, K) / 2));
      KTp = reinterpret_cast<bf16*>(take(gemm_a_elems(K, C) / 2));
    }
    total = off;
  }
};

// Where a work item reads its q, k, v rows: row 0 of q and k at its key head, of v at its
// first value head, rows qk_ld / v_ld elements apart (value head h0 + j at v + j * V).
template <class TA>
struct ChunkRows {
  const TA *q, *k, *v;
  int64_t qk_ld, v_ld;
  ChunkRows at(int64_t t) const { return {q + t * qk_ld, k + t * qk_ld, v + t * v_ld, qk_ld, v_ld}; }
};

// Shared part of a chunk of n <= 64 tokens for key head kh, its rows at `rows`: q^, k^, k^T
// and the raw scores. Also prefetches the n_next rows at `next` (the next chunk's q, k, v, or
// the x rows its conv reads) and of o at o_next, for value heads [h0, h0 + gsz): rows 4-8 KiB
// apart, a stride the hardware prefetcher does not follow; they arrive while this chunk
// computes.
template <int C, class TA>
inline void chunk_prep(const ChunkArgs& p, const ChunkBufs<C>& b, ChunkRows<TA> rows, int n, ChunkRows<TA> next,
                       int n_next, const TA* o_next, int64_t gsz, GemmA* ga) {
  const int64_t HV = p.HV, K = p.K, V = p.V;
  const int Ki = int(K);
  const int npad = (n + kLanes - 1) / kLanes * kLanes;
  const int nfull = n / kLanes * kLanes;  // tokens in whole k^T panels

  for (int i = 0; i < n; ++i) {
    if (i < n_next) {
      const char* pq = reinterpret_cast<const char*>(next.q + i * next.qk_ld);
      const char* pk = reinterpret_cast<const char*>(next.k + i * next.qk_ld);
      for (int64_t c = 0; c < K * int64_t(sizeof(TA)); c += 64) {
        __builtin_prefetch(pq + c, 0, 2);
        __builtin_prefetch(pk + c, 0, 2);
      }
      const char* pv = reinterpret_cast<const char*>(next.v + i * next.v_ld);
      const char* po = reinterpret_cast<const char*>(o_next + i * HV * V);
      for (int64_t c = 0; c < gsz * V * int64_t(sizeof(TA)); c += 64) {
        __builtin_prefetch(pv + c, 0, 2);
        __builtin_prefetch(po + c, 1, 2);
      }
    }
    const TA* qr = rows.q + i * rows.qk_ld;
    const TA* kr = rows.k + i * rows.qk_ld;
    float rq = p.scale, rk = 1.f;
    if (p.l2norm) {
      VF sq = vzero(), sk = vzero();
      for (int c = 0; c < Ki; c += kLanes) {
        const VF x = vload(qr + c), y = vload(kr + c);
        sq = vfma(x, x, sq);
        sk = vfma(y, y, sk);
      }
      rq = p.scale / std::sqrt(vsum(sq) + p.eps);
      rk = 1.f / std::sqrt(vsum(sk) + p.eps);
    }
    float* qc = b.Qc + i * K;
    float* kc = b.Kc + i * K;
    for (int c = 0; c < Ki; c += kLanes) {
      if (raw_qk_operands<TA>()) {
        vstore(qc + c, vload(qr + c));
        vstore(kc + c, vload(kr + c));
      } else {
        vstore(qc + c, vload(qr + c) * vset1(rq));
        vstore(kc + c, vload(kr + c) * vset1(rk));
      }
    }
    if (bf16_state_products<TA>() && b.pairs) {
      std::memcpy(b.Qb + i * K, qr, size_t(K) * sizeof(TA));
      std::memcpy(b.Kb + i * K, kr, size_t(K) * sizeof(TA));
    }
    if (b.rq != nullptr) {
      b.rq[i] = rq;
      b.rk[i] = rk;
    }
    if (i < nfull) continue;  // whole panels: transposed in 16 x 16 blocks below
    float* kt = b.KcT + (i / kLanes) * K * kLanes + i % kLanes;  // panel i / 16, lane i % 16
    for (int c = 0; c < Ki; ++c) kt[c * kLanes] = kc[c];
  }
  if (b.rk != nullptr)
    for (int i = n; i < npad; ++i) b.rk[i] = 0.f;  // the scores' column factors past the tokens
  // k^T of whole panels in blocks (one scalar store per element and token cost ~1% of the
  // prefill step on Zen 5: ffi/README.md, "The prefill step on Zen 5").
  for (int p0 = 0; p0 < nfull; p0 += kLanes)
    for (int c = 0; c < Ki; c += kLanes) vtranspose16(b.Kc + p0 * K + c, K, b.KcT + p0 * K + c * kLanes);
  if (n < npad) {
    float* kt = b.KcT + (n / kLanes) * K * kLanes;
    for (int c = 0; c < Ki; ++c)
      for (int l = n % kLanes; l < kLanes; ++l) kt[c * kLanes + l] = 0.f;
  }

  // q^, k^ (n x K) and k^T (K x n) as the products below and chunk_head's take them (q, k and
  // k^T where raw_qk_operands).
  constexpr bool exact = raw_qk_operands<TA>();  // q, k exact in bf16: one part packed
  ga[0] = gemm_prepare_a<TA, exact>(n, Ki, b.Qc, K, 1, b.Qp);
  ga[1] = gemm_prepare_a<TA, exact>(n, Ki, b.Kc, K, 1, b.Kp);
  ga[2] = gemm_prepare_a<TA, exact>(Ki, n, b.Kc, 1, K, b.KTp);

  // Raw scores Q K^T, K K^T, only the column blocks on or left of the diagonal (P, A need j <= i);
  // q k^T, k k^T where raw_qk_operands (rq_i rk_j, rk_i rk_j applied in chunk_head).
  const Mat<float> scores[2] = {row_major(b.SQ, C), row_major(b.SK, C)};
  gemm_prepared<float, TA>(ga, scores, 2, npad, panels<const float>(b.KcT, K), {}, nullptr, kGemmTriCols);
}

// One chunk of tokens [t0, t0 + n) for value head h (after chunk_prep), its v rows at v, v_ld
// apart; S holds the head's state before the chunk as panels (ignored and overwritten when
// zero_state) and the state after it on return.
template <int C, class TA>
inline void chunk_head(const ChunkArgs& p, const ChunkBufs<C>& b, const GemmA* ga, float* S, int64_t t0, int n,
                       int64_t h, const TA* v, int64_t v_ld, bool zero_state) {
  const int64_t HV = p.HV, K = p.K, V = p.V;
  const int Ki = int(K), Vi = int(V);
  TA* o = static_cast<TA*>(p.o);
  const int npad = (n + kLanes - 1) / kLanes * kLanes;

  // Gates: in-chunk cumsum of g in double, so that Gc_i - Gc_j keeps its relative accuracy
  // when the sums are large. A gate below kGateFloor is raised to it first: every decay across
  // it is still 0 (e^-110 underflows f32), and the gates after it do not vanish into a huge
  // sum (g = -1e16 left their differences 0, decays of 1). NaN stays NaN; -inf becomes the
  // floor, as decode's e^-inf = 0.
  double Gc[C];
  float beta[C];
  {
    double acc = 0.0;
    for (int i = 0; i < n; ++i) {
      const double gi = double(p.g[(t0 + i) * HV + h]);
      acc += gi < kGateFloor ? kGateFloor : gi;
      Gc[i] = acc;
      beta[i] = p.beta[(t0 + i) * HV + h];
    }
    for (int i = 0; i < n; ++i) {
      b.eg[i] = float(std::exp(Gc[i]));
      b.dg[i] = float(std::exp(Gc[n - 1] - Gc[i]));
    }
    const float last = float(std::exp(Gc[n - 1]));
    for (int c = 0; c < Ki; ++c) b.decay[c] = last;
  }

  // Decay and causal masks. Gamma_ij = exp(Gc_i - Gc_j) only for j <= i (a non-positive
  // exponent for a decay g <= 0); masked lanes get exp(-1000) = 0. Gc_i - Gc_j is formed in
  // f32 vectors from Gc split as hi + lo (hi = float(Gc), lo = float(Gc - hi)):
  // (hi_i - hi_j) + (lo_i - lo_j) is within 1.5 ulp of Gc_i - Gc_j (hi_i - hi_j is exact when
  // they are within 2x, else rounded by half an ulp of a result of about the same size; the sum
  // adds another half). In the diagonal block the lanes j > i become -1000 through a 0/1 vector
  // (lanes built one by one there cost a store-forwarding stall per row: ~3% of the prefill
  // step), so hi and lo are zero, not stale, past n.
  float* gh = b.gh;
  float* gl = b.gl;
  for (int i = 0; i < n; ++i) {
    gh[i] = float(Gc[i]);
    gl[i] = float(Gc[i] - double(gh[i]));
  }
  for (int i = n; i < npad; ++i) gh[i] = gl[i] = 0.f;
  static_assert(kLanes == 16, "kLaneOnes below and vtranspose16 in chunk_prep spell out 16 lanes");
  static constexpr float kLaneOnes[kLanes] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  // raw_qk_operands: the scores are q k^T and k k^T; P takes rq_i rk_j, A rk_i rk_j (rk is zero
  // past the tokens, where Gamma is too).
  constexpr bool raw = raw_qk_operands<TA>();
  for (int i = 0; i < n; ++i) {
    const float* sq = b.SQ + i * C;
    const float* sk = b.SK + i * C;
    float* pr = b.P + i * C;
    float* ar = b.A + i * C;
    const int nb = i / kLanes + 1;
    const VF bi = vset1(raw ? beta[i] * b.rk[i] : beta[i]), hi = vset1(gh[i]), lo = vset1(gl[i]);
    const VF qi = vset1(raw ? b.rq[i] : 1.f);
    for (int c = 0; c < npad; c += kLanes) {
      if (c / kLanes < nb) {
        VF gm;
        if (c / kLanes < nb - 1) {
          gm = vexp((hi - vload(gh + c)) + (lo - vload(gl + c)));
        } else {
          const VF keep = vload_n(kLaneOnes, i - c + 1);  // 1 for j <= i, else 0
          const VF diff = (hi - vload(gh + c)) + (lo - vload(gl + c));
          gm = vexp(vfma(diff, keep, (keep - vset1(1.f)) * vset1(1000.f)));
        }
        if (raw) gm = gm * vload(b.rk + c);
        vstore(pr + c, raw ? vload(sq + c) * gm * qi : vload(sq + c) * gm);
        vstore(ar + c, vload(sk + c) * gm * bi);
      } else {
        vstore(pr + c, vzero());
        vstore(ar + c, vzero());
      }
    }
    ar[i] = 0.f;
  }

  // T = (I + A)^-1 by forward substitution: T_i = e_i - sum_{j<i} A_ij T_j (row j of T is
  // zero right of column j, so column block c takes j >= 16c). One column block at a time with
  // two register accumulators (even / odd j): a runtime-indexed accumulator array lived on the
  // stack, and one chain of i dependent fmas per row was latency-bound.
  for (int i = 0; i < n; ++i) {
    const int nb = i / kLanes + 1;
    const float* ar = b.A + i * C;
    float* tr = b.Tm + i * C;
    for (int c = 0; c < nb; ++c) {
      VF acc0 = vzero(), acc1 = vzero();
      const float* tc = b.Tm + c * kLanes;
      int j = c * kLanes;
      for (; j + 1 < i; j += 2) {
        acc0 = vfma(vset1(-ar[j]), vload(tc + j * C), acc0);
        acc1 = vfma(vset1(-ar[j + 1]), vload(tc + (j + 1) * C), acc1);
      }
      if (j < i) acc0 = vfma(vset1(-ar[j]), vload(tc + j * C), acc0);
      vstore(tr + c * kLanes, acc0 + acc1);
    }
    for (int c = nb; c < npad / kLanes; ++c) vstore(tr + c * kLanes, vzero());
    tr[i] = 1.f;
  }

  const Mat<const float> Sm = panels<const float>(S, K);
  const Mat<float> xq = panels(b.XQ, C), xk = panels(b.XK, C), vn = panels(b.Vn, C);

  // Q S0 and K S0 (nothing to do from a zero state).
  if (!zero_state) {
#if defined(GDN_CHUNK_BF16_STATE)
    if (bf16_state_products<TA>() && b.pairs) {
      // S0's panels as pair panels: rows 2q, 2q + 1 of a panel are the 32 floats at 32 q.
      for (int64_t e = 0; e < K * V; e += 2 * kLanes) {
        const VF x[2] = {vload(S + e), vload(S + e + kLanes)};
        vstore_pairs(b.Sb + e, x);
      }
      gemm_vf_run(n, Vi, Ki / 2, GemmPairOperands{b.Qb, K / 2, 1, b.Sb, 16 * K, {}, nullptr, xq}, kGemmFull);
      gemm_vf_run(n, Vi, Ki / 2, GemmPairOperands{b.Kb, K / 2, 1, b.Sb, 16 * K, {}, nullptr, xk}, kGemmFull);
    } else
#endif
    {
      const Mat<float> x[2] = {xq, xk};
      gemm_prepared<float, TA>(ga, x, 2, Vi, Sm, {}, nullptr, kGemmFull);
    }
  }

  // R = diag(beta) (V - diag(e^Gc) K S0), in place of K S0; then V_new = T R. On bf16 pairs
  // or raw operands the products' rows still lack rk and rq: folded into their row scales
  // here and in O.
  const bool unscaled = raw || (bf16_state_products<TA>() && b.pairs);
  const float* eg_o = b.eg;
  if (unscaled) {
    for (int i = 0; i < n; ++i) b.egq[i] = b.eg[i] * b.rq[i];
    eg_o = b.egq;
  }
  for (int i = 0; i < n; ++i) {
    const TA* vr = v + i * v_ld;
    const VF bi = vset1(beta[i]);
    const VF ei = vset1(unscaled ? b.eg[i] * b.rk[i] : b.eg[i]);
    for (int c = 0; c < Vi; c += kLanes) {
      float* r = b.XK + c * C + i * kLanes;  // panel c / 16, row i
      vstore(r, zero_state ? bi * vload(vr + c) : bi * (vload(vr + c) - ei * vload(r)));
    }
  }
  gemm<float, TA>(n, Vi, n, b.Tm, C, 1, {b.XK, kLanes, kLanes * C}, {}, nullptr, vn, kGemmTriDepth);

  // O = diag(e^Gc) Q S0 + P V_new, stored straight into o in the activation dtype.
  gemm<TA, TA>(n, Vi, n, b.P, C, 1, {b.Vn, kLanes, kLanes * C}, {b.XQ, kLanes, kLanes * C},
               zero_state ? nullptr : eg_o, row_major(o + (t0 * HV + h) * V, HV * V), kGemmTriDepth);

  // S = e^G_last S0 + K^T diag(e^(G_last - Gc)) V_new (the A operand K^T is read from Kc; with
  // raw operands k^T, rk in V_new's row scale).
  for (int i = 0; i < n; ++i) {
    const VF d = vset1(raw ? b.dg[i] * b.rk[i] : b.dg[i]);
    for (int c = 0; c < Vi; c += kLanes) {
      float* r = b.Vn + c * C + i * kLanes;
      vstore(r, vload(r) * d);
    }
  }
  const Mat<float> s_out = panels(S, K);
  gemm_prepared<float, TA>(ga + 2, &s_out, 1, Vi, {b.Vn, kLanes, kLanes * C}, Sm, zero_state ? nullptr : b.decay,
                           kGemmFull);
}

// Value heads per work item: a group of gsz heads of one key head shares q^, k^ and the
// raw scores. The largest divisor of G whose f32 states fit 128 KiB (so that the scratch
// stays within a 512 KiB L2) and that still leaves >= 4 items per thread over the `rows`
// sequences with work. The result does not depend on the choice: every head computes the
// same operations on the same data.
inline int64_t chunk_group(const ChunkArgs& p, int64_t rows, int threads) {
  const int64_t G = p.HV / p.H;
  for (int64_t d = G; d > 1; --d) {
    if (G % d != 0) continue;
    if (d * p.K * p.V * 4 > 128 * 1024) continue;
    if (rows * (p.HV / d) < 4 * int64_t(threads)) continue;
    return d;
  }
  return 1;
}

// The serving step's prefill (conv_chunk below): q, k, v are the conv outputs of x's rows
// (conv.h), made chunk by chunk into a buffer of the thread's instead of read from a [T, D]
// result written in a pass of their own: the outputs are still in L1/L2 when the chunk reads
// them. cv's x has the mixed qkv layout; q, k, v of head 0 start at channels q_off, k_off,
// v_off of a row.
template <class TA>
struct ChunkConv {
  const ConvArgs* cv;
  ConvPart<TA> part;
  int64_t q_off, k_off, v_off;
};

// A fused item's conv work: channel ranges of at most kConvChanBlock (the parameter block's
// width), each to column `col` of the buffer rows.
struct ConvPiece {
  int64_t c0, c1, col;
};
constexpr int kMaxConvPieces = 16;  // 2 ranges of K <= 256, one of gsz * V <= 2048 (chunk_group)

inline int conv_pieces(int64_t c0, int64_t n, int64_t col, ConvPiece* out, int count) {
  for (int64_t c = 0; c < n; c += kConvChanBlock)
    out[count++] = {c0 + c, c0 + (n - c < kConvChanBlock ? n : c + kConvChanBlock), col + c};
  return count;
}

// One work item at chunk size C: the gsz value heads [h0, h0 + gsz) of sequence s (slot >= 0),
// from the slot's state or from zero, back into the slot; q, k, v from p's rows, or made by
// the conv when cf is set.
template <int C, class TA, class TS>
void chunk_item(const ChunkArgs& p, float* scratch, int64_t gsz, int64_t s, int32_t slot, int64_t h0,
                bool zero_state, const ChunkConv<TA>* cf) {
  const int64_t HV = p.HV, K = p.K, V = p.V, kh = h0 / (HV / p.H);
  const int64_t bos = p.query_start_loc[s], eos = p.query_start_loc[s + 1];
  TS* pool = static_cast<TS*>(p.ssm_state);
  const TA* o = static_cast<const TA*>(p.o);
  const ChunkBufs<C> b(scratch, K, V, gsz, bf16_state_products<TA>() && eos - bos >= kPairsMinTokens,
                       raw_qk_operands<TA>());
  if (!zero_state) {
    for (int64_t j = 0; j < gsz; ++j) {  // k-major [K][V] -> panels
      const TS* st = pool + (int64_t(slot) * HV + h0 + j) * K * V;
      float* Sj = b.S + j * K * V;
      for (int64_t r = 0; r < K; ++r)
        for (int64_t c = 0; c < V; c += kLanes) vstore(Sj + c * K + r * kLanes, vload(st + r * V + c));
    }
  }
  // src: where the item's inputs live at token 0 (read, or prefetched a chunk ahead).
  ChunkRows<TA> src{static_cast<const TA*>(p.q) + kh * K, static_cast<const TA*>(p.k) + kh * K,
                    static_cast<const TA*>(p.v) + h0 * V, qk_row_stride(p), v_row_stride(p)};
  ConvPiece pieces[kMaxConvPieces];
  int npieces = 0;
  const float* wt = nullptr;
  TA* yb = nullptr;
  const int64_t yld = 2 * K + gsz * V;  // buffer row: q, k, then the group's v
  if (cf != nullptr) {
    const ConvArgs& cv = *cf->cv;
    const TA* x = static_cast<const TA*>(cv.x);
    src = {x + cf->q_off + kh * K, x + cf->k_off + kh * K, x + cf->v_off + h0 * V, cv.D, cv.D};
    npieces = conv_pieces(cf->q_off + kh * K, K, 0, pieces, npieces);
    npieces = conv_pieces(cf->k_off + kh * K, K, K, pieces, npieces);
    npieces = conv_pieces(cf->v_off + h0 * V, gsz * V, 2 * K, pieces, npieces);
    const int64_t wfl = npieces * kConvParamFloats, yfl = (C * yld * int64_t(sizeof(TA)) + 63) / 64 * 16;
    float* cs = thread_scratch<float, 3>(wfl + yfl);
    for (int i = 0; i < npieces; ++i) cf->part.params(cv, pieces[i].c0, pieces[i].c1, cs + i * kConvParamFloats);
    wt = cs;
    yb = reinterpret_cast<TA*>(cs + wfl);
  }
  for (int64_t t0 = bos; t0 < eos; t0 += C) {
    const int n = int(eos - t0 < C ? eos - t0 : C);
    const int64_t rest = eos - t0 - n, tn = rest > 0 ? t0 + n : t0;
    ChunkRows<TA> rows = src.at(t0);
    if (cf != nullptr) {
      for (int i = 0; i < npieces; ++i)
        cf->part.rows(*cf->cv, wt + i * kConvParamFloats, s, t0, t0 + n, pieces[i].c0, pieces[i].c1,
                      yb + pieces[i].col, yld);
      rows = {yb, yb + K, yb + 2 * K, yld, yld};
    }
    GemmA ga[3];
    chunk_prep<C, TA>(p, b, rows, n, src.at(tn), int(rest < C ? rest : C), o + (tn * HV + h0) * V, gsz, ga);
    for (int64_t j = 0; j < gsz; ++j)
      chunk_head<C, TA>(p, b, ga, b.S + j * K * V, t0, n, h0 + j, rows.v + j * V, rows.v_ld, zero_state);
    zero_state = false;
  }
  for (int64_t j = 0; j < gsz; ++j) {
    TS* st = pool + (int64_t(slot) * HV + h0 + j) * K * V;
    const float* Sj = b.S + j * K * V;
    for (int64_t r = 0; r < K; ++r)
      for (int64_t c = 0; c < V; c += kLanes) vstore(st + r * V + c, vload(Sj + c * K + r * kLanes));
  }
}

// Chunk size per sequence: p.chunk_size when the caller forces one (tests, benchmarks), else
// kChunkLong for sequences longer than 128 tokens and 64 for shorter ones (fewer, fuller
// chunks). kChunkLong is the ISA's (GDN_CHUNK_LONG, set by its translation unit; 64 unless
// measured otherwise): ffi/README.md, "Chunk size".
#ifndef GDN_CHUNK_LONG
#define GDN_CHUNK_LONG 64
#endif
constexpr int kChunkLong = GDN_CHUNK_LONG;
static_assert(kChunkLong == 32 || kChunkLong == 64, "chunk sizes compiled: 32, 64");

inline int chunk_size_for(int forced, int64_t len) {
  if (forced != 0) return forced;
  return len > 128 ? kChunkLong : 64;
}

template <class TA, class TS>
void chunk_impl(const ChunkArgs& p, const Parallel& par, const ChunkConv<TA>* cf) {
  const int64_t HV = p.HV, K = p.K, V = p.V, S = p.S;
  const int32_t* qsl = p.query_start_loc;
  TA* o = static_cast<TA*>(p.o);

  // Tokens no sequence covers: zero output.
  const int64_t covered = qsl[S];
  if (covered < p.T) std::memset(o + covered * HV * V, 0, size_t((p.T - covered) * HV * V) * sizeof(TA));

  // Items only for the sequences with work here: in a serving step most rows may be another
  // kernel's (decode rows beside one prefill), and counting their items put every real one
  // into one of the parallel ranges, i.e. on one thread (ffi/README.md, "Mixed steps").
  // The list is the calling thread's scratch (no allocation per call); workers only read it.
  int64_t* seqs = thread_scratch<int64_t, 4>(S > 0 ? S : 1);
  int64_t nseq = 0;
  for (int64_t s = 0; s < S; ++s)
    if (qsl[s + 1] > qsl[s] && p.rows.owns(s)) seqs[nseq++] = s;
  const int64_t gsz = chunk_group(p, nseq, par.num_threads);
  const int64_t groups = HV / gsz;  // items per sequence
  // C = 64's buffers hold C = 32's, with pairs those without.
  const int64_t need = ChunkBufs<64>(nullptr, K, V, gsz, bf16_state_products<TA>(), raw_qk_operands<TA>()).total;
  par(nseq * groups, 1, [&](int64_t begin, int64_t end) {
    float* scratch = chunk_scratch(need);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = seqs[item / groups], h0 = (item % groups) * gsz;
      const int64_t bos = qsl[s], eos = qsl[s + 1];
      const int32_t slot = p.state_indices[s];
      if (slot < 0) {  // padding row
        for (int64_t t = bos; t < eos; ++t) std::memset(o + (t * HV + h0) * V, 0, size_t(gsz * V) * sizeof(TA));
        continue;
      }
      const bool zero_state = !p.has_initial_state[s];
      if (chunk_size_for(p.chunk_size, eos - bos) == 32)
        chunk_item<32, TA, TS>(p, scratch, gsz, s, slot, h0, zero_state, cf);
      else
        chunk_item<64, TA, TS>(p, scratch, gsz, s, slot, h0, zero_state, cf);
    }
  });
  // The conv's slot rows, once every item has read the old ones.
  if (cf != nullptr) conv_fwd_states<TA>(*cf->cv, par);
}

inline void chunk(const ChunkArgs& p, const Parallel& par) {
  if (p.act == DType::bf16) {
    if (p.state == DType::bf16) chunk_impl<bf16, bf16>(p, par, nullptr);
    else chunk_impl<bf16, float>(p, par, nullptr);
  } else {
    if (p.state == DType::bf16) chunk_impl<float, bf16>(p, par, nullptr);
    else chunk_impl<float, float>(p, par, nullptr);
  }
}

// The serving step's prefill rows in one pass: the conv (cv, its rows filter and state
// included) and the chunk (p) whose q, k, v are cv's outputs, made per chunk (ChunkConv)
// rather than written to cv.y: bit for bit conv_fwd followed by chunk reading y, but
// cv.y is neither written nor read. p.q, p.k, p.v point into the rows of cv.y (the mixed
// form, rows cv.D apart): their offsets from cv.y are the channels of q, k, v.
template <class TA, class TS>
void conv_chunk_impl(const ConvArgs& cv, const ChunkArgs& p, const Parallel& par) {
  const TA* y = static_cast<const TA*>(cv.y);
  const ChunkConv<TA> cf{&cv, conv_part<TA>(cv), static_cast<const TA*>(p.q) - y, static_cast<const TA*>(p.k) - y,
                         static_cast<const TA*>(p.v) - y};
  chunk_impl<TA, TS>(p, par, &cf);
}

inline void conv_chunk(const ConvArgs& cv, const ChunkArgs& p, const Parallel& par) {
  if (p.act == DType::bf16) {
    if (p.state == DType::bf16) conv_chunk_impl<bf16, bf16>(cv, p, par);
    else conv_chunk_impl<bf16, float>(cv, p, par);
  } else {
    if (p.state == DType::bf16) conv_chunk_impl<float, bf16>(cv, p, par);
    else conv_chunk_impl<float, float>(cv, p, par);
  }
}
