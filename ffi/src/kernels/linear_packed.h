// Dense projection over a packed w (gdn_jax.ops.pack_linear_weight): y[t, o] = sum_i x[t, i] *
// w[o, i], f32 accumulation, one rounding to y's dtype. Included inside the ISA namespace,
// after linear.h.
//
// wp [ceil(out / 16), ceil(in / 2), 16, 2] bf16, wp[b, p, j, k] = w[16 b + j, 2 p + k], zero
// past `out` and `in`: block b holds 16 consecutive outputs, one vector lane each, as one
// contiguous stream along `in`; pair p of a block is the 64 bytes vdpbf16ps takes. A tile of MT
// x rows by NB blocks broadcasts each x pair to 16 lanes, so one w vector serves MT rows and
// one x pair NB * 16 outputs (the [out, in] kernel reuses an x vector for NT outputs only and
// reduces every partial sum across lanes at the end; here lane j is output j's whole sum).
// Every output is summed in one order, pair by pair along `in` (element 2p + 1's product, then
// 2p's), whatever the tile, block or thread. Several packed w of one x (LinearPackedArgs' parts)
// run as one: their items laid end to end in one fork (a part's output has the bits it has
// alone), and on AMX x is copied into tile order once for all of them.

constexpr int kPackBlock = 16;  // outputs per block: one VF
// x rows per tile; blocks per tile by step (PackedDotStep::kNB, PackedFmaStep::kNB).
constexpr int kPackedMT = kLinearRegs >= 21 ? 8 : kLinearRegs >= 8 ? 4 : 2;

// w's pairs widened exactly (a shift, a mask), x f32 or bf16: two f32 FMAs per pair.
struct PackedFmaStep {
  static constexpr int kNB = kLinearRegs >= 21 ? 2 : 1;
  // As the dot step's, with 2 blocks' streams per tile and in tiles of 4 rows and more: one
  // stream, or fewer rows, the hardware prefetcher follows, and the prefetches cost
  // (ffi/README.md, "Projections (linear)").
  static constexpr int64_t kPrefetchW = kNB >= 2 ? 1024 : 0;
  static constexpr int kPrefetchMinRows = 4;
  struct W {
    VF even, odd;
  };
  struct X {
    VF x0, x1;
  };
  static W load_w(const bf16* p) {
    W w;
    vload_pair_split(p, &w.even, &w.odd);
    return w;
  }
  template <class TX>
  static X load_x(const TX* p) { return {vset1(to_f32(p[0])), vset1(to_f32(p[1]))}; }
  static VF madd(VF acc, const W& w, const X& x) { return vfma(w.even, x.x0, vfma(w.odd, x.x1, acc)); }
};
#if defined(GDN_BF16_DOT)
// bf16 x and w on the bf16 dot product: one instruction per pair, the FMAs' sums (each pair's
// sum rounded once more on NEON BF16). 3 blocks with 32 vector registers; 1 on NEON (a VF is
// four q registers: 4 rows x 1 block = 16 accumulators, 4 w, 1 x).
struct PackedDotStep {
  static constexpr int kNB = kLinearRegs >= 21 ? 3 : 1;
  // 2 KiB ahead on each block's stream, into L2: with w from memory (decode) the 3 streams'
  // dots run ahead of the hardware prefetcher otherwise; one stream (NEON) it follows, as on the
  // FMA step (ffi/README.md, "Projections (linear)").
  static constexpr int64_t kPrefetchW = kNB >= 2 ? 1024 : 0;
  static constexpr int kPrefetchMinRows = 1;
  using W = VB;
  using X = VB;
  static W load_w(const bf16* p) { return vload_b(p); }
  static X load_x(const bf16* p) { return vbcast_b_pair(p); }
  static VF madd(VF acc, W w, X x) { return vdot_bf16(acc, w, x); }
};
#endif

// The vector step for bf16 x: the dot product where the ISA has one (the tile model's unit has
// generic vectors: FMAs).
using PackedBf16Step =
#if defined(GDN_BF16_DOT)
    PackedDotStep;
#else
    PackedFmaStep;
#endif

// Rows [0, MT) of x (row stride `in`) by blocks [0, NB) of wb (block stride `bstride`
// elements): the tile's sums, stored to y (row stride `out`) for outputs [o0, out). `stream`:
// the item's first tile, which brings the blocks from memory (the others find them in L2).
template <int MT, int NB, class Step, class TX, class TY>
inline void packed_tile(const TX* x, const bf16* wb, int64_t bstride, TY* y, int64_t in, int64_t out, int64_t o0,
                        bool stream) {
  VF acc[MT][NB];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NB; ++n) acc[m][n] = vzero();
  const int64_t pairs = in / 2;
  for (int64_t p = 0; p < pairs; ++p) {
    typename Step::W wv[NB];
    if constexpr (Step::kPrefetchW > 0 && MT >= Step::kPrefetchMinRows) {
      if (stream)  // past the block's end: a prefetch does not fault
        for (int n = 0; n < NB; ++n) __builtin_prefetch(wb + n * bstride + 2 * kPackBlock * p + Step::kPrefetchW, 0, 2);
    }
    for (int n = 0; n < NB; ++n) wv[n] = Step::load_w(wb + n * bstride + 2 * kPackBlock * p);
    for (int m = 0; m < MT; ++m) {
      const typename Step::X xv = Step::load_x(x + m * in + 2 * p);
      for (int n = 0; n < NB; ++n) acc[m][n] = Step::madd(acc[m][n], wv[n], xv);
    }
  }
  if (in & 1) {  // the last pair: x's element and a zero (w's is zero by the packing)
    typename Step::W wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = Step::load_w(wb + n * bstride + 2 * kPackBlock * pairs);
    for (int m = 0; m < MT; ++m) {
      const TX pair[2] = {x[m * in + in - 1], TX{}};
      const typename Step::X xv = Step::load_x(pair);
      for (int n = 0; n < NB; ++n) acc[m][n] = Step::madd(acc[m][n], wv[n], xv);
    }
  }
  for (int n = 0; n < NB; ++n) {
    const int64_t o = o0 + n * kPackBlock;
    const int64_t left = out - o;
    for (int m = 0; m < MT; ++m) {
      if (left >= kPackBlock) vstore(y + m * out + o, acc[m][n]);
      else vstore_n(y + m * out + o, acc[m][n], int(left));
    }
  }
}

// One tile of `rows` (1 .. kPackedMT - 1) x rows: the rows left after the full tiles.
template <int NB, class Step, int MT = kPackedMT - 1, class TX, class TY>
inline void packed_tile_left(int rows, const TX* x, const bf16* wb, int64_t bstride, TY* y, int64_t in, int64_t out,
                             int64_t o0, bool stream) {
  if constexpr (MT >= 1) {
    if (rows == MT) return packed_tile<MT, NB, Step>(x, wb, bstride, y, in, out, o0, stream);
    packed_tile_left<NB, Step, MT - 1>(rows, x, wb, bstride, y, in, out, o0, stream);
  }
}

// Rows [t0, t1) by blocks [b0, b0 + nb), nb <= Step::kNB: tiles of kPackedMT rows, then one
// tile of the rows left.
template <int NB, class Step, class TX, class TY>
inline void packed_rows(const TX* x, const bf16* wp, int64_t bstride, TY* y, int64_t in, int64_t out, int64_t t0,
                        int64_t t1, int64_t b0) {
  const bf16* wb = wp + b0 * bstride;
  const int64_t o0 = b0 * kPackBlock;
  int64_t t = t0;
  for (; t + kPackedMT <= t1; t += kPackedMT)
    packed_tile<kPackedMT, NB, Step>(x + t * in, wb, bstride, y + t * out, in, out, o0, t == t0);
  const int left = int(t1 - t);
  if (left > 0) packed_tile_left<NB, Step>(left, x + t * in, wb, bstride, y + t * out, in, out, o0, t == t0);
}

// Rows [t0, t1) by blocks [b0, b0 + nb), any nb: tiles of Step::kNB blocks, then the rest.
template <class Step, class TX, class TY>
inline void packed_rows_n(const TX* x, const bf16* wp, int64_t bstride, TY* y, int64_t in, int64_t out, int64_t t0,
                          int64_t t1, int64_t b0, int64_t nb) {
  constexpr int NB = Step::kNB;
  for (; nb >= NB; b0 += NB, nb -= NB) packed_rows<NB, Step>(x, wp, bstride, y, in, out, t0, t1, b0);
  if constexpr (NB > 2) {
    if (nb == 2) return packed_rows<2, Step>(x, wp, bstride, y, in, out, t0, t1, b0);
  }
  if (nb == 1) packed_rows<1, Step>(x, wp, bstride, y, in, out, t0, t1, b0);
}

inline int64_t packed_blocks(int64_t out) { return (out + kPackBlock - 1) / kPackBlock; }

// The parts' work items laid end to end: part s owns items [first[s], first[s + 1]) (none when
// its out is 0).
struct PartItems {
  int64_t first[kMaxLinearParts + 1];
  int n;
  int64_t total() const { return first[n]; }
  int part(int64_t i) const {  // the part of item i < total()
    int s = 0;
    while (i >= first[s + 1]) ++s;
    return s;
  }
};
template <class F>
inline PartItems part_items(const LinearPackedArgs& p, F items_of_out) {
  PartItems it{{0}, p.n_parts};
  for (int s = 0; s < p.n_parts; ++s) it.first[s + 1] = it.first[s] + items_of_out(p.parts[s].out);
  return it;
}

template <class Step, class TX, class TY>
void linear_packed_steps(const LinearPackedArgs& p, const Parallel& par) {
  const TX* x = static_cast<const TX*>(p.x);
  const int64_t T = p.T, in = p.in;
  constexpr int NB = Step::kNB;
  const int64_t bstride = (in + 1) / 2 * 2 * kPackBlock;
  // Work items: NB blocks (one tile's width) by 64 x rows. At prefill a thread's consecutive
  // items share the blocks, which stay in L2 while the x rows pass; at decode (one row block)
  // each item streams its blocks from memory once.
  const int64_t tb = 64, n_tb = (T + tb - 1) / tb;
  const PartItems items = part_items(p, [&](int64_t out) { return (packed_blocks(out) + NB - 1) / NB * n_tb; });
  if (items.total() == 0) return;
  par(items.total(), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int s = items.part(i);
      const LinearPart& q = p.parts[s];
      const int64_t j = i - items.first[s], n_blocks = packed_blocks(q.out);
      const int64_t b0 = (j / n_tb) * NB, t0 = (j % n_tb) * tb, t1 = t0 + tb < T ? t0 + tb : T;
      packed_rows_n<Step>(x, static_cast<const bf16*>(q.w), bstride, static_cast<TY*>(q.y), in, q.out, t0, t1, b0,
                          n_blocks - b0 < NB ? n_blocks - b0 : NB);
    }
  });
}

#if defined(GDN_AMX)
// bf16 x on AMX tiles. A block's pairs 16d .. 16d + 15 are 16 rows of 64 bytes (16 outputs x
// one pair): the VNNI B operand of tdpbf16ps as packed, so B tiles load straight from wp
// (stride 64 B). A tiles are 16 x rows by 32 elements of `in`: straight from x for decode-sized
// T, from x packed into tile order (amx_pack_x) for prefill-sized T. 2 x 2 C tiles (32 rows x 2
// blocks, tmm0..3), A in tmm4, 5, B in tmm6, 7, all configured 16 rows x 64 bytes. The depth
// tail (in % 32) goes through zero-padded copies of B (in place, B would read past the block's
// last pair: the next block, or past wp) and of an unpacked A (which would read into the next x
// row). Every output is summed in one order, 32 elements of `in` at a time (tdpbf16ps: even and
// odd products in two f32 FMA chains, then both added to C), whatever the tile, path or thread.
// Rows left after the 16-row tiles of a decode-sized T take a tile of their own height when
// there are kAmxMinRows of them, else the vector step (another order; the split depends only
// on T).

constexpr int64_t kAmxDepth = 2 * kTileRows;  // elements of `in` per step: 16 pairs
static_assert(kAmxTileElems == kTileRows * kAmxDepth, "a packed A tile: 16 rows of one step (amx_gemm.h)");

// Where a tile's A rows are: row tile 0's depth step d at a + d * step, rows `stride` bytes
// apart, row tile 1 `tile2` elements after row tile 0; padded: zero past `in` (packed x).
struct AmxRows {
  const bf16* a;
  int64_t step, stride, tile2;
  bool padded;
};

// Rows [0, rows) of A by blocks [0, nb) of wb, nb in {1, 2}: rows 16 or 32 (one or two row
// tiles) under the full configuration, or rows < 16 (one row tile) under amx_rows_config(rows)
// for unpacked A; packed A has zero rows past `rows`, so any rows <= 32 run on full tiles.
template <class TY>
inline void amx_packed_tile(int rows, int nb, const AmxRows& A, const bf16* wb, int64_t bstride, TY* y, int64_t in,
                            int64_t out, int64_t o0, const char* pf = nullptr, int64_t pf_lines = 0) {
  const int mt = rows > kTileRows ? 2 : 1;  // row tiles
  tile_zero<0>();
  tile_zero<1>();
  tile_zero<2>();
  tile_zero<3>();
  const auto step = [&](const bf16* a, int64_t a_stride, const bf16* a2, const bf16* b0, const bf16* b1) {
    tile_load<4>(a, a_stride);
    tile_load<6>(b0, 2 * kPackBlock * int64_t(sizeof(bf16)));
    tile_dpbf16ps<0, 4, 6>();
    if (nb == 2) {
      tile_load<7>(b1, 2 * kPackBlock * int64_t(sizeof(bf16)));
      tile_dpbf16ps<1, 4, 7>();
    }
    if (mt == 2) {
      tile_load<5>(a2, a_stride);
      tile_dpbf16ps<2, 5, 6>();
      if (nb == 2) tile_dpbf16ps<3, 5, 7>();
    }
  };
  const int64_t full = in / kAmxDepth, pair_elems = 2 * kPackBlock;
  const int64_t pf_per_step = full > 0 ? (pf_lines + full - 1) / full : 0;
  for (int64_t d = 0; d < full; ++d) {
    for (int64_t l = d * pf_per_step; l < std::min(pf_lines, (d + 1) * pf_per_step); ++l)
      __builtin_prefetch(pf + 64 * l, 0, 2);
    const bf16* a = A.a + d * A.step;
    step(a, A.stride, a + A.tile2, wb + d * kTileRows * pair_elems,
         wb + (nb == 2 ? bstride : 0) + d * kTileRows * pair_elems);
  }
  if (const int64_t rem = in - full * kAmxDepth; rem > 0) {
    alignas(64) bf16 b[2][kTileRows * 2 * kPackBlock];
    std::memset(static_cast<void*>(b), 0, sizeof b);
    const int64_t pairs = (rem + 1) / 2;  // the packing's zero pads an odd `in`
    for (int n = 0; n < nb; ++n)
      std::memcpy(b[n], wb + n * bstride + full * kTileRows * pair_elems, size_t(pairs * pair_elems) * sizeof(bf16));
    if (A.padded) {
      const bf16* a = A.a + full * A.step;
      step(a, A.stride, a + A.tile2, b[0], b[1]);
    } else {  // unpacked: row r at A.a + r * stride
      alignas(64) bf16 a[2 * kTileRows][kAmxDepth];
      std::memset(static_cast<void*>(a), 0, sizeof a);
      for (int r = 0; r < rows; ++r)
        std::memcpy(a[r], A.a + r * (A.stride / int64_t(sizeof(bf16))) + full * A.step, size_t(rem) * sizeof(bf16));
      step(&a[0][0], kAmxDepth * int64_t(sizeof(bf16)), &a[kTileRows][0], b[0], b[1]);
    }
  }
  alignas(64) float stage[2 * kTileRows][2 * kPackBlock];
  constexpr int64_t ld = 2 * kPackBlock * int64_t(sizeof(float));
  tile_store<0>(&stage[0][0], ld);
  if (nb == 2) tile_store<1>(&stage[0][kPackBlock], ld);
  if (mt == 2) tile_store<2>(&stage[kTileRows][0], ld);
  if (mt == 2 && nb == 2) tile_store<3>(&stage[kTileRows][kPackBlock], ld);
  for (int n = 0; n < nb; ++n) {
    const int64_t o = o0 + n * kPackBlock, left = out - o;
    for (int r = 0; r < rows; ++r) {
      const VF v = vload(&stage[r][n * kPackBlock]);
      if (left >= kPackBlock) vstore(y + r * out + o, v);
      else vstore_n(y + r * out + o, v, int(left));
    }
  }
}

// Unpacked x rows from row t: 16-row tiles `in` elements apart per row.
inline AmxRows amx_x_rows(const bf16* x, int64_t in, int64_t t) {
  return {x + t * in, kAmxDepth, in * int64_t(sizeof(bf16)), kTileRows * in, false};
}

// Fewest rows left after the 16-row tiles that take a tile of their own height.
constexpr int64_t kAmxMinRows = 5;
static_assert(kAmxMinRows <= kTileRows, "rows left after the 16-row tiles are fewer than 16");

// The configuration of a short row tile: C (tmm0..3) and A (tmm4, 5) `rows` high, B (tmm6, 7) the
// full 16 pairs of depth.
inline AmxTileConfig amx_rows_config(int rows) {
  AmxTileConfig c = amx_config(kTiles, rows, kTileColsB);
  c.rows[6] = c.rows[7] = uint8_t(kTileRows);
  return c;
}

// Items of 2 blocks by 64 x rows as linear_packed_steps: 32-row tile pairs, a 16-row tile, then
// the rows left on a short tile (kAmxMinRows or more) or the vector step.
template <class TY>
void linear_packed_amx(const LinearPackedArgs& p, const Parallel& par) {
  const bf16* x = static_cast<const bf16*>(p.x);
  const int64_t T = p.T, in = p.in;
  const int64_t bstride = (in + 1) / 2 * 2 * kPackBlock;
  const int64_t tb = 64, n_tb = (T + tb - 1) / tb;
  const PartItems items = part_items(p, [&](int64_t out) { return (packed_blocks(out) + 1) / 2 * n_tb; });
  if (items.total() == 0) return;
  // Every item's short tile has the same height (the last row block's rows past its 16-row
  // tiles; T < 16: all of them): a thread loads a configuration again only where its items
  // switch between full and short tiles.
  const int64_t left = (T - (n_tb - 1) * tb) % kTileRows;
  const bool short_tiles = left >= kAmxMinRows;
  const AmxTileConfig full_cfg = amx_config(kTiles, kTileRows, kTileColsB);
  const AmxTileConfig short_cfg = amx_rows_config(short_tiles ? int(left) : kTileRows);
  par(items.total(), 1, [&](int64_t i0, int64_t i1) {
    const AmxTileConfig* loaded = nullptr;
    const auto use = [&](const AmxTileConfig* cfg) {
      if (loaded != cfg) tile_loadconfig(cfg);
      loaded = cfg;
    };
    for (int64_t i = i0; i < i1; ++i) {
      const int s = items.part(i);
      const int64_t j = i - items.first[s], out = p.parts[s].out, n_blocks = packed_blocks(out);
      const bf16* wp = static_cast<const bf16*>(p.parts[s].w);
      TY* y = static_cast<TY*>(p.parts[s].y);
      const int64_t b0 = (j / n_tb) * 2, t0 = (j % n_tb) * tb, t1 = t0 + tb < T ? t0 + tb : T;
      const int nb = n_blocks - b0 < 2 ? 1 : 2;
      const bf16* wb = wp + b0 * bstride;
      int64_t t = t0;
      for (; t + kTileRows <= t1; t += 2 * kTileRows) {
        use(&full_cfg);
        const int mt = t + 2 * kTileRows <= t1 ? 2 : 1;
        amx_packed_tile(kTileRows * mt, nb, amx_x_rows(x, in, t), wb, bstride, y + t * out, in, out, b0 * kPackBlock);
        if (mt == 1) {
          t += kTileRows;
          break;
        }
      }
      if (t < t1 && short_tiles) {
        use(&short_cfg);
        amx_packed_tile(int(t1 - t), nb, amx_x_rows(x, in, t), wb, bstride, y + t * out, in, out, b0 * kPackBlock);
      } else if (t < t1) {
        packed_rows_n<PackedBf16Step>(x, wp, bstride, y, in, out, t, t1, b0, nb);
      }
    }
    if (loaded != nullptr) tile_release();
  });
}

// Prefill-sized T: x packed into tile order once per panel of rows (a fork of its own), then
// the tiles. Unpacked, a tile's 16 A rows are `in` elements apart (in = 2048: 4 KiB, one L1
// set), and once x outgrows L2 every block pair's pass takes A from L3, where tile loads run at
// a fraction of their L2 rate. Packed, a row pair's A is one contiguous run; an item is a row
// pair by a group of block pairs whose w (at most kAmxGroupBytes) stays in L2 for the thread's
// next items (the next row pairs), so A comes from L3 once per group instead of once per block
// pair, and the next row pair's A is prefetched into L2 while an item runs (ffi/README.md,
// AMX-BF16, "Prefill-sized T").
constexpr int64_t kAmxPackMinXBytes = int64_t(2) << 20;  // x past one core's L2
constexpr int64_t kAmxPanelBytes = int64_t(8) << 20;     // packed x at a time: 2048 rows at in = 2048
constexpr int64_t kAmxGroupBytes = int64_t(1) << 20;     // w of an item's block pairs: half the L2

// Row tiles [rt0, rt1) of rows [0, rows) of x into tile order: xp[rt][d][r][e] = x[16 rt + r,
// 32 d + e], zero past `rows` and past `in`; nd = ceil(in / 32) depth steps.
inline void amx_pack_x(const bf16* x, int64_t in, int64_t rows, int64_t nd, int64_t rt0, int64_t rt1, bf16* xp) {
  const int64_t full = in / kAmxDepth, rem = in - full * kAmxDepth;
  for (int64_t rt = rt0; rt < rt1; ++rt)
    for (int r = 0; r < kTileRows; ++r) {
      const int64_t t = rt * kTileRows + r;
      bf16* dst = xp + rt * nd * kAmxTileElems + r * kAmxDepth;
      if (t >= rows) {
        for (int64_t d = 0; d < nd; ++d) std::memset(dst + d * kAmxTileElems, 0, kAmxDepth * sizeof(bf16));
        continue;
      }
      const bf16* src = x + t * in;
      for (int64_t d = 0; d < full; ++d)
        std::memcpy(dst + d * kAmxTileElems, src + d * kAmxDepth, kAmxDepth * sizeof(bf16));
      if (rem > 0) {
        std::memset(dst + full * kAmxTileElems, 0, kAmxDepth * sizeof(bf16));
        std::memcpy(dst + full * kAmxTileElems, src + full * kAmxDepth, size_t(rem) * sizeof(bf16));
      }
    }
}

// panel_rows: 0 for kAmxPanelBytes of packed x (whole row pairs, at least one); group_bytes:
// kAmxGroupBytes (the tests pass small ones of both).
template <class TY>
void linear_packed_amx_panels(const LinearPackedArgs& p, const Parallel& par, int64_t panel_rows = 0,
                              int64_t group_bytes = kAmxGroupBytes) {
  const bf16* x = static_cast<const bf16*>(p.x);
  const int64_t T = p.T, in = p.in;
  const int64_t bstride = (in + 1) / 2 * 2 * kPackBlock, nd = (in + kAmxDepth - 1) / kAmxDepth;
  const int64_t pair_bytes = 2 * bstride * int64_t(sizeof(bf16));
  const int64_t row_pair_bytes = 2 * nd * kAmxTileElems * int64_t(sizeof(bf16));  // packed: 2 row tiles
  if (panel_rows <= 0) panel_rows = std::max<int64_t>(1, kAmxPanelBytes / row_pair_bytes) * 2 * kTileRows;
  const int64_t group = std::max<int64_t>(1, group_bytes / pair_bytes);  // block pairs; a part's last group fewer
  const auto n_pairs = [](int64_t out) { return (packed_blocks(out) + 1) / 2; };
  const AmxTileConfig cfg = amx_config(kTiles, kTileRows, kTileColsB);
  // The calling thread's scratch (no allocation per call); the workers fill and read it.
  const int64_t max_rt = (std::min(T, panel_rows) + kTileRows - 1) / kTileRows;
  bf16* xp = thread_scratch<bf16, 6>(max_rt * nd * kAmxTileElems);
  for (int64_t t0 = 0; t0 < T; t0 += panel_rows) {
    const int64_t rows = std::min(panel_rows, T - t0);
    const int64_t n_rt = (rows + kTileRows - 1) / kTileRows, n_rp = (n_rt + 1) / 2;
    const bf16* xt = x + t0 * in;
    par(n_rt, 1, [&](int64_t r0, int64_t r1) { amx_pack_x(xt, in, rows, nd, r0, r1, xp); });
    // Items: a row pair by a group of one part's block pairs, the row pairs of one group
    // consecutive.
    const PartItems items = part_items(p, [&](int64_t out) { return (n_pairs(out) + group - 1) / group * n_rp; });
    par(items.total(), 1, [&](int64_t i0, int64_t i1) {
      tile_loadconfig(&cfg);
      for (int64_t i = i0; i < i1; ++i) {
        const int s = items.part(i);
        const int64_t j = i - items.first[s], out = p.parts[s].out;
        const bf16* wp = static_cast<const bf16*>(p.parts[s].w);
        TY* y = static_cast<TY*>(p.parts[s].y);
        const int64_t n_blocks = packed_blocks(out), q0 = (j / n_rp) * group, q1 = std::min(n_pairs(out), q0 + group);
        const int64_t rp = j % n_rp;
        const int r_rows = int(std::min<int64_t>(2 * kTileRows, rows - rp * 2 * kTileRows));
        const AmxRows A{xp + 2 * rp * nd * kAmxTileElems, kAmxTileElems, kAmxDepth * int64_t(sizeof(bf16)),
                        nd * kAmxTileElems, true};
        // The next item's A (the next row pair; past the last, the first) into L2, spread over
        // this item's tiles. Past a last single row tile the lines lie past xp: a prefetch does
        // not fault.
        const char* next = reinterpret_cast<const char*>(xp + 2 * ((rp + 1) % n_rp) * nd * kAmxTileElems);
        const int64_t a_lines = row_pair_bytes / 64;
        const int64_t per_q = (a_lines + q1 - q0 - 1) / (q1 - q0);
        for (int64_t q = q0; q < q1; ++q) {
          const int64_t b0 = 2 * q, l0 = (q - q0) * per_q;
          amx_packed_tile(r_rows, n_blocks - b0 < 2 ? 1 : 2, A, wp + b0 * bstride, bstride,
                          y + (t0 + rp * 2 * kTileRows) * out, in, out, b0 * kPackBlock, next + 64 * l0,
                          std::max<int64_t>(0, std::min(per_q, a_lines - l0)));
        }
      }
      tile_release();
    });
  }
}
#endif

template <class TX, class TY>
inline void linear_packed_y(const LinearPackedArgs& p, const Parallel& par) {
#if defined(GDN_AMX)
  // From kAmxMinRows rows on tiles (else the vector step's 8 x 3 tile): x past L2 packed first,
  // decode-sized T on short tiles. Both tile paths give the same bits.
  if constexpr (std::is_same_v<TX, bf16>) {
    if (p.T >= kAmxMinRows) {
      if (p.T * p.in * int64_t(sizeof(bf16)) >= kAmxPackMinXBytes) return linear_packed_amx_panels<TY>(p, par);
      return linear_packed_amx<TY>(p, par);
    }
  }
#endif
  if constexpr (std::is_same_v<TX, bf16>) return linear_packed_steps<PackedBf16Step, TX, TY>(p, par);
  linear_packed_steps<PackedFmaStep, TX, TY>(p, par);
}
template <class TX>
inline void linear_packed_x(const LinearPackedArgs& p, const Parallel& par) {
  if (p.y_dtype == DType::bf16) linear_packed_y<TX, bf16>(p, par);
  else linear_packed_y<TX, float>(p, par);
}
// Every part's w is packed bf16.
inline void linear_packed(const LinearPackedArgs& p, const Parallel& par) {
  int64_t outs = 0;
  for (int s = 0; s < p.n_parts; ++s) outs += p.parts[s].out;
  if (p.T == 0 || outs == 0) return;  // nothing to write (and no x to pack)
  if (p.x_dtype == DType::bf16) linear_packed_x<bf16>(p, par);
  else linear_packed_x<float>(p, par);
}
