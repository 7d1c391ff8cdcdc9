// Causal depthwise conv1d: varlen prefill (conv_fwd) and decode / spec rolling-buffer
// update (conv_update). Included inside the ISA namespace. Design notes: ffi/README.md,
// "Causal conv1d".
//
// Channels are the SIMD dimension (16 lanes); every output is
//   act(bias + w[0] * x~[t-W+1] + ... + w[W-1] * x~[t])
// accumulated in f32 in that fixed order (bias first, one fma per tap), so its bits do not
// depend on how the work is split into items or threads. For W <= 4 the taps of a
// 16-channel vector and a window of the W-1 previous inputs live in named registers that
// slide down the tokens (each x row is loaded once per run). Other widths (reachable only
// through the raw FFI target; the ops allow 2..4) take a slow generic path.

// GCC leaves the vector primitives (vstore, exp8, ...) out of line in these large template
// functions and passes VF through memory; flatten inlines every call in the item functions.
#ifndef GDN_CONV_HOT
#define GDN_CONV_HOT __attribute__((flatten))
#endif

constexpr int64_t kConvTokBlock = 64;    // prefill item: tokens x kConvChanBlock channels
constexpr int64_t kConvChanBlock = 256;  // channels per item (prefill and update)
constexpr int64_t kConvUpdateRows = 2;   // update item: rows x kConvUpdateChans channels
constexpr int64_t kConvUpdateChans = 1024;  // (one row in a spec call; conv_update_impl)
// An update of at most this many tokens x channels x taps (its own rows' tokens) runs on the
// calling thread alone: a few microseconds of work, less than waking a pool thread costs
// (ffi/README.md, "The update of a few rows").
constexpr int64_t kConvUpdateSerialWork = int64_t(64) << 10;
constexpr int64_t kConvRun = 4;          // tokens per register-window run (prefill, spec update)
constexpr int64_t kConvPrefetchRuns = 2;  // prefill: x rows prefetched this many runs ahead
constexpr int kConvActVecs = 4;           // activation pass: vectors per step (conv_act_rows)

// --- helpers ------------------------------------------------------------------------------

// n (<= 16) channels of one state row: contiguous (SD) or strided (DS).
template <class T>
inline VF conv_load_row(const T* p, int64_t chan_stride, int n) {
  if (chan_stride == 1) return vload_n(p, n);
  float t[kLanes];
  for (int i = 0; i < kLanes; ++i) t[i] = 0.f;
  for (int i = 0; i < n; ++i) t[i] = to_f32(p[i * chan_stride]);
  return vload(t);
}

template <class T>
inline void conv_store_row(T* p, int64_t chan_stride, VF v, int n) {
  if (chan_stride == 1) {
    vstore_n(p, v, n);
    return;
  }
  float t[kLanes];
  vstore(t, v);
  for (int i = 0; i < n; ++i) store1(p + i * chan_stride, t[i]);
}

// Element i of a weight or bias array (f32 or bf16, the model's parameter dtype) as f32.
inline float conv_param(const void* a, DType dt, int64_t i) {
  return dt == DType::bf16 ? to_f32(static_cast<const bf16*>(a)[i]) : static_cast<const float*>(a)[i];
}

// Tap i of channels [c, c+n) from weight [D, W] (lanes >= n are zero). Generic path only.
inline VF conv_tap(const ConvArgs& p, int64_t c, int n, int64_t i) {
  float t[kLanes];
  for (int k = 0; k < kLanes; ++k) t[k] = 0.f;
  for (int k = 0; k < n; ++k) t[k] = conv_param(p.weight, p.weight_dtype, (c + k) * p.W + i);
  return vload(t);
}

// Bias of channels [c, c+n), zero without one. Generic path only.
inline VF conv_bias(const ConvArgs& p, int64_t c, int n) {
  float t[kLanes];
  for (int k = 0; k < kLanes; ++k) t[k] = 0.f;
  if (p.bias)
    for (int k = 0; k < n; ++k) t[k] = conv_param(p.bias, p.bias_dtype, c + k);
  return vload(t);
}

template <int W, class P>
inline void conv_taps_rows(const P* src, int64_t nc, float* wt) {
  for (int i = 0; i < W; ++i)
    for (int64_t c = 0; c < nc; ++c) wt[i * kConvChanBlock + c] = to_f32(src[c * W + i]);
}

// The parameters of channels [c0, c1) as f32 rows kConvChanBlock apart: taps 0 .. W-1
// transposed (wt[i * kConvChanBlock + (c - c0)]), then the bias (zero without one), each
// zero-padded to whole vectors so that a 16-channel tap is one load. Built once per item and
// read in the parameters' own dtype, so a bf16 model needs no converted copy per call.
constexpr int64_t conv_param_rows(int W) { return W + 1; }
template <int W>
inline void conv_params_t(const ConvArgs& p, int64_t c0, int64_t c1, float* wt) {
  const int64_t nc = c1 - c0, padded = (nc + kLanes - 1) / kLanes * kLanes;
  if (p.weight_dtype == DType::bf16) conv_taps_rows<W>(static_cast<const bf16*>(p.weight) + c0 * W, nc, wt);
  else conv_taps_rows<W>(static_cast<const float*>(p.weight) + c0 * W, nc, wt);
  float* bt = wt + W * kConvChanBlock;  // the bias: one more row, as a 1-tap weight
  if (p.bias == nullptr) std::memset(bt, 0, size_t(nc) * sizeof(float));
  else if (p.bias_dtype == DType::bf16) conv_taps_rows<1>(static_cast<const bf16*>(p.bias) + c0, nc, bt);
  else conv_taps_rows<1>(static_cast<const float*>(p.bias) + c0, nc, bt);
  for (int i = 0; i <= W; ++i)
    for (int64_t c = nc; c < padded; ++c) wt[i * kConvChanBlock + c] = 0.f;
}

// n (<= 16) contiguous elements, bit for bit.
template <class T>
inline void conv_copy_vec(T* dst, const T* src, int n) {
  if (n == kLanes) std::memcpy(static_cast<void*>(dst), src, kLanes * sizeof(T));
  else std::memcpy(static_cast<void*>(dst), src, size_t(n) * sizeof(T));
}

// The activation of an output stored as T: a bf16 output takes vsilu_bf16, accurate to well
// under its own rounding (ffi/README.md, "bf16 outputs").
template <bool SILU, class T>
inline VF conv_act(VF a) {
  if constexpr (!SILU) return a;
  else if constexpr (std::is_same_v<T, bf16>) return vsilu_bf16(a);
  else return vsilu(a);
}
template <class T>
inline VF conv_act_rt(VF a, bool silu) { return silu ? conv_act<true, T>(a) : a; }

template <class T>
inline void conv_zero_rows(T* y, int64_t D, int64_t t0, int64_t t1, int64_t c0, int64_t c1) {
  for (int64_t t = t0; t < t1; ++t) std::memset(static_cast<void*>(y + t * D + c0), 0, size_t(c1 - c0) * sizeof(T));
}

// The hot loop: `count` tokens of one 16-channel vector, W <= 4. e_k = x~[t-k] for the first
// token t (unused ones zero); tap i is at wtc[i * kConvChanBlock]; x rows are D apart, y rows
// y_ld. The window is kept in named variables rather than an array: GCC 12 spills a rotated
// array of VF through the stack and general registers (and ICEs in SRA on some shapes of it).
// Y = float with SILU false: the f32 pre-activations, for conv_act_rows (see there).
template <class T, int W, bool SILU, bool FULL, class Y = T>
inline void conv_tokens(const float* wtc, VF b, VF e3, VF e2, VF e1, const T* xp, Y* yp, int64_t D,
                        int64_t y_ld, int64_t count, int n) {
  static_assert(W >= 1 && W <= 4, "conv_tokens handles W <= 4");
  const VF u0 = vload(wtc + (W - 1) * kConvChanBlock);  // u_k multiplies x~[t-k]
  VF u1 = vzero(), u2 = vzero(), u3 = vzero();
  if constexpr (W >= 2) u1 = vload(wtc + (W - 2) * kConvChanBlock);
  if constexpr (W >= 3) u2 = vload(wtc + (W - 3) * kConvChanBlock);
  if constexpr (W >= 4) u3 = vload(wtc + (W - 4) * kConvChanBlock);
  for (int64_t t = 0; t < count; ++t, xp += D, yp += y_ld) {
    const VF xv = FULL ? vload(xp) : vload_n(xp, n);
    VF acc = b;  // bias, then taps 0 .. W-1 (oldest input first)
    if constexpr (W >= 4) acc = vfma(u3, e3, acc);
    if constexpr (W >= 3) acc = vfma(u2, e2, acc);
    if constexpr (W >= 2) acc = vfma(u1, e1, acc);
    acc = vfma(u0, xv, acc);
    e3 = e2;
    e2 = e1;
    e1 = xv;
    acc = conv_act<SILU, T>(acc);
    if (FULL) vstore(yp, acc);
    else vstore_n(yp, acc, n);
  }
}

// The activation of `rows` rows of nc pre-activations (f32, rows buf_ld apart) into y (rows
// y_ld apart). A separate loop over a buffer, not inside conv_tokens: with one or few tokens per
// vector (decode, spec) the SiLU's ~40-operation dependency chain per vector ran back to back
// with the next vector's loads and taps, and its constants were re-broadcast per vector; here
// the iterations are independent and the constants stay in registers (ffi/README.md, "Causal
// conv1d", the activation pass). Same bits as conv_act inside conv_tokens. kConvActVecs vectors
// per step: a vector's SiLU is one long dependent chain, and with the chains of a few vectors
// written next to each other the core overlaps them (one at a time it waited on each).
template <class T, bool SILU, bool STREAM = false>
inline void conv_act_rows(const float* buf, int64_t buf_ld, T* y, int64_t y_ld, int64_t rows, int64_t nc) {
  for (int64_t r = 0; r < rows; ++r, buf += buf_ld, y += y_ld) {
    int64_t c = 0;
    auto put = [&](int64_t at, VF v) {
      if constexpr (STREAM) vstream(y + at, v);
      else vstore(y + at, v);
    };
    for (; c + kConvActVecs * kLanes <= nc; c += kConvActVecs * kLanes) {
      VF v[kConvActVecs];
      for (int j = 0; j < kConvActVecs; ++j) v[j] = vload(buf + c + j * kLanes);
      for (int j = 0; j < kConvActVecs; ++j) v[j] = conv_act<SILU, T>(v[j]);
      for (int j = 0; j < kConvActVecs; ++j) put(c + j * kLanes, v[j]);
    }
    for (; c + kLanes <= nc; c += kLanes) put(c, conv_act<SILU, T>(vload(buf + c)));
    if (c < nc) vstore_n(y + c, conv_act<SILU, T>(vload_n(buf + c, int(nc - c))), int(nc - c));
  }
}

// --- prefill ------------------------------------------------------------------------------

// x~ row `pos` (a token position; pos < seq_start reads the prior) for channels [c, c+n).
template <class T>
inline VF conv_fwd_xt(const ConvArgs& p, const T* x, const T* st, int64_t seq_start, bool has_init,
                      int64_t pos, int64_t c, int n) {
  if (pos >= seq_start) return vload_n(x + pos * p.D + c, n);
  if (!has_init) return vzero();
  const int64_t k = pos - seq_start + (p.W - 1);  // prior row, in [0, W-1)
  return conv_load_row(st + k * p.time_stride + c * p.chan_stride, p.chan_stride, n);
}

// Outputs of tokens [t, e) of sequence s (a real slot) x channels [c0, c1) (at most
// kConvChanBlock), from the parameter block wt of conv_params_t(c0, c1); output (t, c0) at
// yr, rows y_ld apart. Swept in runs of kConvRun tokens; within a run the channel vectors go
// left to right (kConvRun contiguous row streams) and each slides its register window down
// the run, seeded from the x rows above (or, at the sequence start, from the prior).
template <class T, int W, bool SILU, bool STREAM = false>
GDN_CONV_HOT void conv_fwd_part(const ConvArgs& p, const float* wt, int64_t s, int64_t t, int64_t e, int64_t c0,
                                int64_t c1, T* yr, int64_t y_ld) {
  const T* x = static_cast<const T*>(p.x);
  const int64_t D = p.D, start = p.query_start_loc[s], nc = c1 - c0;
  const T* st = static_cast<const T*>(p.conv_state) + p.state_indices[s] * p.slot_stride;
  const bool init = p.has_initial_state[s];
  const float* bt = wt + W * kConvChanBlock;
  // With the SiLU a run's pre-activations go through pre and conv_act_rows (see there).
  alignas(64) float pre[SILU ? kConvRun * kConvChanBlock : 1];
  using Y = std::conditional_t<SILU, float, T>;
  for (int64_t u = t; u < e; u += kConvRun, yr += kConvRun * y_ld) {
    const int64_t count = e - u < kConvRun ? e - u : kConvRun;
    const T* xr = x + u * D;
    // x rows are D apart (16 KiB at Qwen3-Next's D = 8192 in bf16), a stride the hardware
    // prefetchers do not follow; fetched only a chunk ahead (chunk_prep) their loads still
    // stalled here. Two runs ahead: ffi/README.md, "Causal conv1d", Prefetch in the prefill.
    for (int64_t v = u + kConvPrefetchRuns * kConvRun, ve = v + kConvRun < e ? v + kConvRun : e; v < ve; ++v) {
      const char* pr = reinterpret_cast<const char*>(x + v * D + c0);
      for (int64_t b = 0; b < nc * int64_t(sizeof(T)); b += 64) __builtin_prefetch(pr + b, 0, 2);
    }
    Y* out;
    int64_t out_ld;
    if constexpr (SILU) {
      out = pre;
      out_ld = kConvChanBlock;
    } else {
      out = yr;
      out_ld = y_ld;
    }
    if (u - (W - 1) >= start) {  // window inside the sequence: straight from the x rows above
      int64_t c = c0;
      for (; c + kLanes <= c1; c += kLanes) {
        const T* xp = xr + c;
        VF e1 = vzero(), e2 = vzero(), e3 = vzero();
        if constexpr (W >= 2) e1 = vload(xp - D);
        if constexpr (W >= 3) e2 = vload(xp - 2 * D);
        if constexpr (W >= 4) e3 = vload(xp - 3 * D);
        conv_tokens<T, W, false, true, Y>(wt + (c - c0), vload(bt + (c - c0)), e3, e2, e1, xp, out + (c - c0), D,
                                          out_ld, count, kLanes);
      }
      if (c < c1) {
        const int n = int(c1 - c);
        const T* xp = xr + c;
        VF e1 = vzero(), e2 = vzero(), e3 = vzero();
        if constexpr (W >= 2) e1 = vload_n(xp - D, n);
        if constexpr (W >= 3) e2 = vload_n(xp - 2 * D, n);
        if constexpr (W >= 4) e3 = vload_n(xp - 3 * D, n);
        conv_tokens<T, W, false, false, Y>(wt + (c - c0), vload(bt + (c - c0)), e3, e2, e1, xp, out + (c - c0), D,
                                           out_ld, count, n);
      }
    } else {  // the window reaches into the prior (state rows or zeros)
      for (int64_t c = c0; c < c1; c += kLanes) {
        const int n = int(c1 - c < kLanes ? c1 - c : kLanes);
        VF e1 = vzero(), e2 = vzero(), e3 = vzero();
        if constexpr (W >= 2) e1 = conv_fwd_xt(p, x, st, start, init, u - 1, c, n);
        if constexpr (W >= 3) e2 = conv_fwd_xt(p, x, st, start, init, u - 2, c, n);
        if constexpr (W >= 4) e3 = conv_fwd_xt(p, x, st, start, init, u - 3, c, n);
        conv_tokens<T, W, false, false, Y>(wt + (c - c0), vload(bt + (c - c0)), e3, e2, e1, xr + c, out + (c - c0),
                                           D, out_ld, count, n);
      }
    }
    if constexpr (SILU) conv_act_rows<T, true, STREAM>(pre, kConvChanBlock, yr, y_ld, count, nc);
  }
}

// One prefill item: output tokens [t0, t1) x channels [c0, c1). Reads x and the old state
// of the sequences it overlaps; writes only y.
template <class T, int W, bool SILU>
GDN_CONV_HOT void conv_fwd_block(const ConvArgs& p, int64_t t0, int64_t t1, int64_t c0, int64_t c1) {
  T* y = static_cast<T*>(p.y);
  const int32_t* qsl = p.query_start_loc;
  const int64_t D = p.D, total = qsl[p.S];
  const int64_t tz = t0 > total ? t0 : (t1 < total ? t1 : total);  // [tz, t1): no row covers them
  conv_zero_rows(y, D, tz, t1, c0, c1);
  if (t0 >= tz) return;
  alignas(64) float wt[conv_param_rows(W) * kConvChanBlock];
  conv_params_t<W>(p, c0, c1, wt);
  const bool stream = SILU && p.stream_y;
  // First sequence holding token t0: qsl[s] <= t0 < qsl[s+1].
  int64_t lo = 0, hi = p.S;  // invariant: qsl[lo] <= t0 < qsl[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (qsl[mid] <= t0) lo = mid;
    else hi = mid;
  }
  int64_t s = lo;
  for (int64_t t = t0; t < tz;) {
    while (qsl[s + 1] <= t) ++s;
    const int64_t e = qsl[s + 1] < tz ? qsl[s + 1] : tz;
    if (!p.rows.owns(s)) {  // another kernel's tokens
      t = e;
      continue;
    }
    if (p.state_indices[s] < 0) conv_zero_rows(y, D, t, e, c0, c1);
    else if (stream) conv_fwd_part<T, W, SILU, true>(p, wt, s, t, e, c0, c1, y + t * D + c0, D);
    else conv_fwd_part<T, W, SILU>(p, wt, s, t, e, c0, c1, y + t * D + c0, D);
    t = e;
  }
  if (stream) vstream_fence();
}

// Any W (slow; the public ops only allow 2..4): taps and x~ fetched per use; conv_fwd_part's
// contract (wt unused).
template <class T>
void conv_fwd_part_any(const ConvArgs& p, const float* /*wt*/, int64_t s, int64_t a, int64_t e, int64_t c0,
                       int64_t c1, T* yr, int64_t y_ld) {
  const T* x = static_cast<const T*>(p.x);
  const T* st = static_cast<const T*>(p.conv_state) + p.state_indices[s] * p.slot_stride;
  const int64_t W = p.W, start = p.query_start_loc[s];
  const bool init = p.has_initial_state[s];
  for (int64_t c = c0; c < c1; c += kLanes) {
    const int n = int(c1 - c < kLanes ? c1 - c : kLanes);
    const VF b = conv_bias(p, c, n);
    for (int64_t t = a; t < e; ++t) {
      VF acc = b;
      for (int64_t i = 0; i < W; ++i)
        acc = vfma(conv_tap(p, c, n, i), conv_fwd_xt(p, x, st, start, init, t - (W - 1) + i, c, n), acc);
      vstore_n(yr + (t - a) * y_ld + (c - c0), conv_act_rt<T>(acc, p.silu), n);
    }
  }
}

template <class T>
void conv_fwd_block_any(const ConvArgs& p, int64_t t0, int64_t t1, int64_t c0, int64_t c1) {
  T* y = static_cast<T*>(p.y);
  const int32_t* qsl = p.query_start_loc;
  const int64_t D = p.D, total = qsl[p.S];
  const int64_t tz = t0 > total ? t0 : (t1 < total ? t1 : total);
  conv_zero_rows(y, D, tz, t1, c0, c1);
  for (int64_t s = 0; s < p.S; ++s) {
    const int64_t a = qsl[s] > t0 ? qsl[s] : t0, e = qsl[s + 1] < tz ? qsl[s + 1] : tz;
    if (a >= e || !p.rows.owns(s)) continue;
    if (p.state_indices[s] < 0) conv_zero_rows(y, D, a, e, c0, c1);
    else conv_fwd_part_any<T>(p, nullptr, s, a, e, c0, c1, y + a * D + c0, D);
  }
}

// State pass (after every output is written): rows [0, W-1) of sequence s's slot, channels
// [c0, c1), get the last W-1 rows of prior ++ x_seq. Row j takes x~ row n+j > j, so going up
// in j reads each old row before it is overwritten.
template <class T>
void conv_fwd_state(const ConvArgs& p, int64_t s, int64_t c0, int64_t c1) {
  const int32_t slot = p.state_indices[s];
  const int64_t start = p.query_start_loc[s], n = p.query_start_loc[s + 1] - start;
  if (slot < 0 || n == 0 || !p.rows.owns(s)) return;
  const T* x = static_cast<const T*>(p.x);
  T* st = static_cast<T*>(p.conv_state) + slot * p.slot_stride;
  const int64_t W = p.W, cs = p.chan_stride, ts = p.time_stride, nc = c1 - c0;
  const bool init = p.has_initial_state[s];
  for (int64_t j = 0; j < W - 1; ++j) {
    const int64_t k = n + j;  // x~ row
    T* dst = st + j * ts + c0 * cs;
    const T* src;
    int64_t src_stride;
    if (k >= W - 1) {
      src = x + (start + k - (W - 1)) * p.D + c0;
      src_stride = 1;
    } else if (init) {
      src = st + k * ts + c0 * cs;
      src_stride = cs;
    } else {
      src = nullptr;
      src_stride = 0;
    }
    if (cs == 1) {
      if (src) std::memcpy(static_cast<void*>(dst), src, size_t(nc) * sizeof(T));
      else std::memset(static_cast<void*>(dst), 0, size_t(nc) * sizeof(T));
    } else {
      for (int64_t c = 0; c < nc; ++c) {
        if (src) dst[c * cs] = src[c * src_stride];
        else std::memset(static_cast<void*>(dst + c * cs), 0, sizeof(T));
      }
    }
  }
}

// Runs block(p, o0, o1, c0, c1) in parallel over (outer block of `step` x `chans` channels)
// items covering [0, n) x [0, D), outer blocks outermost: the work split of both conv launchers.
template <class Block>
inline void conv_grid(const ConvArgs& p, const Parallel& par, int64_t n, int64_t step, Block block,
                      int64_t chans = kConvChanBlock) {
  const int64_t nO = (n + step - 1) / step;
  const int64_t nC = (p.D + chans - 1) / chans;
  par(nO * nC, 1, [&](int64_t b, int64_t e) {
    for (int64_t it = b; it < e; ++it) {
      const int64_t ob = it / nC, cb = it % nC;
      const int64_t o0 = ob * step, o1 = o0 + step < n ? o0 + step : n;
      const int64_t c0 = cb * chans, c1 = c0 + chans < p.D ? c0 + chans : p.D;
      block(p, o0, o1, c0, c1);
    }
  });
}

// Calls fixed(W, SILU) with both as compile-time constants for W <= 4, else any(): the
// specialisation switch of both launchers.
template <class Fixed, class Any>
inline void conv_by_width(const ConvArgs& p, Fixed&& fixed, Any&& any) {
  using F = std::false_type;
  using S = std::true_type;
  switch (p.W * 2 + (p.silu ? 1 : 0)) {
    case 2: fixed(std::integral_constant<int, 1>{}, F{}); break;
    case 3: fixed(std::integral_constant<int, 1>{}, S{}); break;
    case 4: fixed(std::integral_constant<int, 2>{}, F{}); break;
    case 5: fixed(std::integral_constant<int, 2>{}, S{}); break;
    case 6: fixed(std::integral_constant<int, 3>{}, F{}); break;
    case 7: fixed(std::integral_constant<int, 3>{}, S{}); break;
    case 8: fixed(std::integral_constant<int, 4>{}, F{}); break;
    case 9: fixed(std::integral_constant<int, 4>{}, S{}); break;
    default: any(); break;
  }
}

// The slot rows of every prefill sequence (conv_fwd_state), in parallel; called once every
// output that reads the old rows is done.
template <class T>
void conv_fwd_states(const ConvArgs& p, const Parallel& par) {
  if (p.W <= 1) return;
  conv_grid(p, par, p.S, 1, [](const ConvArgs& q, int64_t s0, int64_t s1, int64_t c0, int64_t c1) {
    for (int64_t s = s0; s < s1; ++s) conv_fwd_state<T>(q, s, c0, c1);
  });
}

// The prefill conv as parts, for a kernel that consumes the outputs as it makes them (the
// serving step's fused prefill, chunk.h): `params` fills the parameter block of channels
// [c0, c1) (at most kConvChanBlock; kConvParamFloats floats), `rows` is conv_fwd_part for
// this call's width and activation. Chosen once per call; the bits are conv_fwd's.
constexpr int64_t kConvParamFloats = conv_param_rows(4) * kConvChanBlock;
template <class T>
struct ConvPart {
  void (*params)(const ConvArgs& p, int64_t c0, int64_t c1, float* wt);
  void (*rows)(const ConvArgs& p, const float* wt, int64_t s, int64_t t, int64_t e, int64_t c0, int64_t c1, T* yr,
               int64_t y_ld);
};
template <class T>
ConvPart<T> conv_part(const ConvArgs& p) {
  ConvPart<T> r{[](const ConvArgs&, int64_t, int64_t, float*) {}, conv_fwd_part_any<T>};
  conv_by_width(
      p,
      [&](auto w, auto silu) {
        r.params = conv_params_t<decltype(w)::value>;
        r.rows = conv_fwd_part<T, decltype(w)::value, decltype(silu)::value>;
      },
      [] {});
  return r;
}

// p.stream_y (the handler's choice: y larger than half the last-level cache) where y's rows allow
// aligned vectors; only the SiLU's activation pass streams (conv_act_rows).
template <class T>
inline bool conv_stream_y(const ConvArgs& p) {
  return p.stream_y && p.silu && reinterpret_cast<uintptr_t>(p.y) % 64 == 0 && (p.D * int64_t(sizeof(T))) % 64 == 0;
}

template <class T>
void conv_fwd_impl(const ConvArgs& p_in, const Parallel& par) {
  ConvArgs p = p_in;
  p.stream_y = conv_stream_y<T>(p);
  auto outputs = [&](auto block) { conv_grid(p, par, p.T, kConvTokBlock, block); };
  conv_by_width(
      p, [&](auto w, auto silu) { outputs(conv_fwd_block<T, decltype(w)::value, decltype(silu)::value>); },
      [&] { outputs(conv_fwd_block_any<T>); });
  // Second pass: every output that reads a slot's old rows is done before any slot is written.
  conv_fwd_states<T>(p, par);
}

inline void conv_fwd(const ConvArgs& p, const Parallel& par) {
  if (p.act == DType::bf16) conv_fwd_impl<bf16>(p, par);
  else conv_fwd_impl<float>(p, par);
}

// --- decode / spec rolling buffer ---------------------------------------------------------

// The parameter block (conv_params_t) of channels [c0, c1) (c0 a multiple of kConvChanBlock) for
// update call `call`. An update item is two rows (one in a spec call) x kConvUpdateChans: its slot
// rows are then read as a few long runs, which the hardware prefetchers follow (items of 8 rows x
// 256 channels read 24 runs of 512 bytes, 16 KiB apart, and waited on memory). Two rows are too
// little work to transpose the taps for, so each thread keeps the blocks it has made in this call
// (stamped with the call's number, unique per update call) for its other items. Per thread, not
// one copy for all: a block made on one core and read on another cost more than making it again.
// call == 0 (a call of one row, each block used once): made in `own`.
inline std::atomic<uint64_t>& conv_update_calls() {
  static std::atomic<uint64_t> n{0};
  return n;
}
inline std::vector<uint64_t>& conv_update_stamps() {  // this thread's: per block, the call that made it
  static thread_local std::vector<uint64_t> stamp;
  return stamp;
}
template <int W>
inline const float* conv_update_params(const ConvArgs& p, uint64_t call, int64_t c0, int64_t c1, float* own) {
  if (call == 0) {
    conv_params_t<W>(p, c0, c1, own);
    return own;
  }
  std::vector<uint64_t>& stamp = conv_update_stamps();
  const int64_t nb = (p.D + kConvChanBlock - 1) / kConvChanBlock, k = c0 / kConvChanBlock;
  if (int64_t(stamp.size()) < nb) stamp.assign(size_t(nb), 0);
  // Grows exactly when stamp does (its contents then lost, and every stamp cleared); a stamp only
  // ever matches the call that wrote it, as each call takes a fresh number.
  float* wt = thread_scratch<float, 5>(int64_t(stamp.size()) * kConvParamFloats) + k * kConvParamFloats;
  if (stamp[size_t(k)] != call) {
    conv_params_t<W>(p, c0, c1, wt);
    stamp[size_t(k)] = call;
  }
  return wt;
}

// The first run of an update row in the SD layout, full vectors [c0, cf) (the plain decode's
// whole work): the general loop of conv_update_block with its layout, run and tail branches
// taken out. slot: the row's slot (channel 0); out / out_ld: where conv_tokens writes (channel
// c0). Same operations in the same order as the general loop, so the same bits. PLAIN: a plain
// decode row (acc = q = count = 1), its offsets constants.
template <class T, int W, bool PLAIN, class Y>
inline void conv_update_sd_first(const float* wt, T* slot, int64_t ts, int64_t acc_in, const T* xr, int64_t D,
                                 int64_t q_in, int64_t count_in, Y* out, int64_t out_ld, int64_t c0, int64_t cf) {
  const int64_t acc = PLAIN ? 1 : acc_in, q = PLAIN ? 1 : q_in, count = PLAIN ? 1 : count_in;
  const float* bt = wt + W * kConvChanBlock;
  for (int64_t c = c0; c < cf; c += kLanes) {
    T* st = slot + c;
    const T* win = st + (acc - 1) * ts;
    VF e1 = vzero(), e2 = vzero(), e3 = vzero();
    if constexpr (W >= 2) e1 = vload(win + (W - 2) * ts);
    if constexpr (W >= 3) e2 = vload(win + (W - 3) * ts);
    if constexpr (W >= 4) e3 = vload(win + (W - 4) * ts);
    conv_tokens<T, W, false, true, Y>(wt + (c - c0), vload(bt + (c - c0)), e3, e2, e1, xr + c, out + (c - c0), D,
                                      out_ld, count, kLanes);
    for (int j = 0; j < W - 2; ++j) conv_copy_vec(st + j * ts, st + (acc + j) * ts, kLanes);
    for (int64_t k = W > 1 ? 0 : 1; k < q; ++k) conv_copy_vec(st + (W - 2 + k) * ts, xr + k * D + c, kLanes);
  }
}

// One update item: rows [s0, s1) x channels [c0, c1), in blocks of kConvChanBlock channels. Per
// row and block, in runs of up to kConvRun tokens: per 16-channel vector the window (first run:
// slot rows [acc-1, acc-1+W-1); later runs: the x rows above) is loaded into registers and the
// run's outputs computed (with the SiLU: into pre, then conv_act_rows). In the first run each
// vector then rewrites its slot rows [0, W-2+q) = window[1:] ++ x_row: the window is in registers
// before the rewrite, and each item owns its channels of the row's slot (slots are distinct), so
// the in-place rewrite never feeds back into a read; later runs read only x. The taps come from
// this thread's parameter blocks of update call `call` (conv_update_params).
template <class T, int W, bool SILU>
GDN_CONV_HOT void conv_update_block(const ConvArgs& p, uint64_t call, int64_t s0, int64_t s1, int64_t c0,
                                    int64_t c1) {
  static_assert(kConvRun >= W - 1, "a later run's window lies in x");
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int64_t D = p.D, ts = p.time_stride, cs = p.chan_stride;
  alignas(64) float pre[SILU ? kConvRun * kConvChanBlock : 1];
  alignas(64) float own[conv_param_rows(W) * kConvChanBlock];  // a block not shared
  struct Row {
    int64_t start, q, acc;
    T* slot;
  } work[kConvUpdateRows];  // s1 - s0 <= kConvUpdateRows (conv_update_impl's grid)
  int64_t nwork = 0;  // the item's rows with work: padding rows' outputs are zeroed here
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t start = p.query_start_loc[s], q = p.query_start_loc[s + 1] - start;
    if (q == 0 || !p.rows.owns(s)) continue;
    const int32_t slot = p.state_indices[s];
    if (slot < 0) conv_zero_rows(y, D, start, start + q, c0, c1);
    else work[nwork++] = Row{start, q, p.num_accepted[s], static_cast<T*>(p.conv_state) + slot * p.slot_stride};
  }
  for (int64_t b0 = c0; b0 < c1 && nwork > 0; b0 += kConvChanBlock) {
    const int64_t b1 = b0 + kConvChanBlock < c1 ? b0 + kConvChanBlock : c1, nc = b1 - b0;
    const float* wt = conv_update_params<W>(p, call, b0, b1, own);
    const float* bt = wt + W * kConvChanBlock;
    for (int64_t r = 0; r < nwork; ++r) {
      const int64_t start = work[r].start, q = work[r].q, acc = work[r].acc;
      const T* xr = x + start * D;
      T* yr = y + start * D;
      T* slot_base = work[r].slot;
      for (int64_t u = 0; u < q; u += kConvRun) {
        const int64_t count = q - u < kConvRun ? q - u : kConvRun;
        int64_t c = b0;
        if (u == 0 && cs == 1) {
          const int64_t cf = b0 + (nc / kLanes) * kLanes;
          auto first = [&](auto* out, int64_t out_ld) {
            if (acc == 1 && q == 1)
              conv_update_sd_first<T, W, true>(wt, slot_base, ts, acc, xr, D, q, count, out, out_ld, b0, cf);
            else conv_update_sd_first<T, W, false>(wt, slot_base, ts, acc, xr, D, q, count, out, out_ld, b0, cf);
          };
          if constexpr (SILU) first(pre, kConvChanBlock);
          else first(yr + b0, D);
          c = cf;
        }
        for (; c < b1; c += kLanes) {
          const int n = int(b1 - c < kLanes ? b1 - c : kLanes);
          T* st = slot_base + c * cs;
          const T* xp = xr + u * D + c;
          VF e1 = vzero(), e2 = vzero(), e3 = vzero();
          if (u == 0) {
            const T* win = st + (acc - 1) * ts;  // window[j] = row acc-1+j; e_k = window[W-1-k]
            if constexpr (W >= 2) e1 = conv_load_row(win + (W - 2) * ts, cs, n);
            if constexpr (W >= 3) e2 = conv_load_row(win + (W - 3) * ts, cs, n);
            if constexpr (W >= 4) e3 = conv_load_row(win + (W - 4) * ts, cs, n);
          } else {  // e_k = x row u - k
            if constexpr (W >= 2) e1 = vload_n(xp - D, n);
            if constexpr (W >= 3) e2 = vload_n(xp - 2 * D, n);
            if constexpr (W >= 4) e3 = vload_n(xp - 3 * D, n);
          }
          const VF b = vload(bt + (c - b0));
          const float* wc = wt + (c - b0);
          if constexpr (SILU) {
            float* out = pre + (c - b0);
            if (n == kLanes)
              conv_tokens<T, W, false, true, float>(wc, b, e3, e2, e1, xp, out, D, kConvChanBlock, count, n);
            else conv_tokens<T, W, false, false, float>(wc, b, e3, e2, e1, xp, out, D, kConvChanBlock, count, n);
          } else {
            T* yp = yr + u * D + c;
            if (n == kLanes) conv_tokens<T, W, false, true>(wc, b, e3, e2, e1, xp, yp, D, D, count, n);
            else conv_tokens<T, W, false, false>(wc, b, e3, e2, e1, xp, yp, D, D, count, n);
          }
          if (u > 0) continue;
          // Row j <- window[j+1] = old row acc+j (j < W-2), then row W-2+k <- x_row[k].
          const T* x0 = xr + c;
          if (cs == 1) {  // SD: raw copies (the values are exact); row acc+j > j is still unwritten
            for (int j = 0; j < W - 2; ++j) conv_copy_vec(st + j * ts, st + (acc + j) * ts, n);
            for (int64_t k = W > 1 ? 0 : 1; k < q; ++k) conv_copy_vec(st + (W - 2 + k) * ts, x0 + k * D, n);
          } else {
            if constexpr (W == 4) {
              conv_store_row(st, cs, e2, n);
              conv_store_row(st + ts, cs, e1, n);
            }
            if constexpr (W == 3) conv_store_row(st, cs, e1, n);
            for (int64_t k = W > 1 ? 0 : 1; k < q; ++k)
              conv_store_row(st + (W - 2 + k) * ts, cs, vload_n(x0 + k * D, n), n);
          }
        }
        if constexpr (SILU) conv_act_rows<T, true>(pre, kConvChanBlock, yr + u * D + b0, D, count, nc);
      }
    }
  }
}

// Any W (slow): all outputs first (reading the old rows), then rows j = 0, 1, ... take old row
// acc+j > j, which no earlier write touched.
template <class T>
void conv_update_block_any(const ConvArgs& p, int64_t s0, int64_t s1, int64_t c0, int64_t c1) {
  const T* x = static_cast<const T*>(p.x);
  T* y = static_cast<T*>(p.y);
  const int64_t D = p.D, W = p.W, ts = p.time_stride, cs = p.chan_stride;
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t start = p.query_start_loc[s], q = p.query_start_loc[s + 1] - start;
    if (q == 0 || !p.rows.owns(s)) continue;
    const int32_t slot = p.state_indices[s];
    if (slot < 0) {
      conv_zero_rows(y, D, start, start + q, c0, c1);
      continue;
    }
    const int64_t acc = p.num_accepted[s];
    for (int64_t c = c0; c < c1; c += kLanes) {
      const int n = int(c1 - c < kLanes ? c1 - c : kLanes);
      T* st = static_cast<T*>(p.conv_state) + slot * p.slot_stride + c * cs;
      const VF b = conv_bias(p, c, n);
      for (int64_t t = 0; t < q; ++t) {
        VF a = b;
        for (int64_t i = 0; i < W; ++i) {
          const int64_t k = t + i;  // x~ row: window rows first, then x_row
          const VF v = k < W - 1 ? conv_load_row(st + (acc - 1 + k) * ts, cs, n)
                                 : vload_n(x + (start + k - (W - 1)) * D + c, n);
          a = vfma(conv_tap(p, c, n, i), v, a);
        }
        vstore_n(y + (start + t) * D + c, conv_act_rt<T>(a, p.silu), n);
      }
      for (int64_t j = 0; j + 1 < W - 1; ++j) conv_store_row(st + j * ts, cs, conv_load_row(st + (acc + j) * ts, cs, n), n);
      for (int64_t k = 0; k < q; ++k) {
        const int64_t r = W - 2 + k;
        if (r >= 0) conv_store_row(st + r * ts, cs, vload_n(x + (start + k) * D + c, n), n);
      }
    }
  }
}

template <class T>
void conv_update_impl(const ConvArgs& p, const Parallel& par_in) {
  // The rows this update owns: their tokens, the most in one row, how many have a slot.
  int64_t tokens = 0, longest = 0, rows = 0;
  for (int64_t s = 0; s < p.S; ++s)
    if (p.rows.owns(s)) {
      const int64_t q = p.query_start_loc[s + 1] - p.query_start_loc[s];
      tokens += q;
      longest = q > longest ? q : longest;
      rows += p.state_indices[s] >= 0 ? 1 : 0;
    }
  const Parallel par = tokens * p.D * p.W <= kConvUpdateSerialWork ? Parallel{} : par_in;
  // Spec rows rewrite W - 2 + q slot rows and read q x rows: one row per item keeps the runs few.
  const int64_t item_rows = longest > 1 ? 1 : kConvUpdateRows;
  auto run = [&](auto block) { conv_grid(p, par, p.S, item_rows, block, kConvUpdateChans); };
  // With one row every block is used once: each item makes its own (call 0).
  const uint64_t call = rows > 1 ? conv_update_calls().fetch_add(1, std::memory_order_relaxed) + 1 : 0;
  conv_by_width(
      p,
      [&](auto w, auto silu) {
        run([call](const ConvArgs& q, int64_t s0, int64_t s1, int64_t c0, int64_t c1) {
          conv_update_block<T, decltype(w)::value, decltype(silu)::value>(q, call, s0, s1, c0, c1);
        });
      },
      [&] { run(conv_update_block_any<T>); });
  // Tokens past query_start_loc[S] belong to no row: zero.
  const int64_t total = p.query_start_loc[p.S];
  T* y = static_cast<T*>(p.y);
  par_in(p.T - total, 64, [&](int64_t b, int64_t e) { conv_zero_rows(y, p.D, total + b, total + e, 0, p.D); });
}

inline void conv_update(const ConvArgs& p, const Parallel& par) {
  if (p.act == DType::bf16) conv_update_impl<bf16>(p, par);
  else conv_update_impl<float>(p, par);
}
