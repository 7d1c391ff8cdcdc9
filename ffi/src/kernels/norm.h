// gated_rms_norm: the layer's gated RMSNorm per row of V (GatedNormArgs). Rows in ranges on the
// pool; a row is two passes over V (the sum of squares, then the output), its bytes in L1.
// Included inside the ISA namespace.

// x rounded to T and widened back (the reference's cast to the activation dtype between steps).
template <class T>
inline VF vround_to(VF x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    alignas(64) T tmp[kLanes];
    vstore(tmp, x);
    return vload(tmp);
  }
}

template <class T>
void gated_rms_norm_impl(const GatedNormArgs& p, const Parallel& par) {
  const T* o = static_cast<const T*>(p.o);
  const T* z = static_cast<const T*>(p.z);
  const T* w = static_cast<const T*>(p.weight);
  T* y = static_cast<T*>(p.y);
  const int64_t V = p.V, full = V / kLanes * kLanes;
  const int tail = int(V - full);
  const float inv_v = 1.f / float(V), eps = p.eps;
  par(p.rows, 16, [=](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = o + r * V;
      const T* zr = z + r * V;
      T* yr = y + r * V;
      VF ss = vzero();
      for (int64_t i = 0; i < full; i += kLanes) {
        const VF v = vload(x + i);
        ss = vfma(v, v, ss);
      }
      if (tail > 0) {
        const VF v = vload_n(x + full, tail);
        ss = vfma(v, v, ss);
      }
      const VF rs = vset1(1.f / std::sqrt(vsum(ss) * inv_v + eps));
      const auto out = [&](VF v, VF wv, VF zv) { return vround_to<T>(wv * vround_to<T>(v * rs)) * vsilu(zv); };
      for (int64_t i = 0; i < full; i += kLanes) vstore(yr + i, out(vload(x + i), vload(w + i), vload(zr + i)));
      if (tail > 0)
        vstore_n(yr + full, out(vload_n(x + full, tail), vload_n(w + full, tail), vload_n(zr + full, tail)), tail);
    }
  });
}

inline void gated_rms_norm(const GatedNormArgs& p, const Parallel& par) {
  if (p.dtype == DType::bf16) gated_rms_norm_impl<bf16>(p, par);
  else gated_rms_norm_impl<float>(p, par);
}
