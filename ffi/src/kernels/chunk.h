// Chunked (WY, chunk 64) gated delta rule prefill over varlen sequences.
// Included inside the ISA namespace (no include guard, no system headers).
//
// Work item = (sequence, value head); the chunks of one item run in order because the
// state carries across them. Everything is f32 (products and sums); the decay cumsum is
// kept in double so that exp(Gc_i - Gc_j) keeps its relative accuracy when the cumsums
// are large. Design notes and flop counts: ffi/README.md, "Chunked prefill".

// ---------------------------------------------------------------------------------------
// f32 micro-GEMM on VF
// ---------------------------------------------------------------------------------------
//
// Cout[i][c] = (crs ? crs[i] * Cin[i][c] : 0) + sum_p A(i, p) * B[p][c]
// with A(i, p) = A[i * rsa + p * csa] (any strides: A is broadcast one element at a time),
// B row-major (ldb), Cin / Cout row-major. N is a multiple of kLanes. The register tile is
// kGemmMR rows x kGemmNV vectors; B rows are loaded once per depth step and reused by every
// row of the tile, A elements are broadcast. Cin may alias Cout (a tile reads its C block
// before it writes it). Cin is not read when crs is null (it may hold garbage).

#if defined(__AVX512F__)
constexpr int kGemmMR = 6, kGemmNV = 2;  // VF = one zmm: 12 accumulators of 32
#else
constexpr int kGemmMR = 6, kGemmNV = 1;  // AVX2: VF = two ymm, 12 accumulators of 16
#endif
static_assert(kGemmMR >= 1 && kGemmMR <= 6 && kGemmNV >= 1 && kGemmNV <= 2, "tile dispatch below");

enum GemmShape {
  kGemmFull = 0,
  kGemmTriCols = 1,   // only columns j <= i are needed (column blocks right of the tile skipped)
  kGemmTriDepth = 2,  // A is lower triangular incl. diagonal (zeros stored above): depth p <= i
};

template <int MR, int NV, class TO>
inline void gemm_tile(int np, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb,
                      const float* Cin, int64_t ldci, const float* crs, TO* Cout, int64_t ldco) {
  VF acc[MR][NV];
  if (crs != nullptr) {
    for (int r = 0; r < MR; ++r) {
      const VF s = vset1(crs[r]);
      for (int c = 0; c < NV; ++c) acc[r][c] = s * vload(Cin + r * ldci + c * kLanes);
    }
  } else {
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < NV; ++c) acc[r][c] = vzero();
  }
  for (int p = 0; p < np; ++p) {
    VF b[NV];
    for (int c = 0; c < NV; ++c) b[c] = vload(B + p * ldb + c * kLanes);
    const float* a = A + p * csa;
    for (int r = 0; r < MR; ++r) {
      const VF av = vset1(a[r * rsa]);
      for (int c = 0; c < NV; ++c) acc[r][c] = vfma(av, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) vstore(Cout + r * ldco + c * kLanes, acc[r][c]);
}

template <int NV, class TO>
inline void gemm_tile_rows(int mr, int np, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb,
                           const float* Cin, int64_t ldci, const float* crs, TO* Cout, int64_t ldco) {
  switch (mr) {
    case 6: gemm_tile<6, NV>(np, A, rsa, csa, B, ldb, Cin, ldci, crs, Cout, ldco); break;
    case 5: gemm_tile<5, NV>(np, A, rsa, csa, B, ldb, Cin, ldci, crs, Cout, ldco); break;
    case 4: gemm_tile<4, NV>(np, A, rsa, csa, B, ldb, Cin, ldci, crs, Cout, ldco); break;
    case 3: gemm_tile<3, NV>(np, A, rsa, csa, B, ldb, Cin, ldci, crs, Cout, ldco); break;
    case 2: gemm_tile<2, NV>(np, A, rsa, csa, B, ldb, Cin, ldci, crs, Cout, ldco); break;
    default: gemm_tile<1, NV>(np, A, rsa, csa, B, ldb, Cin, ldci, crs, Cout, ldco); break;
  }
}

// M x N (N % kLanes == 0) result, depth P. Column blocks outermost so that the B panel of
// a block (P x 16*NV floats) stays in L1 while the row tiles stream A.
template <class TO>
inline void gemm(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb,
                 const float* Cin, int64_t ldci, const float* crs, TO* Cout, int64_t ldco, GemmShape shape) {
  for (int c0 = 0; c0 < N; c0 += kGemmNV * kLanes) {
    const int nv = N - c0 >= kGemmNV * kLanes ? kGemmNV : (N - c0) / kLanes;
    for (int i0 = 0; i0 < M; i0 += kGemmMR) {
      const int mr = M - i0 < kGemmMR ? M - i0 : kGemmMR;
      if (shape == kGemmTriCols && i0 + mr - 1 < c0) continue;
      int np = P;
      if (shape == kGemmTriDepth && i0 + mr < np) np = i0 + mr;
      const float* a = A + i0 * rsa;
      const float* ci = Cin == nullptr ? nullptr : Cin + i0 * ldci + c0;
      const float* rs = crs == nullptr ? nullptr : crs + i0;
      TO* co = Cout + i0 * ldco + c0;
      if (nv == 2) gemm_tile_rows<2 <= kGemmNV ? 2 : 1>(mr, np, a, rsa, csa, B + c0, ldb, ci, ldci, rs, co, ldco);
      else gemm_tile_rows<1>(mr, np, a, rsa, csa, B + c0, ldb, ci, ldci, rs, co, ldco);
    }
  }
}

// ---------------------------------------------------------------------------------------
// chunked prefill
// ---------------------------------------------------------------------------------------

constexpr int kChunk = 64;

// Per-thread scratch, allocated once per thread (grown if a call needs more) and freed when
// the thread exits: no allocation per call. Every byte a work item reads from it was
// written by that work item first, so results do not depend on which thread ran it.
struct ChunkScratch {
  float* mem = nullptr;
  int64_t cap = 0;
  ~ChunkScratch() { delete[] mem; }
};

inline float* chunk_scratch(int64_t floats) {
  static thread_local ChunkScratch s;
  if (floats > s.cap) {
    delete[] s.mem;
    s.mem = nullptr;
    s.cap = 0;
    s.mem = new float[size_t(floats + 16)];
    s.cap = floats;
  }
  uintptr_t u = reinterpret_cast<uintptr_t>(s.mem);
  u = (u + 63) & ~uintptr_t(63);
  return reinterpret_cast<float*>(u);
}

// Layout of one thread's scratch (floats), for head dims K, V.
struct ChunkBufs {
  float *S;       // [K][V]  f32 working state of the current item
  float *Qc, *Kc; // [C][K]  q^ (scaled) and k^ of the chunk
  float *KcT;     // [K][C]  k^ transposed (columns >= n zero)
  float *P, *A;   // [C][C]  q.k scores -> P = lower_incl(QK^T o Gamma); k.k -> A = strict_lower(beta KK^T o Gamma)
  float *Tm;      // [C][C]  (I + A)^-1
  float *XQ, *XK; // [C][V]  Q S0 and K S0; XK becomes R = diag(beta)(V - diag(e^Gc) K S0)
  float *Vn;      // [C][V]  V_new = T R, then scaled by e^(G_last - Gc)
  float *eg;      // [C]     e^Gc
  float *dg;      // [C]     e^(G_last - Gc)
  float *decay;   // [K]     e^G_last repeated (row scale of the state update)
  int64_t total;

  ChunkBufs(float* base, int64_t K, int64_t V) {
    int64_t off = 0;
    auto take = [&](int64_t n) {
      float* p = base == nullptr ? nullptr : base + off;
      off += (n + 15) / 16 * 16;
      return p;
    };
    S = take(K * V);
    Qc = take(kChunk * K);
    Kc = take(kChunk * K);
    KcT = take(K * kChunk);
    P = take(kChunk * kChunk);
    A = take(kChunk * kChunk);
    Tm = take(kChunk * kChunk);
    XQ = take(kChunk * V);
    XK = take(kChunk * V);
    Vn = take(kChunk * V);
    eg = take(kChunk);
    dg = take(kChunk);
    decay = take(K);
    total = off;
  }
};

// One chunk of n <= 64 tokens [t0, t0 + n) of value head h; b.S holds the state before the
// chunk (ignored and overwritten when zero_state) and the state after it on return.
template <class TA>
inline void chunk_step(const ChunkArgs& p, const ChunkBufs& b, int64_t t0, int n, int n_next, int64_t h,
                       bool zero_state) {
  constexpr int C = kChunk;
  const int64_t H = p.H, HV = p.HV, K = p.K, V = p.V;
  const int Ki = int(K), Vi = int(V);
  const int64_t kh = h / (HV / H);
  const TA* q = static_cast<const TA*>(p.q);
  const TA* k = static_cast<const TA*>(p.k);
  const TA* v = static_cast<const TA*>(p.v);
  TA* o = static_cast<TA*>(p.o);
  const int npad = (n + kLanes - 1) / kLanes * kLanes;

  // 1. q^, k^ (l2norm in f32, scale folded into q^), k^ transposed; gates. The rows of the
  // next chunk (4 strided streams the hardware prefetcher does not follow) are prefetched
  // into L2 here, one token per token, so that they arrive while this chunk computes.
  for (int i = 0; i < n; ++i) {
    if (i < n_next) {
      const int64_t tn = t0 + n + i;
      const char* pq = reinterpret_cast<const char*>(q + (tn * H + kh) * K);
      const char* pk = reinterpret_cast<const char*>(k + (tn * H + kh) * K);
      const char* pv = reinterpret_cast<const char*>(v + (tn * HV + h) * V);
      const char* po = reinterpret_cast<const char*>(o + (tn * HV + h) * V);
      for (int64_t c = 0; c < K * int64_t(sizeof(TA)); c += 64) {
        __builtin_prefetch(pq + c, 0, 2);
        __builtin_prefetch(pk + c, 0, 2);
      }
      for (int64_t c = 0; c < V * int64_t(sizeof(TA)); c += 64) {
        __builtin_prefetch(pv + c, 0, 2);
        __builtin_prefetch(po + c, 1, 2);
      }
    }
    const TA* qr = q + ((t0 + i) * H + kh) * K;
    const TA* kr = k + ((t0 + i) * H + kh) * K;
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
      vstore(qc + c, vload(qr + c) * vset1(rq));
      vstore(kc + c, vload(kr + c) * vset1(rk));
    }
    for (int c = 0; c < Ki; ++c) b.KcT[c * C + i] = kc[c];
  }
  for (int c = 0; c < Ki; ++c)
    for (int i = n; i < npad; ++i) b.KcT[c * C + i] = 0.f;

  double Gc[C];
  float beta[C];
  {
    double acc = 0.0;
    for (int i = 0; i < n; ++i) {
      acc += double(p.g[(t0 + i) * HV + h]);
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

  // 2. Scores Q K^T and K K^T (only the column blocks on or left of the diagonal).
  gemm<float>(n, npad, Ki, b.Qc, K, 1, b.KcT, C, nullptr, 0, nullptr, b.P, C, kGemmTriCols);
  gemm<float>(n, npad, Ki, b.Kc, K, 1, b.KcT, C, nullptr, 0, nullptr, b.A, C, kGemmTriCols);

  // 3. Decay and causal masks. Gamma_ij = exp(Gc_i - Gc_j) only for j <= i (a non-positive
  // exponent for a decay g <= 0); the difference is taken in double.
  for (int i = 0; i < n; ++i) {
    float* pr = b.P + i * C;
    float* ar = b.A + i * C;
    const int nb = i / kLanes + 1;
    const VF bi = vset1(beta[i]);
    for (int c = 0; c < npad; c += kLanes) {
      if (c / kLanes < nb) {
        float d[kLanes];
        for (int l = 0; l < kLanes; ++l) d[l] = c + l <= i ? float(Gc[i] - Gc[c + l]) : -1000.f;
        const VF gm = vexp(vload(d));
        vstore(pr + c, vload(pr + c) * gm);
        vstore(ar + c, vload(ar + c) * gm * bi);
      } else {
        vstore(pr + c, vzero());
        vstore(ar + c, vzero());
      }
    }
    ar[i] = 0.f;
  }

  // 4. T = (I + A)^-1 by forward substitution: T_i = e_i - sum_{j<i} A_ij T_j (row j of T
  // is zero right of column j).
  for (int i = 0; i < n; ++i) {
    VF acc[C / kLanes];
    const int nb = i / kLanes + 1;
    for (int c = 0; c < nb; ++c) acc[c] = vzero();
    const float* ar = b.A + i * C;
    for (int j = 0; j < i; ++j) {
      const VF a = vset1(-ar[j]);
      const float* tj = b.Tm + j * C;
      const int nbj = j / kLanes + 1;
      for (int c = 0; c < nbj; ++c) acc[c] = vfma(a, vload(tj + c * kLanes), acc[c]);
    }
    float* tr = b.Tm + i * C;
    for (int c = 0; c < npad / kLanes; ++c) vstore(tr + c * kLanes, c < nb ? acc[c] : vzero());
    tr[i] = 1.f;
  }

  // 5. Q S0 and K S0 (nothing to do from a zero state).
  if (!zero_state) {
    gemm<float>(n, Vi, Ki, b.Qc, K, 1, b.S, V, nullptr, 0, nullptr, b.XQ, V, kGemmFull);
    gemm<float>(n, Vi, Ki, b.Kc, K, 1, b.S, V, nullptr, 0, nullptr, b.XK, V, kGemmFull);
  }

  // 6. R = diag(beta) (V - diag(e^Gc) K S0), in place of K S0; then V_new = T R.
  for (int i = 0; i < n; ++i) {
    const TA* vr = v + ((t0 + i) * HV + h) * V;
    float* r = b.XK + i * V;
    const VF bi = vset1(beta[i]);
    if (zero_state) {
      for (int c = 0; c < Vi; c += kLanes) vstore(r + c, bi * vload(vr + c));
    } else {
      const VF ei = vset1(b.eg[i]);
      for (int c = 0; c < Vi; c += kLanes) vstore(r + c, bi * (vload(vr + c) - ei * vload(r + c)));
    }
  }
  gemm<float>(n, Vi, n, b.Tm, C, 1, b.XK, V, nullptr, 0, nullptr, b.Vn, V, kGemmTriDepth);

  // 7. O = diag(e^Gc) Q S0 + P V_new, stored straight into o in the activation dtype.
  gemm<TA>(n, Vi, n, b.P, C, 1, b.Vn, V, b.XQ, V, zero_state ? nullptr : b.eg, o + (t0 * HV + h) * V, HV * V,
           kGemmTriDepth);

  // 8. S = e^G_last S0 + K^T diag(e^(G_last - Gc)) V_new (A operand = K^T read from Kc).
  for (int i = 0; i < n; ++i) {
    float* r = b.Vn + i * V;
    const VF d = vset1(b.dg[i]);
    for (int c = 0; c < Vi; c += kLanes) vstore(r + c, vload(r + c) * d);
  }
  gemm<float>(Ki, Vi, n, b.Kc, 1, K, b.Vn, V, b.S, V, zero_state ? nullptr : b.decay, b.S, V, kGemmFull);
}

template <class TA, class TS>
void chunk_impl(const ChunkArgs& p, const Parallel& par) {
  const int64_t HV = p.HV, K = p.K, V = p.V, S = p.S;
  const int32_t* qsl = p.query_start_loc;
  TA* o = static_cast<TA*>(p.o);
  TS* pool = static_cast<TS*>(p.ssm_state);

  // Tokens no sequence covers: zero output.
  const int64_t covered = qsl[S];
  if (covered < p.T) std::memset(o + covered * HV * V, 0, size_t((p.T - covered) * HV * V) * sizeof(TA));

  const int64_t need = ChunkBufs(nullptr, K, V).total;
  par(S * HV, 1, [&](int64_t begin, int64_t end) {
    const ChunkBufs b(chunk_scratch(need), K, V);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / HV, h = item % HV;
      const int64_t bos = qsl[s], eos = qsl[s + 1];
      if (eos <= bos) continue;  // zero-length: nothing read, nothing written
      const int32_t slot = p.state_indices[s];
      if (slot < 0) {  // padding row
        for (int64_t t = bos; t < eos; ++t) std::memset(o + (t * HV + h) * V, 0, size_t(V) * sizeof(TA));
        continue;
      }
      TS* st = pool + (int64_t(slot) * HV + h) * K * V;
      bool zero_state = !p.has_initial_state[s];
      if (!zero_state)
        for (int64_t e = 0; e < K * V; e += kLanes) vstore(b.S + e, vload(st + e));
      for (int64_t t0 = bos; t0 < eos; t0 += kChunk) {
        const int n = int(eos - t0 < kChunk ? eos - t0 : kChunk);
        const int64_t rest = eos - t0 - n;
        chunk_step<TA>(p, b, t0, n, int(rest < kChunk ? rest : kChunk), h, zero_state);
        zero_state = false;
      }
      for (int64_t e = 0; e < K * V; e += kLanes) vstore(st + e, vload(b.S + e));
    }
  });
}

inline void chunk(const ChunkArgs& p, const Parallel& par) {
  if (p.act == DType::bf16) {
    if (p.state == DType::bf16) chunk_impl<bf16, bf16>(p, par);
    else chunk_impl<bf16, float>(p, par);
  } else {
    if (p.state == DType::bf16) chunk_impl<float, bf16>(p, par);
    else chunk_impl<float, float>(p, par);
  }
}
