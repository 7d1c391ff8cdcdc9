// Dense projection y[t, o] = sum_i x[t, i] * w[o, i] (w in Hugging Face's [out, in] layout),
// f32 accumulation, one rounding to y's dtype. Included inside the ISA namespace.
//
// Both operands are contiguous along `in`, so a register tile of MT x rows by NT w rows keeps
// MT * NT vector partial sums (lane j sums the products i = j mod kLanes, in order of i) and
// reduces each with vsum at the end. Every output element is summed in that one order whatever
// the tile, block or thread that computes it, so results do not depend on the thread count.
// Decode (small T): each w row is streamed from memory once and dotted with every x row of the
// block; prefill: an o block of w stays in L2 while the t rows pass over it.

// Vector registers the tile may use (x rows, partial sums, one w temporary).
constexpr int kLinearRegs = kVfRegs == 1 ? 32 :
#if defined(__aarch64__)
                                           32 / kVfRegs;
#else
                                           16 / kVfRegs;
#endif
// (MT, NT) for a block of many x rows and for one row: MT * (NT + 1) + 1 <= kLinearRegs.
constexpr int kLinearMT = kLinearRegs >= 21 ? 4 : kLinearRegs >= 7 ? 2 : 1;
constexpr int kLinearNT = kLinearRegs >= 21 ? 4 : 2;
constexpr int kLinearNT1 = kLinearRegs >= 21 ? 8 : kLinearRegs >= 6 ? 4 : 2;

// How a tile steps along `in`: kElems elements per step, loaded by load / load_n (lanes past n
// zero), multiplied and added into the f32 partial sums by madd; kPrefetchW: how many
// elements ahead the w rows are prefetched (0: not at all).
struct LinearFmaStep {  // f32 FMAs on f32 vectors (bf16 operands widened exactly on load)
  static constexpr int kElems = kLanes;
  static constexpr int64_t kPrefetchW = 0;
  template <class T>
  static VF load(const T* p) { return vload(p); }
  template <class T>
  static VF load_n(const T* p, int n) { return vload_n(p, n); }
  static VF madd(VF acc, VF a, VF b) { return vfma(a, b, acc); }
};
#if defined(GDN_BF16_DOT)
// bf16 x and bf16 w where the ISA has bf16 dot products: the raw bf16 rows, 32 elements per
// step, lane j adding the products of elements 2j + 1 and 2j of each step. The products are
// exact in f32 and every sum is rounded once, as with the FMAs; only the order differs, and it
// is again one fixed order per output element. Twice the products per instruction and no
// widening leave the w rows' arrival as the limit at decode: they are prefetched ~1 KiB ahead
// into L2 (ffi/README.md, "Projections (linear)").
struct LinearDotStep {
  static constexpr int kElems = kDotElems;
  static constexpr int64_t kPrefetchW = 512;
  static VB load(const bf16* p) { return vload_b(p); }
  static VB load_n(const bf16* p, int n) { return vload_b_n(p, n); }
  static VF madd(VF acc, VB a, VB b) { return vdot_bf16(acc, a, b); }
};
#endif

// Whether bf16 x and w take the dot-product step: then the x rows are read as they are, not
// widened per block (linear_block), and the tiles use LinearDotStep (linear_tile).
template <class TX, class TW>
constexpr bool linear_dot() {
#if defined(GDN_BF16_DOT)
  return std::is_same_v<TX, bf16> && std::is_same_v<TW, bf16>;
#else
  return false;
#endif
}

template <int MT, int NT, class Step, class TX, class TW>
inline void linear_tile_steps(const TX* x, const TW* w, int64_t in, float out[MT][NT]) {
  using XV = decltype(Step::load(x));
  using WV = decltype(Step::load(w));
  VF acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) acc[m][n] = vzero();
  int64_t i = 0;
  for (; i + Step::kElems <= in; i += Step::kElems) {
    XV xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = Step::load(x + m * in + i);
    for (int n = 0; n < NT; ++n) {
      if constexpr (Step::kPrefetchW > 0) __builtin_prefetch(w + n * in + i + Step::kPrefetchW, 0, 2);
      const WV wv = Step::load(w + n * in + i);
      for (int m = 0; m < MT; ++m) acc[m][n] = Step::madd(acc[m][n], xv[m], wv);
    }
  }
  if (i < in) {  // zero-padded tail: adds 0 * 0 to the lanes past `in`
    const int r = int(in - i);
    XV xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = Step::load_n(x + m * in + i, r);
    for (int n = 0; n < NT; ++n) {
      const WV wv = Step::load_n(w + n * in + i, r);
      for (int m = 0; m < MT; ++m) acc[m][n] = Step::madd(acc[m][n], xv[m], wv);
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int n = 0; n < NT; ++n) out[m][n] = vsum(acc[m][n]);
}

template <int MT, int NT, class TX, class TW>
inline void linear_tile(const TX* x, const TW* w, int64_t in, float out[MT][NT]) {
#if defined(GDN_BF16_DOT)
  if constexpr (linear_dot<TX, TW>()) {
    linear_tile_steps<MT, NT, LinearDotStep>(x, w, in, out);
    return;
  }
#endif
  linear_tile_steps<MT, NT, LinearFmaStep>(x, w, in, out);
}

// Rows [t0, t0 + MT) x [o0, o1) in tiles of NT w rows (then single rows); xr: x's row t0.
template <int MT, int NT, class TX, class TW, class TY>
inline void linear_rows(const TX* xr, const TW* w, TY* y, int64_t in, int64_t out, int64_t t0, int64_t o0,
                        int64_t o1) {
  float r[MT][NT];
  int64_t o = o0;
  for (; o + NT <= o1; o += NT) {
    linear_tile<MT, NT>(xr, w + o * in, in, r);
    for (int m = 0; m < MT; ++m)
      for (int n = 0; n < NT; ++n) store1(y + (t0 + m) * out + o + n, r[m][n]);
  }
  for (; o < o1; ++o) {
    float r1[MT][1];
    linear_tile<MT, 1>(xr, w + o * in, in, r1);
    for (int m = 0; m < MT; ++m) store1(y + (t0 + m) * out + o, r1[m][0]);
  }
}

// Rows [t0, t1) x [o0, o1): tiles of kLinearMT rows, then single rows; xr: x's row t0.
template <class TX, class TW, class TY>
inline void linear_block_rows(const TX* xr, const TW* w, TY* y, int64_t in, int64_t out, int64_t t0, int64_t t1,
                              int64_t o0, int64_t o1) {
  int64_t t = t0;
  for (; t + kLinearMT <= t1; t += kLinearMT)
    linear_rows<kLinearMT, kLinearNT>(xr + (t - t0) * in, w, y, in, out, t, o0, o1);
  for (; t < t1; ++t) linear_rows<1, kLinearNT1>(xr + (t - t0) * in, w, y, in, out, t, o0, o1);
}
template <class TW, class TY>
inline void linear_block(const float* x, const TW* w, TY* y, int64_t in, int64_t out, int64_t t0, int64_t t1,
                         int64_t o0, int64_t o1) {
  linear_block_rows(x + t0 * in, w, y, in, out, t0, t1, o0, o1);
}
// bf16 x: widened once per block into f32 scratch (exact), so the tiles spend no conversion
// on x rows that every w row of the block reuses; with a bf16 w on a bf16 dot-product ISA the
// tiles read x's bf16 rows as they are.
template <class TW, class TY>
inline void linear_block(const bf16* x, const TW* w, TY* y, int64_t in, int64_t out, int64_t t0, int64_t t1,
                         int64_t o0, int64_t o1) {
  if constexpr (linear_dot<bf16, TW>()) {
    linear_block_rows(x + t0 * in, w, y, in, out, t0, t1, o0, o1);
    return;
  }
  float* xf = thread_scratch<float, 2>((t1 - t0) * in);
  const bf16* src = x + t0 * in;
  const int64_t n = (t1 - t0) * in;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) vstore(xf + i, vload(src + i));
  for (; i < n; ++i) xf[i] = to_f32(src[i]);
  linear_block_rows(xf, w, y, in, out, t0, t1, o0, o1);
}

template <class TX, class TW, class TY>
void linear_impl(const LinearArgs& p, const Parallel& par) {
  const TX* x = static_cast<const TX*>(p.x);
  const TW* w = static_cast<const TW*>(p.w);
  TY* y = static_cast<TY*>(p.y);
  const int64_t T = p.T, in = p.in, out = p.out;
  if (T == 0 || out == 0) return;
  // o blocks of ~128 KiB of w (a few per core's L2), t blocks of 64 rows.
  const int64_t row_bytes = in * int64_t(sizeof(TW));
  int64_t ob = (int64_t(128) << 10) / (row_bytes > 0 ? row_bytes : 1);
  ob = ob < 16 ? 16 : ob > 512 ? 512 : ob;
  ob = (ob / 8) * 8;
  const int64_t tb = 64;
  const int64_t n_ob = (out + ob - 1) / ob, n_tb = (T + tb - 1) / tb;
  par(n_ob * n_tb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = (b / n_tb) * ob, o1 = o0 + ob < out ? o0 + ob : out;
      const int64_t t0 = (b % n_tb) * tb, t1 = t0 + tb < T ? t0 + tb : T;
      linear_block(x, w, y, in, out, t0, t1, o0, o1);
    }
  });
}

template <class TX, class TW>
inline void linear_y(const LinearArgs& p, const Parallel& par) {
  if (p.y_dtype == DType::bf16) linear_impl<TX, TW, bf16>(p, par);
  else linear_impl<TX, TW, float>(p, par);
}
template <class TX>
inline void linear_w(const LinearArgs& p, const Parallel& par) {
  if (p.w_dtype == DType::bf16) linear_y<TX, bf16>(p, par);
  else linear_y<TX, float>(p, par);
}
inline void linear(const LinearArgs& p, const Parallel& par) {
  if (p.x_dtype == DType::bf16) linear_w<bf16>(p, par);
  else linear_w<float>(p, par);
}
