// fused_gdn_gating: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), both f32.
// Elementwise over [T, HV]; parallel over tokens. Included inside the ISA namespace.

// softplus(x) = max(x, 0) + log1p(e), e = exp(-|x|) in (0, 1], with
// log1p(e) = 2 atanh(s), s = e / (2 + e) in (0, 1/3]: the odd series to s^17 is below f32
// resolution. For x > 20, log1p(e) < 2.1e-9 is below half an ulp of x, so the sum is x
// exactly: the contract's threshold needs no branch.
inline VF vsoftplus(VF x) {
  const VF e = vexp(vzero() - vmax(x, vzero() - x));
  const VF s = e / (vset1(2.f) + e);
  const VF s2 = s * s;
  VF poly = vset1(1.f / 17);
  const float coef[] = {1.f / 15, 1.f / 13, 1.f / 11, 1.f / 9, 1.f / 7, 1.f / 5, 1.f / 3, 1.f};
  for (float c : coef) poly = vfma(poly, s2, vset1(c));
  return vmax(x, vzero()) + vset1(2.f) * s * poly;
}

template <class T>
void gating_impl(const GatingArgs& p, const Parallel& par) {
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  const int64_t HV = p.HV;
  // -exp(A_log) once per call, not per token: a third of the per-token exps (same bits).
  std::vector<float> neg_decay_h(size_t((HV + kLanes - 1) / kLanes * kLanes));
  for (int64_t h = 0; h < HV; h += kLanes) {
    const int n = int(HV - h < kLanes ? HV - h : kLanes);
    vstore(neg_decay_h.data() + h, vzero() - vexp(vload_n(p.A_log + h, n)));
  }
  par(p.T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < HV; h += kLanes) {
        const int n = int(HV - h < kLanes ? HV - h : kLanes);
        const VF x = vload_n(a + t * HV + h, n) + vload_n(p.dt_bias + h, n);
        const VF neg_decay = vload(neg_decay_h.data() + h);
        const VF sp = vsoftplus(x);
        vstore_n(p.g + t * HV + h, neg_decay * sp, n);
        const VF bb = vload_n(b + t * HV + h, n);
        vstore_n(p.beta + t * HV + h, vset1(1.f) / (vset1(1.f) + vexp(vzero() - bb)), n);
      }
    }
  });
}

inline void gating(const GatingArgs& p, const Parallel& par) {
  if (p.act == DType::bf16) gating_impl<bf16>(p, par);
  else gating_impl<float>(p, par);
}
