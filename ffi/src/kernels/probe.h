// Peak f32 FMA throughput probe for the benchmarks' roofline: 8 independent chains of 16-lane
// FMAs (enough to cover FMA latency on every back end). 256 flops per iteration.
// Included inside the ISA namespace.

inline float fma_probe(int64_t iters) {
  VF acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = vset1(1e-3f * float(j + 1));
  const VF m = vset1(0.9999999f), c = vset1(1e-7f);
  for (int64_t i = 0; i < iters; ++i)
    for (int j = 0; j < 8; ++j) acc[j] = vfma(acc[j], m, c);
  VF s = acc[0];
  for (int j = 1; j < 8; ++j) s = s + acc[j];
  return vsum(s);
}
