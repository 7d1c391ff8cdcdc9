// fused_gdn_gating: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), both f32.
// Elementwise over [T, HV]; parallel over tokens. Included inside the ISA namespace.

// softplus(x) = max(x, 0) + log1p(e), e = exp(-|x|) in (0, 1], with
// log1p(e) = 2 atanh(s), s = e / (2 + e) in (0, 1/3]: the odd series to s^17 is below f32
// resolution. For x > 20, log1p(e) < 2.1e-9 is below half an ulp of x, so the sum is x
// exactly: the contract's threshold needs no branch. N independent vectors in lockstep, each
// through the same operations (so the same bits whatever N): see kGateVecs.
template <int N>
inline void vsoftplus_n(const VF* x, VF* out) {
  VF e[N], s[N], s2[N], poly[N];
  for (int j = 0; j < N; ++j) e[j] = vexp(vzero() - vmax(x[j], vzero() - x[j]));
  for (int j = 0; j < N; ++j) s[j] = e[j] / (vset1(2.f) + e[j]);
  for (int j = 0; j < N; ++j) s2[j] = s[j] * s[j];
  for (int j = 0; j < N; ++j) poly[j] = vset1(1.f / 17);
  const float coef[] = {1.f / 15, 1.f / 13, 1.f / 11, 1.f / 9, 1.f / 7, 1.f / 5, 1.f / 3, 1.f};
  for (float c : coef)
    for (int j = 0; j < N; ++j) poly[j] = vfma(poly[j], s2[j], vset1(c));
  for (int j = 0; j < N; ++j) out[j] = vmax(x[j], vzero()) + vset1(2.f) * s[j] * poly[j];
}

// Vectors per step when HV is a whole number of vectors. One vector's softplus and sigmoid is
// one long dependent chain (two exps, two divisions, the 9-term polynomial), and one at a time
// the core ran it latency-bound (~38 cycles per vector on Zen 5); independent vectors in
// lockstep keep its pipes busy. 8 and 4 measured best on AVX-512 and AVX2; 2 elsewhere, not
// measured (ffi/README.md, "Numerics shared by all kernels", Gating).
#if defined(__AVX512F__)
constexpr int kGateVecs = 8;
#elif defined(__AVX2__)
constexpr int kGateVecs = 4;
#else
constexpr int kGateVecs = 2;
#endif

template <class T>
void gating_impl(const GatingArgs& p, const Parallel& par) {
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  const int64_t HV = p.HV;
  // -exp(A_log) once per call, not per token: a third of the per-token exps (same bits). It
  // and dt_bias are repeated past HV, so that a step of whole vectors (below) reads the heads
  // h0 + 16 j of its vectors with no wrap.
  const int64_t ext = (HV + kLanes - 1) / kLanes * kLanes + kGateVecs * kLanes;
  std::vector<float> head_consts(size_t(2 * ext));
  float* nd = head_consts.data();
  float* dt = nd + ext;
  for (int64_t h = 0; h < HV; h += kLanes) {
    const int n = int(HV - h < kLanes ? HV - h : kLanes);
    vstore(nd + h, vzero() - vexp(vload_n(p.A_log + h, n)));
  }
  std::memcpy(dt, p.dt_bias, size_t(HV) * sizeof(float));
  for (int64_t i = HV; i < ext; ++i) {
    nd[i] = nd[i - HV];
    dt[i] = dt[i - HV];
  }
  float* g = p.g;
  float* beta = p.beta;
  if (HV > 0 && HV % kLanes == 0) {  // rows of whole vectors: the [T, HV] arrays as one flat run
    par(p.T, 64, [=](int64_t t0, int64_t t1) {
      int64_t e = t0 * HV;
      const int64_t end = t1 * HV;
      for (; e + kGateVecs * kLanes <= end; e += kGateVecs * kLanes) {
        const int64_t h0 = e % HV;
        VF x[kGateVecs], sp[kGateVecs], eb[kGateVecs];
        for (int j = 0; j < kGateVecs; ++j) {
          x[j] = vload(a + e + j * kLanes) + vload(dt + h0 + j * kLanes);
          eb[j] = vexp(vzero() - vload(b + e + j * kLanes));
        }
        vsoftplus_n<kGateVecs>(x, sp);
        for (int j = 0; j < kGateVecs; ++j) {
          vstore(g + e + j * kLanes, vload(nd + h0 + j * kLanes) * sp[j]);
          vstore(beta + e + j * kLanes, vset1(1.f) / (vset1(1.f) + eb[j]));
        }
      }
      for (; e < end; e += kLanes) {
        const int64_t h = e % HV;
        const VF x = vload(a + e) + vload(dt + h);
        VF sp;
        vsoftplus_n<1>(&x, &sp);
        vstore(g + e, vload(nd + h) * sp);
        vstore(beta + e, vset1(1.f) / (vset1(1.f) + vexp(vzero() - vload(b + e))));
      }
    });
    return;
  }
  par(p.T, 64, [=](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < HV; h += kLanes) {
        const int n = int(HV - h < kLanes ? HV - h : kLanes);
        const VF x = vload_n(a + t * HV + h, n) + vload_n(dt + h, n);
        VF sp;
        vsoftplus_n<1>(&x, &sp);
        vstore_n(g + t * HV + h, vload(nd + h) * sp, n);
        const VF bb = vload_n(b + t * HV + h, n);
        vstore_n(beta + t * HV + h, vset1(1.f) / (vset1(1.f) + vexp(vzero() - bb)), n);
      }
    }
  });
}

inline void gating(const GatingArgs& p, const Parallel& par) {
  if (p.act == DType::bf16) gating_impl<bf16>(p, par);
  else gating_impl<float>(p, par);
}
