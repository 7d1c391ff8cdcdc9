// Gated delta rule token recurrence with fused gating: decode and spec verify.
// Included inside the ISA namespace (see all_kernels.inc).
//
// One kernel serves both paths: plain decode is spec verify with query_start_loc =
// arange(B + 1), one index column and num_accepted = 1. Row i (tokens [qsl[i], qsl[i+1]))
// starts from slot idx[i, acc-1] and writes the state after its token t to slot idx[i, t].
//
// Work item = (row, value head, range of 32-column blocks of V). V is the SIMD dimension
// (unit stride in the k-major state). Every column's arithmetic is the same whatever the
// block width or split (reductions run over k in a fixed order per column), so results do
// not depend on the split nor on the thread that runs an item.
//
// Per column block (K x 32 f32, 16 KiB at K = 128, stays in L1 between the passes):
//   pass 1 (first token only): kv = S_srcᵀ k̂_0 (read the start slot; a bf16 one is also
//   kept widened in loc for the first fused pass, except in the AVX2 pair order).
//   per token t: delta = beta (v - alpha kv); one fused pass over k:
//     S[k] = alpha S[k] + k̂_k delta; store S[k] to slot idx[i, t];
//     o += S[k] q̂_k;  kv' += S[k] k̂_{t+1,k} (the next token's reduction, fused).
// The state stays f32 between the tokens of a row: an f32 pool continues from the slot it
// just wrote (exact), a bf16 pool from an f32 stack copy of the block, so each stored bf16
// state is rounded once per token and the roundings do not compound.
// See ffi/README.md, "Recurrent decode / spec".

// The hot loops are flattened so that every vector primitive (including the bf16 load /
// store conversions) is inlined: GCC otherwise leaves some as calls with VF passed on the
// stack, which made the bf16-state pass 10x slower.
#include "kernels/rec_prefetch.h"  // what a column block prefetches (recurrent_impl)

#ifndef GDN_REC_HOT
#define GDN_REC_HOT __attribute__((flatten))
#define GDN_REC_INLINE inline __attribute__((always_inline))
#endif

constexpr int64_t kRecMaxDim = 256;     // K, V limit (the handler refuses larger)
constexpr int kRecTokGroup = 8;         // tokens whose q̂/k̂/gates are prepared at once
constexpr int kRecBlockVF = 2;          // VF per full column block
#if defined(__AVX512F__)
constexpr bool kRecStashBf16 = false;   // a bf16 start block read as bf16 by its first pass
constexpr int kRecWideVF = 8;           // 128-column blocks where they pay (recurrent_impl, "wide")
#else
constexpr bool kRecStashBf16 = true;    // widened once into loc (not measured otherwise)
constexpr int kRecWideVF = 0;           // none: 8 VF of two ymm each would not stay in registers
#endif
// A bf16 state's decode rows prefetch the row's next head whole, in address order, a share per
// narrow block (recurrent_impl, head-ahead); otherwise a block prefetches the next block. Measured
// on AVX2 only.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kRecHeadAhead = true;
#else
constexpr bool kRecHeadAhead = false;
#endif
constexpr int kRecBlock = kRecBlockVF * kLanes;  // 32 columns
constexpr int kRecWide = kRecWideVF * kLanes;    // 128 columns on AVX-512
// loc: a block's f32 state between tokens, kRecMaxDim rows of the widest block (128 KiB on AVX-512).
constexpr int kRecLocCols = kRecWide > kRecBlock ? kRecWide : kRecBlock;

inline int64_t rec_min(int64_t a, int64_t b) { return a < b ? a : b; }

// kPair: a full piece exchanged with memory outside the kernel (pool, v, o) in the ISA's pair
// order (vec_avx2.h, vec_avx512.h: the bf16 state's widening and rounding without lane-crossing
// shuffles). Inside, a VF keeps whatever order it has; loc holds VFs as they are. Loads and
// stores go by units of U VFs: in the pair order U = kPairVF (a unit is one VF on AVX2, two on
// AVX-512), otherwise U plain VFs kLanes apart.
template <bool kPair>
constexpr int rec_unit() {
  return kPair ? kPairVF : 1;
}
template <int U, bool kFull, bool kPair = false, class T>
GDN_REC_INLINE void rec_ld(const T* p, int n, VF* x) {
  if constexpr (kPair) {
    static_assert(U == kPairVF, "a pair-order unit");
    vload_pairs(p, x);
  } else {
    for (int u = 0; u < U; ++u) x[u] = kFull ? vload(p + u * kLanes) : vload_n(p + u * kLanes, n);
  }
}
template <int U, bool kFull, bool kPair = false, class T>
GDN_REC_INLINE void rec_st(T* p, const VF* x, int n) {
  if constexpr (kPair) {
    static_assert(U == kPairVF, "a pair-order unit");
    vstore_pairs(p, x);
  } else {
    for (int u = 0; u < U; ++u) {
      if (kFull) vstore(p + u * kLanes, x[u]);
      else vstore_n(p + u * kLanes, x[u], n);
    }
  }
}
template <int U, bool kPair, class T>
GDN_REC_INLINE void rec_stream(T* p, const VF* x) {
  if constexpr (kPair) vstream_pairs(p, x);
  else
    for (int u = 0; u < U; ++u) vstream(p + u * kLanes, x[u]);
}
// Pair order for a bf16 state's full blocks of whole units where the ISA has one (the f32 state
// loses by it: its loads would need the shuffles the bf16 one saves).
template <int NV, bool kFull, class ST>
constexpr bool rec_pairs() {
  return kPairOrder && kFull && std::is_same<ST, bf16>::value && NV % kPairVF == 0;
}

// The prepared operands of up to kRecTokGroup tokens of one row for one value head.
template <class A, class ST>
struct RecGroup {
  int n;                               // tokens in the group
  float alpha[kRecTokGroup], beta[kRecTokGroup];
  const A* v[kRecTokGroup];            // v row of the token for this head (column 0)
  A* o[kRecTokGroup];                  // o row of the token for this head (column 0)
  ST* dst[kRecTokGroup];               // slot head base the state after the token goes to
  bool nt[kRecTokGroup];               // store that slot with non-temporal stores
  alignas(64) float qh[kRecTokGroup][kRecMaxDim];  // q̂ (normalised, scaled)
  alignas(64) float kh[kRecTokGroup][kRecMaxDim];  // k̂
};

// Rows r and r + 1 of a block of NV vectors (row stride ld) prefetched into L2 (see rec_pass):
// their lines [first, end) of each row, kHalf 0 all of them, 1 the first half, 2 the rest.
// The lines are expanded at compile time: with a loop here GCC changed how it kept the
// accumulators of the loops around it (rec_kv's went to the stack).
template <size_t kFirst, size_t... I>
GDN_REC_INLINE void rec_prefetch_lines(const char* r0, const char* r1, std::index_sequence<I...>) {
  ((__builtin_prefetch(r0 + 64 * (kFirst + I), 0, 2), __builtin_prefetch(r1 + 64 * (kFirst + I), 0, 2)), ...);
}
template <int NV, int kHalf = 0, class ST>
GDN_REC_INLINE void rec_prefetch_rows(const ST* r, int64_t ld) {
  constexpr size_t kLines = (size_t(NV) * kLanes * sizeof(ST) + 63) / 64;
  constexpr size_t kFirst = kHalf == 2 ? kLines / 2 : 0, kEnd = kHalf == 1 ? kLines / 2 : kLines;
  rec_prefetch_lines<kFirst>(reinterpret_cast<const char*>(r), reinterpret_cast<const char*>(r + ld),
                             std::make_index_sequence<kEnd - kFirst>());
}

// Rows k and k + 1 of rec_kv: a0 / a1 += row * kh (stash: see rec_kv).
template <int NV, bool kFull, bool kStash, bool kPair, class Src>
GDN_REC_INLINE void rec_kv_rows(const Src* s, int64_t ld, int64_t k, const float* kh, int ncol, float* stash, VF* a0,
                                VF* a1) {
  constexpr int U = rec_unit<kPair>();
  const VF k0 = vset1(kh[k]), k1 = vset1(kh[k + 1]);
  const Src* r0 = s + k * ld;
  const Src* r1 = r0 + ld;
  for (int c = 0; c < NV; c += U) {
    VF x0[U], x1[U];
    rec_ld<U, kFull, kPair>(r0 + c * kLanes, ncol, x0);
    rec_ld<U, kFull, kPair>(r1 + c * kLanes, ncol, x1);
    for (int u = 0; u < U; ++u) {
      if (kStash) {
        vstore(stash + k * kRecBlock + (c + u) * kLanes, x0[u]);
        vstore(stash + (k + 1) * kRecBlock + (c + u) * kLanes, x1[u]);
      }
      a0[c + u] = vfma(x0[u], k0, a0[c + u]);
      a1[c + u] = vfma(x1[u], k1, a1[c + u]);
    }
  }
}

// kv[c] = sum_k S[k, c] * kh[k]: two interleaved accumulators (even / odd k), then summed.
// This pass reads the block from memory (the fused pass then reads it from L1 or L2); its rows
// were prefetched beside the previous block's passes. stash (kStash): the block as read,
// widened to f32 (row stride kRecBlock), so that the first token's pass reads it without
// widening every element a second time. kPf (an f32 decode row in wide blocks): this pass
// prefetches the first half of each row of the next block pf (row stride pf_ld), its pass the
// rest, so that the next block's reads are in flight through both passes; and its accumulators
// go through L1 after every row pair (the empty asm), which paces the loop to about half its
// speed from L2. Both measured (ffi/README.md, Recurrent decode / spec, "Prefetch in both
// passes"): without the pacing the split gained a third as much.
template <int NV, bool kFull, bool kStash, bool kPair, bool kPf, class Src, class ST>
GDN_REC_HOT void rec_kv(const Src* s, int64_t ld, int64_t K, const float* kh, int ncol, VF* kv, float* stash,
                        const ST* pf, int64_t pf_ld) {
  VF a0[NV], a1[NV];
  for (int c = 0; c < NV; ++c) a0[c] = a1[c] = vzero();
  int64_t k = 0;
  for (; k + 1 < K; k += 2) {
    if constexpr (kPf) rec_prefetch_rows<NV, 1>(pf + k * pf_ld, pf_ld);
    rec_kv_rows<NV, kFull, kStash, kPair>(s, ld, k, kh, ncol, stash, a0, a1);
    if constexpr (kPf) asm volatile("" : : "r"(a0), "r"(a1) : "memory");  // the pacing (above)
  }
  if (k < K) {
    constexpr int U = rec_unit<kPair>();
    const VF k0 = vset1(kh[k]);
    for (int c = 0; c < NV; c += U) {
      VF x0[U];
      rec_ld<U, kFull, kPair>(s + k * ld + c * kLanes, ncol, x0);
      for (int u = 0; u < U; ++u) {
        if (kStash) vstore(stash + k * kRecBlock + (c + u) * kLanes, x0[u]);
        a0[c + u] = vfma(x0[u], k0, a0[c + u]);
      }
    }
  }
  for (int c = 0; c < NV; ++c) kv[c] = a0[c] + a1[c];
}

// One row k of a token's fused pass (see rec_pass); ao / an: the accumulators of this k.
template <int NV, bool kFull, bool kNext, bool kLoc, bool kNT, bool kPair, class Src, class ST>
GDN_REC_INLINE void rec_row(const Src* s, ST* dst, float* loc, VF va, const VF* d, float kk, float qk, float kn,
                            int ncol, VF* ao, VF* an) {
  constexpr int U = rec_unit<kPair>();
  const VF vk = vset1(kk), vq = vset1(qk), vn = vset1(kn);
  for (int c = 0; c < NV; c += U) {
    VF sn[U];
    rec_ld<U, kFull, kPair && std::is_same<Src, bf16>::value>(s + c * kLanes, ncol, sn);
    for (int u = 0; u < U; ++u) sn[u] = vfma(vk, d[c + u], sn[u] * va);
    if (kNT) rec_stream<U, kPair>(dst + c * kLanes, sn);
    else rec_st<U, kFull, kPair>(dst + c * kLanes, sn, ncol);
    for (int u = 0; u < U; ++u) {
      if (kLoc) vstore(loc + (c + u) * kLanes, sn[u]);
      ao[c + u] = vfma(sn[u], vq, ao[c + u]);
      if (kNext) an[c + u] = vfma(sn[u], vn, an[c + u]);
    }
  }
}

// One token's fused pass over the K rows of a column block:
//   S' = alpha S + k̂ deltaᵀ, stored to dst (state dtype; kNT: non-temporal) and, if kLoc,
//   to loc (f32, row stride LD: the block's width); o = S'ᵀ q̂; if kNext, kvn = S'ᵀ k̂_next.
//   o and kvn accumulate over k in one chain per column (ffi/README.md, "One accumulator
//   chain"): with rec_kv's even / odd pairs AVX2 ran out of ymm registers in the spec passes.
// pf (may be null): the next column block to be read from memory (a pool block, row stride pf_ld:
// dst's d_ld, or kRecBlock for a head-ahead share, recurrent_impl); this pass prefetches the row
// pairs k / 2 = pf_phase (mod pf_every) of it beside the same rows of this one, so that reads are
// in flight while the group's passes compute (nothing else reads memory meanwhile): each of a
// group's n token passes takes one n-th of the rows. A block row is one (bf16) or two (f32) 64-byte
// lines, rows V elements apart: short pieces the hardware prefetchers follow poorly. Spread over
// the passes, the prefetches keep a few lines in flight all the time; issued as a burst in rec_kv
// they stalled on full miss buffers (2026-11-30, dev host: bf16-state decode B = 8 1.18-1.23 ->
// 0.94-0.98 ms, B = 32 4.6 -> 3.5-3.9 ms; f32 and the spread over a spec group's passes:
// ffi/README.md, "Recurrent decode / spec"). Into L2 (locality 2, prefetcht1), not L1: on Zen 4 an
// L1 prefetch holds one of the few L1 miss buffers until its line arrives and the pass reached ~20
// GB/s per thread; into L2 ~32 (decode B = 8 f32 kernel, two threads, 0.95 -> 0.6-0.76 ms; Zen 3
// measured the same both ways). pf_rest: rec_kv took the first half of each row's lines (kPf
// there), this pass takes the rest, of every row pair. pf2 (may be null): a second block (row
// stride d_ld) prefetched beside pf, whole rows, with the same phases.
template <int NV, bool kFull, bool kNext, bool kLoc, bool kNT, bool kPair, int LD, class Src, class ST>
GDN_REC_HOT void rec_pass(const Src* s, int64_t s_ld, ST* dst, int64_t d_ld, float* loc, int64_t K, float alpha,
                          const VF* d, const float* kh, const float* qh, const float* khn, int ncol, VF* o,
                          VF* kvn, const ST* pf, int64_t pf_ld, const ST* pf2, int pf_phase, int pf_every,
                          bool pf_rest) {
  VF oa[NV], na[NV];
  for (int c = 0; c < NV; ++c) oa[c] = na[c] = vzero();
  const VF va = vset1(alpha);
  int64_t k = 0;
  int ph = 0;
  for (; k + 1 < K; k += 2) {
    if (ph == pf_phase) {  // see above
      if (pf != nullptr) {
        if (pf_rest) rec_prefetch_rows<NV, 2>(pf + k * pf_ld, pf_ld);
        else rec_prefetch_rows<NV>(pf + k * pf_ld, pf_ld);
      }
      if (pf2 != nullptr) rec_prefetch_rows<NV>(pf2 + k * d_ld, d_ld);
    }
    if (++ph == pf_every) ph = 0;
    rec_row<NV, kFull, kNext, kLoc, kNT, kPair>(s + k * s_ld, dst + k * d_ld, loc + k * LD, va, d, kh[k],
                                                qh[k], kNext ? khn[k] : 0.f, ncol, oa, na);
    rec_row<NV, kFull, kNext, kLoc, kNT, kPair>(s + (k + 1) * s_ld, dst + (k + 1) * d_ld, loc + (k + 1) * LD,
                                                va, d, kh[k + 1], qh[k + 1], kNext ? khn[k + 1] : 0.f, ncol, oa, na);
  }
  if (k < K)
    rec_row<NV, kFull, kNext, kLoc, kNT, kPair>(s + k * s_ld, dst + k * d_ld, loc + k * LD, va, d, kh[k],
                                                qh[k], kNext ? khn[k] : 0.f, ncol, oa, na);
  for (int c = 0; c < NV; ++c) {
    o[c] = oa[c];
    if (kNext) kvn[c] = na[c];
  }
}

// Picks the rec_pass instantiation; non-temporal stores only on full (aligned) pieces.
template <int NV, bool kFull, bool kPair, int LD, class Src, class ST>
inline void rec_pass_any(bool next, bool use_loc, bool nt, const Src* s, int64_t s_ld, ST* dst, int64_t d_ld,
                         float* loc, int64_t K, float alpha, const VF* d, const float* kh, const float* qh,
                         const float* khn, int ncol, VF* o, VF* kvn, const ST* pf, int64_t pf_ld, const ST* pf2,
                         int pf_phase, int pf_every, bool pf_rest) {
#define GDN_REC_PASS(kNext, kLoc, kNT)                                                                       \
  rec_pass<NV, kFull, kNext, kLoc, kNT, kPair, LD>(s, s_ld, dst, d_ld, loc, K, alpha, d, kh, qh, khn, ncol, o, kvn, pf, \
                                               pf_ld, pf2, pf_phase, pf_every, pf_rest)
  if (kFull && nt) {
    if (next) {
      if (use_loc) GDN_REC_PASS(true, true, kFull);
      else GDN_REC_PASS(true, false, kFull);
    } else {
      if (use_loc) GDN_REC_PASS(false, true, kFull);
      else GDN_REC_PASS(false, false, kFull);
    }
  } else {
    if (next) {
      if (use_loc) GDN_REC_PASS(true, true, false);
      else GDN_REC_PASS(true, false, false);
    } else {
      if (use_loc) GDN_REC_PASS(false, true, false);
      else GDN_REC_PASS(false, false, false);
    }
  }
#undef GDN_REC_PASS
}

// The tokens of one group on one column piece (columns [col, col + ncol) of the head).
// src/s_ld: the state before the group's first token, pointing at column col (the start
// slot, or loc after an earlier group). keep: the row has tokens after this group; the
// state after the group's last token is then left in loc.
// Between tokens the state continues in f32: from loc (bf16 pool, or a slot written with
// non-temporal stores, which must not be read back), else from the f32 slot just written.
// LD: loc's row stride (the block's width; 16-column pieces of a narrow tail keep kRecBlock).
template <int NV, bool kFull, int LD, class A, class ST, class Src>
inline void rec_group_block(const RecGroup<A, ST>& g, const Src* src, int64_t s_ld, int64_t K, int64_t V,
                            int64_t col, int ncol, bool keep, float* loc, const ST* pf, int64_t pf_ld,
                            const ST* pf2) {
  constexpr bool kF32 = std::is_same<ST, float>::value;
  constexpr bool kPair = rec_pairs<NV, kFull, ST>();  // the pool block, v and o; loc as it is
  constexpr int U = rec_unit<kPair>();
  // A bf16 start block is widened once, into loc, and the first pass reads that copy; in the
  // pair order widening costs less than the copy's stores and loads, and the pass reads the
  // slot again (ffi/README.md, "The pair order for a bf16 state on AVX2"). So does AVX-512 in
  // both orders (kRecStashBf16; its plain-order pieces, 16-column tails, widen with one shift of
  // a zero-extending load; Zen 5: 3-6% less time from the LLC; the same bits either way).
  constexpr bool kStash = kRecStashBf16 && !std::is_same<Src, float>::value && !kPair;
  static_assert(!kStash || LD == kRecBlock, "rec_kv stashes with the narrow blocks' row stride");
  VF kv[NV], o[NV], d[NV];
  // Where the next block's rows are prefetched: an f32 decode row (one token) in wide blocks
  // shares each row's lines between rec_kv (the first half) and its pass (the rest); otherwise
  // the token passes take whole rows in turns (rec_pass). AVX2's 32-column blocks measured 1.03x
  // that way on a Zen 4 (kernel_ab --isa avx2) and keep the passes' prefetch.
  constexpr bool kKvPair = kPair && std::is_same<Src, bf16>::value;
  constexpr bool kKvPf = kF32 && kRecWideVF > 0 && NV == kRecWideVF;
  const bool kv_pf = kKvPf && g.n == 1 && pf != nullptr;
  if (kv_pf) {
    if constexpr (kKvPf) rec_kv<NV, kFull, kStash, kKvPair, true>(src, s_ld, K, g.kh[0], ncol, kv, loc, pf, pf_ld);
  } else {
    rec_kv<NV, kFull, kStash, kKvPair, false>(src, s_ld, K, g.kh[0], ncol, kv, loc, pf, pf_ld);
  }
  bool prev_loc = false;
  for (int t = 0; t < g.n; ++t) {
    const VF va = vset1(g.alpha[t]), vb = vset1(g.beta[t]);
    for (int c = 0; c < NV; c += U) {
      rec_ld<U, kFull, kPair>(g.v[t] + col + c * kLanes, ncol, d + c);
      for (int u = 0; u < U; ++u) d[c + u] = vb * (d[c + u] - va * kv[c + u]);
    }
    const bool next = t + 1 < g.n;
    const bool nt = kFull && g.nt[t];
    const bool use_loc = (next && (!kF32 || nt)) || (!next && keep);
    const float* khn = next ? g.kh[t + 1] : nullptr;
    ST* dst = g.dst[t] + col;
    if (t == 0) {
      if constexpr (kStash)  // loc -> loc in place, as below
        rec_pass_any<NV, kFull, kPair, LD>(next, use_loc, nt, static_cast<const float*>(loc), LD, dst, V, loc, K,
                                       g.alpha[t], d, g.kh[t], g.qh[t], khn, ncol, o, kv, pf, pf_ld, pf2, 0, g.n, kv_pf);
      else
        rec_pass_any<NV, kFull, kPair, LD>(next, use_loc, nt, src, s_ld, dst, V, loc, K, g.alpha[t], d, g.kh[t], g.qh[t],
                                       khn, ncol, o, kv, pf, pf_ld, pf2, 0, g.n, kv_pf);
    } else {
      // loc -> loc in place is safe: each row k is read before it is written.
      const float* cont = prev_loc ? loc : reinterpret_cast<const float*>(g.dst[t - 1] + col);
      const int64_t cont_ld = prev_loc ? LD : V;
      rec_pass_any<NV, kFull, kPair, LD>(next, use_loc, nt, cont, cont_ld, dst, V, loc, K, g.alpha[t], d, g.kh[t],
                                     g.qh[t], khn, ncol, o, kv, pf, pf_ld, pf2, t, g.n, kv_pf);
    }
    for (int c = 0; c < NV; c += U) rec_st<U, kFull, kPair>(g.o[t] + col + c * kLanes, o + c, ncol);
    prev_loc = use_loc;
  }
}

// One column block (w <= kRecBlock columns from col, or a wide block of kRecWide): a full block
// in one pass per token, a narrower tail as 16-column pieces (same per-column arithmetic).
// pf: see rec_pass (full blocks only).
template <class A, class ST, class Src>
inline void rec_block(const RecGroup<A, ST>& g, const Src* src, int64_t s_ld, int64_t K, int64_t V, int64_t col,
                      int64_t w, bool keep, float* loc, const ST* pf, int64_t pf_ld, const ST* pf2) {
  if constexpr (kRecWideVF > 0) {
    if (w == kRecWide) {
      rec_group_block<kRecWideVF, true, kRecWide>(g, src, s_ld, K, V, col, kLanes, keep, loc, pf, pf_ld, pf2);
      return;
    }
  }
  if (w == kRecBlock) {
    rec_group_block<kRecBlockVF, true, kRecBlock>(g, src, s_ld, K, V, col, kLanes, keep, loc, pf, pf_ld, pf2);
    return;
  }
  const ST* no_pf = nullptr;
  for (int64_t off = 0; off < w; off += kLanes) {
    const int64_t n = rec_min(kLanes, w - off);
    if (n == kLanes)
      rec_group_block<1, true, kRecBlock>(g, src + off, s_ld, K, V, col + off, kLanes, keep, loc + off, no_pf, V, no_pf);
    else
      rec_group_block<1, false, kRecBlock>(g, src + off, s_ld, K, V, col + off, int(n), keep, loc + off, no_pf, V,
                                           no_pf);
  }
}

// q̂ = q * scale (* rsqrt(sum q^2 + eps) with l2norm), k̂ likewise without the scale.
template <class A>
inline void rec_prep(const A* x, int64_t K, float mul, bool l2norm, float eps, float* out) {
  float f = mul;
  if (l2norm) {
    VF ss = vzero();
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) {
      const VF xv = vload(x + k);
      ss = vfma(xv, xv, ss);
    }
    if (k < K) {
      const VF xv = vload_n(x + k, int(K - k));
      ss = vfma(xv, xv, ss);
    }
    f = mul * (1.f / std::sqrt(vsum(ss) + eps));
  }
  const VF vf = vset1(f);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) vstore(out + k, vload(x + k) * vf);
  if (k < K) vstore_n(out + k, vload_n(x + k, int(K - k)) * vf, int(K - k));
}

template <class A, class ST>
void recurrent_impl(const RecurrentArgs& p, const Parallel& par) {
  const A* q = static_cast<const A*>(p.q);
  const A* k = static_cast<const A*>(p.k);
  const A* v = static_cast<const A*>(p.v);
  const A* ga = static_cast<const A*>(p.a);
  const A* gb = static_cast<const A*>(p.b);
  ST* pool = static_cast<ST*>(p.ssm_state);
  A* o = static_cast<A*>(p.o);
  const int32_t* qsl = p.query_start_loc;
  const int32_t* idx = p.state_indices;
  const int64_t S = p.S, H = p.H, HV = p.HV, K = p.K, V = p.V, T = p.T, cols = p.index_cols;
  const int64_t G = HV / H, qk_ld = qk_row_stride(p), v_ld = v_row_stride(p);
  const int64_t head_elems = K * V;
  // Head-ahead prefetch (below) for a bf16 state's decode rows; an f32 state measured no gain (at
  // the bandwidth), spec rows (the next block prefetched over their token passes) lost.
  constexpr bool kAhead = kRecHeadAhead && std::is_same<ST, bf16>::value;

  // Tokens no row covers: zero output.
  const int64_t covered = S > 0 ? int64_t(qsl[S]) : 0;
  if (covered < T) std::memset(o + covered * HV * V, 0, size_t((T - covered) * HV * V) * sizeof(A));
  if (S == 0 || HV == 0 || V == 0) return;

  // Column blocks per head, split so that small batches still give every thread work.
  const int64_t nblk = (V + kRecBlock - 1) / kRecBlock;
  const int64_t want = 4 * int64_t(par.num_threads > 0 ? par.num_threads : 1);
  int64_t nsplit = (want + S * HV - 1) / (S * HV);
  if (nsplit > nblk) nsplit = nblk;
  if (nsplit < 1) nsplit = 1;
  const int64_t items = S * HV * nsplit;
  // A slot other than the start slot is written without being read: non-temporal stores
  // save the read-for-ownership of its lines. Full pieces are then aligned to their store
  // (16 lanes; a bf16 state's pair-order unit on AVX-512, 64 bytes: 32 columns).
  constexpr int64_t kStreamCols = kLanes * (rec_pairs<kRecBlockVF, true, ST>() ? kPairVF : 1);
  const bool stream = reinterpret_cast<uintptr_t>(p.ssm_state) % 64 == 0 && V % kStreamCols == 0;

  par(items, 1, [&](int64_t it0, int64_t it1) {
    RecGroup<A, ST> g;
    alignas(64) float loc[kRecMaxDim * kRecLocCols];
    for (int64_t it = it0; it < it1; ++it) {
      const int64_t i = it / (HV * nsplit);
      const int64_t h = (it / nsplit) % HV;
      const int64_t sp = it % nsplit;
      const int64_t c0 = (nblk * sp / nsplit) * kRecBlock;
      const int64_t c1 = rec_min(V, (nblk * (sp + 1) / nsplit) * kRecBlock);
      const int64_t j0 = qsl[i], nq = int64_t(qsl[i + 1]) - j0;
      if (nq <= 0 || c0 >= c1 || !p.rows.owns(i)) continue;
      const int32_t* row = idx + i * cols;
      if (row[0] == -1) {  // padding row: zero output, nothing read or written
        for (int64_t t = 0; t < nq; ++t)
          std::memset(o + ((j0 + t) * HV + h) * V + c0, 0, size_t(c1 - c0) * sizeof(A));
        continue;
      }
      const int64_t kh_idx = h / G;
      const int32_t acc = p.num_accepted[i];
      const ST* start = pool + (int64_t(row[acc - 1]) * HV + h) * head_elems;
      const float neg_decay = -std::exp(p.A_log[h]);
      const float dtb = p.dt_bias[h];

      auto prepare = [&](int64_t t0, int n) {
        g.n = n;
        for (int u = 0; u < n; ++u) {
          const int64_t t = t0 + u, j = j0 + t;
          const float gl = neg_decay * softplus(to_f32(ga[j * HV + h]) + dtb);
          g.alpha[u] = std::exp(gl);
          g.beta[u] = sigmoid(to_f32(gb[j * HV + h]));
          g.v[u] = v + j * v_ld + h * V;
          g.o[u] = o + (j * HV + h) * V;
          g.dst[u] = pool + (int64_t(row[t]) * HV + h) * head_elems;
          g.nt[u] = stream && row[t] != row[acc - 1];
          rec_prep(q + j * qk_ld + kh_idx * K, K, p.scale, p.l2norm, p.eps, g.qh[u]);
          rec_prep(k + j * qk_ld + kh_idx * K, K, 1.f, p.l2norm, p.eps, g.kh[u]);
        }
      };
      const bool one_group = nq <= kRecTokGroup;
      if (one_group) prepare(0, int(nq));

      // Wide blocks (kRecWide columns, AVX-512) where the columns allow, except for a bf16 state's
      // rows of several tokens: their f32 copy between tokens (loc, 64 KiB for a 128 x 128 head)
      // would leave L1 (ffi/README.md, Recurrent decode / spec, "Wide blocks").
      const bool wide = kRecWideVF > 0 && (std::is_same<ST, float>::value || nq == 1);
      // The next item is this row's next head (one slot holds a row's HV heads in order); the
      // previous item was this row's previous head, so its passes prefetched this one.
      const bool next_head = it + 1 < it1 && nsplit == 1 && h + 1 < HV;
      const bool head_fetched = it > it0 && h > 0;
      for (int64_t col = c0, w = 0; col < c1; col += w) {
        const bool wide_block = wide && c1 - col >= kRecWide;
        const int64_t bw = wide_block ? kRecWide : kRecBlock;
        w = rec_min(bw, c1 - col);
        // Prefetch targets (rec_prefetch.h): head-ahead for a bf16 decode row, else the next block.
        const RecPrefetch tg = rec_prefetch_targets(kAhead && nsplit == 1 && nq == 1, K, V, kRecBlock, col, w, bw,
                                                    c1, next_head, head_fetched);
        const ST* pf = tg.pf < 0 ? nullptr : start + tg.pf;
        const ST* pf2 = tg.pf2 < 0 ? nullptr : start + tg.pf2;
        const int64_t pf_ld = tg.pf_ld;
        for (int64_t t0 = 0; t0 < nq; t0 += kRecTokGroup) {
          const int n = int(rec_min(kRecTokGroup, nq - t0));
          if (!one_group) prepare(t0, n);
          const bool keep = t0 + n < nq;  // then the group leaves its state in loc (row stride bw)
          if (t0 == 0) rec_block(g, start + col, V, K, V, col, w, keep, loc, pf, pf_ld, pf2);
          else rec_block(g, static_cast<const float*>(loc), bw, K, V, col, w, keep, loc,
                         static_cast<const ST*>(nullptr), V, static_cast<const ST*>(nullptr));
        }
      }
    }
    if (stream) vstream_fence();
  });
}

inline void recurrent(const RecurrentArgs& p, const Parallel& par) {
  if (p.act == DType::bf16) {
    if (p.state == DType::bf16) recurrent_impl<bf16, bf16>(p, par);
    else recurrent_impl<bf16, float>(p, par);
  } else {
    if (p.state == DType::bf16) recurrent_impl<float, bf16>(p, par);
    else recurrent_impl<float, float>(p, par);
  }
}
