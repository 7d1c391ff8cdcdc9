// Kernel-core tests without Python or XLA: every kernel of every ISA this CPU runs, against a
// scalar float64 evaluation of the contract written here from the formulas. Built by CMake
// with -DGDN_BUILD_CORE_TESTS=ON; run natively and, cross-compiled, under qemu-aarch64.
// Prints one line per check and "N passed, M failed"; exit status 1 on any failure.
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gdn/dispatch.h"
#include "gdn/types.h"

using namespace gdn;

namespace {

int g_pass = 0, g_fail = 0;

uint16_t bf16_bits(float f) {  // RNE, inputs here are finite
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
float bf16_value(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double rel_rmse(const std::vector<double>& out, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (out[i] - ref[i]) * (out[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

void check(const std::string& what, double err, double budget) {
  const bool ok = err <= budget && std::isfinite(err);
  std::printf("%-58s rel_rmse %.2e (budget %.0e) %s\n", what.c_str(), err, budget, ok ? "ok" : "FAIL");
  (ok ? g_pass : g_fail)++;
}

// Activations as f32 or bf16 buffers holding the same (bf16-exact) values.
struct Act {
  std::vector<float> f32;
  std::vector<uint16_t> b16;
  std::vector<double> f64;
  Act(size_t n, std::mt19937& rng, double scale = 1.0) : f32(n), b16(n), f64(n) {
    std::normal_distribution<float> d(0.f, 1.f);
    for (size_t i = 0; i < n; ++i) {
      b16[i] = bf16_bits(float(d(rng) * scale));
      f32[i] = bf16_value(b16[i]);
      f64[i] = f32[i];
    }
  }
  const void* ptr(DType t) const { return t == DType::f32 ? (const void*)f32.data() : (const void*)b16.data(); }
};

std::vector<double> read_act(const void* p, DType t, size_t n) {
  std::vector<double> r(n);
  for (size_t i = 0; i < n; ++i)
    r[i] = t == DType::f32 ? static_cast<const float*>(p)[i] : bf16_value(static_cast<const uint16_t*>(p)[i]);
  return r;
}

double softplus(double x) { return x > 20 ? x : std::log1p(std::exp(x)); }
double sigmoid(double x) { return 1 / (1 + std::exp(-x)); }

// --- gating -----------------------------------------------------------------------------
void test_gating(const KernelTable& kt, DType act, std::mt19937& rng) {
  const int64_t T = 37, HV = 24;
  Act a(T * HV, rng, 3), b(T * HV, rng, 3);
  std::vector<float> A_log(HV), dt(HV), g(T * HV), beta(T * HV);
  for (int h = 0; h < HV; ++h) { A_log[h] = std::log(1.f + h * 0.6f); dt[h] = 0.1f * (h % 5) - 0.2f; }
  GatingArgs p{act, a.ptr(act), b.ptr(act), A_log.data(), dt.data(), g.data(), beta.data(), T, HV};
  kt.gating(p, Parallel{});
  std::vector<double> gr(T * HV), br(T * HV), go(g.begin(), g.end()), bo(beta.begin(), beta.end());
  for (int64_t i = 0; i < T * HV; ++i) {
    const int h = int(i % HV);
    gr[i] = -std::exp(double(A_log[h])) * softplus(a.f64[i] + dt[h]);
    br[i] = sigmoid(b.f64[i]);
  }
  const std::string tag = std::string(kt.isa) + (act == DType::f32 ? " f32" : " bf16");
  check("gating g    " + tag, rel_rmse(go, gr), 1e-6);
  check("gating beta " + tag, rel_rmse(bo, br), 1e-6);
}

// --- conv ---------------------------------------------------------------------------------
void test_conv(const KernelTable& kt, DType act, bool ds, int W, std::mt19937& rng) {
  const int64_t D = 72, N = 5, num_spec = 2, L = W - 1 + num_spec;
  const std::vector<int32_t> lens = {5, 0, 2, 9};
  const int64_t S = int64_t(lens.size());
  std::vector<int32_t> qsl(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) qsl[s + 1] = qsl[s] + lens[s];
  const int64_t T = qsl[S] + 2;  // two tokens past the last row
  std::vector<int32_t> idx = {3, 1, -1, 0};
  std::vector<uint8_t> has_init = {1, 0, 1, 0};
  Act x(T * D, rng), pool(N * L * D, rng);
  std::vector<float> w(D * W), bias(D);
  std::normal_distribution<float> nd(0.f, 0.5f);
  for (auto& v : w) v = nd(rng);
  for (auto& v : bias) v = nd(rng);
  auto at = [&](int64_t n, int64_t t, int64_t c) { return n * L * D + (ds ? c * L + t : t * D + c); };
  std::vector<uint8_t> y(T * D * 4, 0);
  std::vector<uint8_t> st(pool.f32.size() * 4);
  std::memcpy(st.data(), pool.ptr(act), pool.f32.size() * (act == DType::f32 ? 4 : 2));
  ConvArgs p{};
  p.act = act; p.x = x.ptr(act); p.y = y.data(); p.weight = w.data(); p.bias = bias.data();
  p.T = T; p.D = D; p.W = W; p.silu = true; p.conv_state = st.data(); p.N = N; p.L = L;
  p.slot_stride = L * D; p.time_stride = ds ? 1 : D; p.chan_stride = ds ? L : 1;
  p.query_start_loc = qsl.data(); p.state_indices = idx.data();
  p.has_initial_state = reinterpret_cast<const bool*>(has_init.data()); p.S = S;
  kt.conv_fwd(p, Parallel{});
  // float64 evaluation
  std::vector<double> yr(T * D, 0.0), sr = pool.f64;
  auto silu = [](double v) { return v * sigmoid(v); };
  for (int64_t s = 0; s < S; ++s) {
    if (idx[s] < 0 || lens[s] == 0) continue;
    std::vector<double> ext((W - 1 + lens[s]) * D, 0.0);
    for (int64_t r = 0; r < W - 1; ++r)
      for (int64_t c = 0; c < D; ++c) ext[r * D + c] = has_init[s] ? pool.f64[at(idx[s], r, c)] : 0.0;
    for (int64_t t = 0; t < lens[s]; ++t)
      for (int64_t c = 0; c < D; ++c) ext[(W - 1 + t) * D + c] = x.f64[(qsl[s] + t) * D + c];
    for (int64_t t = 0; t < lens[s]; ++t)
      for (int64_t c = 0; c < D; ++c) {
        double acc = bias[c];
        for (int i = 0; i < W; ++i) acc += double(w[c * W + i]) * ext[(t + i) * D + c];
        yr[(qsl[s] + t) * D + c] = silu(acc);
      }
    for (int64_t r = 0; r < W - 1; ++r)
      for (int64_t c = 0; c < D; ++c) sr[at(idx[s], r, c)] = ext[(lens[s] + r) * D + c];
  }
  const std::string tag = std::string(kt.isa) + (act == DType::f32 ? " f32" : " bf16") + (ds ? " DS" : " SD") +
                          " W=" + std::to_string(W);
  const double budget = act == DType::f32 ? 1e-6 : 4e-3;
  check("conv_fwd y     " + tag, rel_rmse(read_act(y.data(), act, T * D), yr), budget);
  check("conv_fwd state " + tag, rel_rmse(read_act(st.data(), act, N * L * D), sr), 0.0);

  // Spec rolling-buffer update on the state just written: rows q = {3, 1, 2}, acc = {2, 1, 3}.
  const std::vector<int32_t> q2 = {3, 1, 2}, acc = {2, 1, 3}, idx2 = {0, 4, 3};
  std::vector<int32_t> qsl2 = {0, 3, 4, 6};
  const int64_t T2 = 6;
  Act x2(T2 * D, rng);
  std::vector<double> base = read_act(st.data(), act, N * L * D);
  std::vector<uint8_t> y2(T2 * D * 4, 0);
  ConvArgs u = p;
  u.x = x2.ptr(act); u.y = y2.data(); u.T = T2; u.S = 3; u.query_start_loc = qsl2.data();
  u.state_indices = idx2.data(); u.has_initial_state = nullptr; u.num_accepted = acc.data();
  kt.conv_update(u, Parallel{});
  std::vector<double> y2r(T2 * D, 0.0), s2r = base;
  for (int64_t r = 0; r < 3; ++r) {
    std::vector<double> ext((W - 1 + q2[r]) * D);
    for (int64_t i = 0; i < W - 1; ++i)
      for (int64_t c = 0; c < D; ++c) ext[i * D + c] = base[at(idx2[r], acc[r] - 1 + i, c)];
    for (int64_t t = 0; t < q2[r]; ++t)
      for (int64_t c = 0; c < D; ++c) ext[(W - 1 + t) * D + c] = x2.f64[(qsl2[r] + t) * D + c];
    for (int64_t t = 0; t < q2[r]; ++t)
      for (int64_t c = 0; c < D; ++c) {
        double a2 = bias[c];
        for (int i = 0; i < W; ++i) a2 += double(w[c * W + i]) * ext[(t + i) * D + c];
        y2r[(qsl2[r] + t) * D + c] = silu(a2);
      }
    for (int64_t i = 0; i < W - 2 + q2[r]; ++i)
      for (int64_t c = 0; c < D; ++c) s2r[at(idx2[r], i, c)] = ext[(1 + i) * D + c];
  }
  check("conv_update y     " + tag, rel_rmse(read_act(y2.data(), act, T2 * D), y2r), budget);
  check("conv_update state " + tag, rel_rmse(read_act(st.data(), act, N * L * D), s2r), 0.0);
}

// --- gated delta rule ---------------------------------------------------------------------
struct GdnCase {
  int64_t H = 2, HV = 4, K = 32, V = 48, N = 7;
};

// One token step on a float64 state [K][V].
void step64(std::vector<double>& S, const double* qh, const double* kh, const double* v, double g, double beta,
            int64_t K, int64_t V, double* o) {
  const double alpha = std::exp(g);
  for (auto& s : S) s *= alpha;
  for (int64_t j = 0; j < V; ++j) {
    double kv = 0;
    for (int64_t i = 0; i < K; ++i) kv += S[i * V + j] * kh[i];
    const double delta = beta * (v[j] - kv);
    for (int64_t i = 0; i < K; ++i) S[i * V + j] += kh[i] * delta;
  }
  for (int64_t j = 0; j < V; ++j) {
    double acc = 0;
    for (int64_t i = 0; i < K; ++i) acc += S[i * V + j] * qh[i];
    o[j] = acc;
  }
}

void normalise(const double* x, int64_t K, double eps, double mul, double* out) {
  double ss = 0;
  for (int64_t i = 0; i < K; ++i) ss += x[i] * x[i];
  const double r = mul / std::sqrt(ss + eps);
  for (int64_t i = 0; i < K; ++i) out[i] = x[i] * r;
}

void store_state(std::vector<uint8_t>& buf, DType st, const std::vector<double>& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    if (st == DType::f32) reinterpret_cast<float*>(buf.data())[i] = float(v[i]);
    else reinterpret_cast<uint16_t*>(buf.data())[i] = bf16_bits(float(v[i]));
  }
}

void test_recurrent_and_chunk(const KernelTable& kt, DType act, DType sdt, std::mt19937& rng) {
  GdnCase c;
  const int64_t H = c.H, HV = c.HV, K = c.K, V = c.V, N = c.N, G = HV / H;
  const double eps = 1e-6, scale = 1.0 / std::sqrt(double(K));
  std::vector<double> S0(N * HV * K * V);
  std::normal_distribution<double> nd(0, 0.1);
  for (auto& s : S0) s = nd(rng);
  const size_t ssize = S0.size() * (sdt == DType::f32 ? 4 : 2);
  std::vector<uint8_t> pool(ssize);
  store_state(pool, sdt, S0);
  const std::vector<double> S0r = read_act(pool.data(), sdt, S0.size());  // what the pool holds
  const std::string tag = std::string(kt.isa) + (act == DType::f32 ? " act f32" : " act bf16") +
                          (sdt == DType::f32 ? " state f32" : " state bf16");
  const bool f32all = act == DType::f32 && sdt == DType::f32;

  // Spec verify: rows with q = {3, 1, 2}, acc = {2, 1, 3}, 3 columns; row 1 is padding.
  {
    const int64_t cols = 3, S = 3;
    std::vector<int32_t> qsl = {0, 3, 4, 6}, acc = {2, 1, 3};
    std::vector<int32_t> idx = {0, 1, 2, -1, -1, -1, 3, 4, 5};
    const int64_t T = 7;
    Act q(T * H * K, rng), k(T * H * K, rng), v(T * HV * V, rng), a(T * HV, rng), b(T * HV, rng);
    std::vector<float> A_log(HV), dt(HV);
    for (int h = 0; h < HV; ++h) { A_log[h] = std::log(1.f + 3 * h); dt[h] = 0.3f - 0.1f * h; }
    std::vector<uint8_t> o(T * HV * V * 4, 0xff), st = pool;
    RecurrentArgs p{};
    p.act = act; p.state = sdt; p.q = q.ptr(act); p.k = k.ptr(act); p.v = v.ptr(act); p.a = a.ptr(act);
    p.b = b.ptr(act); p.A_log = A_log.data(); p.dt_bias = dt.data(); p.ssm_state = st.data(); p.o = o.data();
    p.query_start_loc = qsl.data(); p.state_indices = idx.data(); p.num_accepted = acc.data();
    p.index_cols = cols; p.T = T; p.S = S; p.N = N; p.H = H; p.HV = HV; p.K = K; p.V = V;
    p.scale = float(scale); p.eps = float(eps); p.l2norm = true;
    kt.recurrent(p, Parallel{});
    std::vector<double> orf(T * HV * V, 0.0), sref = S0r;
    std::vector<double> qh(K), kh(K);
    for (int64_t r = 0; r < S; ++r) {
      if (idx[r * cols] < 0) continue;
      for (int64_t h = 0; h < HV; ++h) {
        const int64_t kh_i = h / G;
        std::vector<double> Sm(S0r.begin() + (idx[r * cols + acc[r] - 1] * HV + h) * K * V,
                               S0r.begin() + (idx[r * cols + acc[r] - 1] * HV + h + 1) * K * V);
        for (int64_t t = 0; t < qsl[r + 1] - qsl[r]; ++t) {
          const int64_t j = qsl[r] + t;
          normalise(&q.f64[(j * H + kh_i) * K], K, eps, scale, qh.data());
          normalise(&k.f64[(j * H + kh_i) * K], K, eps, 1.0, kh.data());
          const double g = -std::exp(double(A_log[h])) * softplus(a.f64[j * HV + h] + dt[h]);
          step64(Sm, qh.data(), kh.data(), &v.f64[(j * HV + h) * V], g, sigmoid(b.f64[j * HV + h]), K, V,
                 &orf[(j * HV + h) * V]);
          std::copy(Sm.begin(), Sm.end(), sref.begin() + (idx[r * cols + t] * HV + h) * K * V);
        }
      }
    }
    check("recurrent spec o     " + tag, rel_rmse(read_act(o.data(), act, T * HV * V), orf), f32all ? 1e-5 : 2e-3);
    // bf16 state: one bf16 rounding per stored state per token (2^-9 relative, RMSE ~1.6e-3).
    check("recurrent spec state " + tag, rel_rmse(read_act(st.data(), sdt, S0.size()), sref),
          sdt == DType::bf16 ? 4e-3 : (act == DType::f32 ? 1e-5 : 1e-4));
  }

  // Chunked prefill: lengths {70, 0, 5, 64} (several chunks, empty, short); row 3 starts fresh
  // on a slot full of NaN; row 1 is padding.
  {
    const std::vector<int32_t> lens = {70, 0, 5, 64};
    const int64_t S = 4;
    std::vector<int32_t> qsl(S + 1, 0);
    for (int64_t s = 0; s < S; ++s) qsl[s + 1] = qsl[s] + lens[s];
    const int64_t T = qsl[S] + 1;
    std::vector<int32_t> idx = {2, -1, 5, 6};
    std::vector<uint8_t> hs = {1, 1, 1, 0};
    Act q(T * H * K, rng), k(T * H * K, rng), v(T * HV * V, rng);
    std::vector<float> g(T * HV), beta(T * HV);
    std::uniform_real_distribution<float> ug(-0.3f, 0.f), ub(0.f, 1.f);
    for (auto& x : g) x = ug(rng);
    for (auto& x : beta) x = ub(rng);
    std::vector<uint8_t> st = pool;
    std::vector<double> nanslot(HV * K * V, std::nan(""));
    std::vector<uint8_t> nanbuf(nanslot.size() * (sdt == DType::f32 ? 4 : 2));
    store_state(nanbuf, sdt, nanslot);
    std::memcpy(st.data() + 6 * nanbuf.size(), nanbuf.data(), nanbuf.size());
    std::vector<double> sref = read_act(st.data(), sdt, S0.size());
    std::vector<uint8_t> o(T * HV * V * 4, 0xff);
    ChunkArgs p{};
    p.act = act; p.state = sdt; p.q = q.ptr(act); p.k = k.ptr(act); p.v = v.ptr(act); p.g = g.data();
    p.beta = beta.data(); p.ssm_state = st.data(); p.o = o.data(); p.query_start_loc = qsl.data();
    p.state_indices = idx.data(); p.has_initial_state = reinterpret_cast<const bool*>(hs.data());
    p.T = T; p.S = S; p.N = N; p.H = H; p.HV = HV; p.K = K; p.V = V; p.scale = float(scale);
    p.eps = float(eps); p.l2norm = true;
    kt.chunk(p, Parallel{});
    std::vector<double> orf(T * HV * V, 0.0), qh(K), kh(K);
    for (int64_t s = 0; s < S; ++s) {
      if (idx[s] < 0 || lens[s] == 0) continue;
      for (int64_t h = 0; h < HV; ++h) {
        std::vector<double> Sm(K * V, 0.0);
        if (hs[s]) std::copy(S0r.begin() + (idx[s] * HV + h) * K * V, S0r.begin() + (idx[s] * HV + h + 1) * K * V, Sm.begin());
        for (int64_t j = qsl[s]; j < qsl[s + 1]; ++j) {
          normalise(&q.f64[(j * H + h / G) * K], K, eps, scale, qh.data());
          normalise(&k.f64[(j * H + h / G) * K], K, eps, 1.0, kh.data());
          step64(Sm, qh.data(), kh.data(), &v.f64[(j * HV + h) * V], g[j * HV + h], beta[j * HV + h], K, V,
                 &orf[(j * HV + h) * V]);
        }
        std::copy(Sm.begin(), Sm.end(), sref.begin() + (idx[s] * HV + h) * K * V);
      }
    }
    check("chunk o              " + tag, rel_rmse(read_act(o.data(), act, T * HV * V), orf), f32all ? 1e-5 : 3e-3);
    // bf16 state: one rounding of the final state (and of the initial one, already in S0r).
    check("chunk final state    " + tag, rel_rmse(read_act(st.data(), sdt, S0.size()), sref),
          sdt == DType::bf16 ? 4e-3 : (act == DType::f32 ? 1e-5 : 2e-3));
  }
}

}  // namespace

int main() {
  std::printf("CPU features: %s\n", cpu_features().c_str());
  for (const std::string& isa : available_isas()) {
    std::string why;
    if (!select_isa(isa, &why)) {
      std::printf("cannot select %s: %s\n", isa.c_str(), why.c_str());
      ++g_fail;
      continue;
    }
    const KernelTable& kt = current_table();
    std::mt19937 rng(1234);
    for (DType act : {DType::f32, DType::bf16}) {
      test_gating(kt, act, rng);
      for (bool ds : {false, true})
        for (int W : {4, 3}) test_conv(kt, act, ds, W, rng);
      for (DType sdt : {DType::f32, DType::bf16}) test_recurrent_and_chunk(kt, act, sdt, rng);
    }
  }
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
