// fused_gdn_gating: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), both f32.
// Elementwise over [T, HV]; parallel over tokens. Included inside the ISA namespace.

template <class T>
void gating_impl(const GatingArgs& p, const Parallel& par) {
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  const int64_t HV = p.HV;
  par(p.T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < HV; h += kLanes) {
        const int n = int(HV - h < kLanes ? HV - h : kLanes);
        const VF x = vload_n(a + t * HV + h, n) + vload_n(p.dt_bias + h, n);
        const VF neg_decay = vzero() - vexp(vload_n(p.A_log + h, n));
        // softplus(x) = max(x, 0) + log1p(exp(-|x|)); the log1p is done per lane.
        VF e = vexp(vzero() - vmax(x, vzero() - x));
        float lp[kLanes], xs[kLanes];
        vstore(lp, e);
        vstore(xs, x);
        for (int i = 0; i < kLanes; ++i) lp[i] = xs[i] > 20.f ? xs[i] : (xs[i] > 0.f ? xs[i] : 0.f) + std::log1p(lp[i]);
        vstore_n(p.g + t * HV + h, neg_decay * vload(lp), n);
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
