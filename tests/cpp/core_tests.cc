// Kernel-core tests without Python or XLA: every kernel of every ISA this CPU runs, against a
// scalar float64 evaluation of the contract written here from the formulas. Built by CMake
// with -DGDN_BUILD_CORE_TESTS=ON; run natively and, cross-compiled, under qemu-aarch64.
// Prints one line per check and "N passed, M failed"; exit status 1 on any failure.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gdn/dispatch.h"
#include "gdn/types.h"
#include "memory_hints.h"
#include "work_blocks.h"

#if defined(__x86_64__)
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "isa/amx_test_hooks.h"
#define GDN_TEST_AMX 1
#endif
#if defined(__aarch64__)
#include "isa/neon_bf16_test_hooks.h"
#define GDN_TEST_ARM_BF16 1
#endif

using namespace gdn;

namespace {

int g_pass = 0, g_fail = 0;

uint16_t bf16_bits(float f) {  // RNE, for any value but NaN (±Inf and overflow give ±Inf)
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

void check_true(const std::string& what, bool ok, const std::string& detail = "") {
  std::printf("%-58s %s%s%s\n", what.c_str(), ok ? "ok" : "FAIL", detail.empty() ? "" : "  ", detail.c_str());
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

// --- linear (the layer's projections) --------------------------------------------------
// A Parallel on real threads: ranges of `grain` shared by `threads` threads as the extension's
// parallel-for shares them (work_blocks.h), so the split and the order differ from the serial run.
struct ThreadedParallel {
  static void run(void* ctx, int64_t n, int64_t grain, Parallel::Body body, void* body_ctx) {
    const int threads = *static_cast<int*>(ctx);
    WorkBlocks blocks((n + grain - 1) / grain, threads);
    std::vector<std::thread> pool;
    for (int i = 0; i < threads; ++i)
      pool.emplace_back([&, i] {
        blocks.drain(i, [&](int64_t r) { body(body_ctx, r * grain, std::min(n, (r + 1) * grain)); });
      });
    for (auto& t : pool) t.join();
  }
  int threads;
  Parallel par() { return Parallel{&threads, run, threads}; }
};

// f32 y within 1e-6 relative RMSE of ref; bf16 y within one bf16 step of it, except where ref
// is tiny against the largest |ref| (f32 accumulation error may exceed a step there).
void check_linear_y(const std::string& tag, const std::vector<double>& got, const std::vector<double>& ref, DType ydt) {
  if (ydt == DType::f32) return check(tag, rel_rmse(got, ref), 1e-6);
  double scale = 0;
  for (double r : ref) scale = std::max(scale, std::fabs(r));
  int64_t bad = 0;
  for (size_t k = 0; k < ref.size(); ++k) {
    if (std::fabs(ref[k]) < 1e-4 * scale) continue;
    const int diff = int(bf16_bits(float(got[k]))) - int(bf16_bits(float(ref[k])));
    bad += std::abs(diff) > 1;
  }
  check_true(tag + " within 1 bf16 step", bad == 0, bad ? std::to_string(bad) + " differ" : "");
}

// x [T, in] w[out, in]^T in float64 (the bf16 or f32 inputs are exact in it).
std::vector<double> linear_f64(const Act& x, const Act& w, int64_t T, int64_t in, int64_t out) {
  std::vector<double> ref(size_t(T * out));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += x.f64[t * in + i] * w.f64[o * in + i];
      ref[t * out + o] = s;
    }
  return ref;
}

// y = x w^T against float64 (check_linear_y: one rounding of an f32 accumulation);
// bit-identical on 3 threads.
void test_linear(const KernelTable& kt, DType xdt, DType wdt, DType ydt, int64_t T, int64_t in, int64_t out,
                 std::mt19937& rng) {
  const std::string tag = std::string("x ") + (xdt == DType::f32 ? "f32" : "bf16") + " w " +
                          (wdt == DType::f32 ? "f32" : "bf16") + " y " + (ydt == DType::f32 ? "f32" : "bf16") +
                          " " + std::to_string(T) + "x" + std::to_string(in) + "x" + std::to_string(out);
  Act x(size_t(T * in), rng), w(size_t(out * in), rng);
  const std::vector<double> ref = linear_f64(x, w, T, in, out);
  const size_t ybytes = size_t(T * out) * (ydt == DType::f32 ? 4 : 2);
  std::vector<uint8_t> y1(ybytes, 0xAB), y3(ybytes, 0xCD);
  LinearArgs p{xdt, wdt, ydt, x.ptr(xdt), w.ptr(wdt), y1.data(), T, in, out};
  kt.linear(p, Parallel{});
  ThreadedParallel tp{3};
  p.y = y3.data();
  kt.linear(p, tp.par());
  check_linear_y("linear " + tag, read_act(y1.data(), ydt, size_t(T * out)), ref, ydt);
  check_true("linear " + tag + " 3 threads bit-identical", y1 == y3);
}

// The packed w of gdn_jax.ops.pack_linear_weight: wp[b, p, j, k] = w[16 b + j, 2 p + k], zero
// past out and in.
std::vector<uint16_t> pack_w(const Act& w, int64_t in, int64_t out) {
  const int64_t nb = (out + 15) / 16, np = (in + 1) / 2;
  std::vector<uint16_t> wp(size_t(nb * np * 32), 0);
  const uint16_t* src = w.b16.data();
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; ++i) wp[size_t(((o / 16) * np + i / 2) * 32 + (o % 16) * 2 + i % 2)] = src[o * in + i];
  return wp;
}

// linear_packed against float64 as test_linear; the bytes of y past T x out untouched.
void test_linear_packed(const KernelTable& kt, DType xdt, DType ydt, int64_t T, int64_t in, int64_t out,
                        std::mt19937& rng) {
  const std::string tag = std::string("packed x ") + (xdt == DType::f32 ? "f32" : "bf16") + " y " +
                          (ydt == DType::f32 ? "f32" : "bf16") + " " + std::to_string(T) + "x" + std::to_string(in) +
                          "x" + std::to_string(out);
  Act x(size_t(T * in), rng), w(size_t(out * in), rng);
  const std::vector<uint16_t> wp = pack_w(w, in, out);
  const std::vector<double> ref = linear_f64(x, w, T, in, out);
  const size_t esz = ydt == DType::f32 ? 4 : 2, ybytes = size_t(T * out) * esz, guard = 64;
  std::vector<uint8_t> y1(ybytes + guard, 0xAB), y3(ybytes + guard, 0xCD);
  LinearArgs p{xdt, DType::bf16, ydt, x.ptr(xdt), wp.data(), y1.data(), T, in, out};
  kt.linear_packed(one_part(p), Parallel{});
  ThreadedParallel tp{3};
  p.y = y3.data();
  kt.linear_packed(one_part(p), tp.par());
  const std::vector<double> got = read_act(y1.data(), ydt, size_t(T * out));
  check_linear_y("linear " + tag, got, ref, ydt);
  check_true("linear " + tag + " nothing written past y",
             std::all_of(y1.begin() + ybytes, y1.end(), [](uint8_t b) { return b == 0xAB; }));
  y1.resize(ybytes);
  y3.resize(ybytes);
  check_true("linear " + tag + " 3 threads bit-identical", y1 == y3);
}

// Several packed w of one x in one call (LinearPackedArgs' parts; `outs` may hold a 0): each
// part bit for bit its own call on 1 and 3 threads, against float64, nothing written past any
// y. `run(args, par)` is the kernel under test (the table's, or the tile model's panels).
template <class Run>
void test_linear_packed_parts(const std::string& name, Run run, DType xdt, DType ydt, int64_t T, int64_t in,
                              const std::vector<int64_t>& outs, std::mt19937& rng) {
  std::string tag = name + (xdt == DType::f32 ? " x f32" : " x bf16") + (ydt == DType::f32 ? " y f32 " : " y bf16 ") +
                    std::to_string(T) + "x" + std::to_string(in) + " x (";
  for (size_t i = 0; i < outs.size(); ++i) tag += (i ? " " : "") + std::to_string(outs[i]);
  tag += ")";
  const Act x(size_t(T * in), rng);
  const size_t esz = ydt == DType::f32 ? 4 : 2, guard = 64;
  std::vector<Act> ws;
  std::vector<std::vector<uint16_t>> wps;
  std::vector<std::vector<uint8_t>> alone, y1, y3;
  ThreadedParallel tp{3};
  LinearPackedArgs p1{xdt, ydt, x.ptr(xdt), T, in, int(outs.size()), {}}, p3 = p1;
  for (size_t i = 0; i < outs.size(); ++i) {
    const int64_t out = outs[i];
    const size_t ybytes = size_t(T * out) * esz;
    ws.emplace_back(size_t(out * in), rng);
    wps.push_back(pack_w(ws.back(), in, out));
    alone.emplace_back(ybytes, 0xEF);
    y1.emplace_back(ybytes + guard, 0xAB);
    y3.emplace_back(ybytes + guard, 0xAB);
    LinearArgs a{xdt, DType::bf16, ydt, x.ptr(xdt), wps.back().data(), alone.back().data(), T, in, out};
    run(one_part(a), Parallel{});
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    p1.parts[i] = {wps[i].data(), y1[i].data(), outs[i]};
    p3.parts[i] = {wps[i].data(), y3[i].data(), outs[i]};
  }
  run(p1, Parallel{});
  run(p3, tp.par());
  bool past = true, same = true;
  for (size_t i = 0; i < outs.size(); ++i) {
    const size_t ybytes = size_t(T * outs[i]) * esz;
    for (auto* y : {&y1[i], &y3[i]}) {
      past = past && std::all_of(y->begin() + ybytes, y->end(), [](uint8_t b) { return b == 0xAB; });
      y->resize(ybytes);
      same = same && *y == alone[i];
    }
    if (outs[i] > 0)
      check_linear_y(tag + " part " + std::to_string(i), read_act(y1[i].data(), ydt, size_t(T * outs[i])),
                     linear_f64(x, ws[i], T, in, outs[i]), ydt);
  }
  check_true(tag + ": nothing written past any y", past);
  check_true(tag + ": every part bit for bit its own call, 1 and 3 threads", same);
}

// --- gating -----------------------------------------------------------------------------
// Against float64; HV = 24 takes the per-token loop, 32 and 48 the flat run of whole vectors
// (T * HV / 16 = 74 and 450 vectors: full steps of kGateVecs and a tail on every ISA); the
// same bits on 3 threads (ranges of 64 tokens: steps cut at range ends).
void test_gating(const KernelTable& kt, DType act, int64_t T, int64_t HV, std::mt19937& rng) {
  Act a(T * HV, rng, 3), b(T * HV, rng, 3);
  std::vector<float> A_log(HV), dt(HV), g(T * HV), beta(T * HV), g3(T * HV), beta3(T * HV);
  for (int h = 0; h < HV; ++h) { A_log[h] = std::log(1.f + h * 0.6f); dt[h] = 0.1f * (h % 5) - 0.2f; }
  GatingArgs p{act, a.ptr(act), b.ptr(act), A_log.data(), dt.data(), g.data(), beta.data(), T, HV};
  kt.gating(p, Parallel{});
  ThreadedParallel tp{3};
  p.g = g3.data();
  p.beta = beta3.data();
  kt.gating(p, tp.par());
  std::vector<double> gr(T * HV), br(T * HV), go(g.begin(), g.end()), bo(beta.begin(), beta.end());
  for (int64_t i = 0; i < T * HV; ++i) {
    const int h = int(i % HV);
    gr[i] = -std::exp(double(A_log[h])) * softplus(a.f64[i] + dt[h]);
    br[i] = sigmoid(b.f64[i]);
  }
  const std::string tag = std::string(kt.isa) + (act == DType::f32 ? " f32" : " bf16") + " T " + std::to_string(T) +
                          " HV " + std::to_string(HV);
  check("gating g    " + tag, rel_rmse(go, gr), 1e-6);
  check("gating beta " + tag, rel_rmse(bo, br), 1e-6);
  check_true("gating " + tag + " 3 threads bit-identical", g == g3 && beta == beta3);
}

// --- gated RMSNorm (the layer's, per value head) --------------------------------------------
// Against float64: f32 within 1e-6 of the exact norm (its casts are no-ops); bf16 against the
// reference's casts done in double (n and m rounded to bf16): equal but where the f32 row scale
// moved n across a rounding boundary (<= 0.1% of the outputs, <= 2 steps).
// V = 128 (whole vectors) and 40 (a tail); the same bits on 3 threads.
void test_gated_rms_norm(const KernelTable& kt, DType dt, int64_t rows, int64_t V, std::mt19937& rng) {
  const Act o(size_t(rows * V), rng, 2.0), z(size_t(rows * V), rng, 3.0);
  Act w(size_t(V), rng, 0.3);  // 1 + N(0, 0.3^2), bf16-exact
  for (int64_t i = 0; i < V; ++i) {
    w.b16[i] = bf16_bits(1.f + w.f32[i]);
    w.f32[i] = bf16_value(w.b16[i]);
    w.f64[i] = w.f32[i];
  }
  const size_t n = size_t(rows * V), esz = dt == DType::f32 ? 4 : 2;
  std::vector<uint8_t> y1(n * esz), y3(n * esz);
  const float eps = 1e-6f;
  GatedNormArgs p{dt, o.ptr(dt), z.ptr(dt), w.ptr(dt), y1.data(), rows, V, eps};
  kt.gated_rms_norm(p, Parallel{});
  ThreadedParallel tp{3};
  p.y = y3.data();
  kt.gated_rms_norm(p, tp.par());
  const std::vector<double> got = read_act(y1.data(), dt, n);
  std::vector<double> exact(n), cast(n);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t i = 0; i < V; ++i) ss += o.f64[r * V + i] * o.f64[r * V + i];
    const double rs = 1 / std::sqrt(ss / double(V) + eps);
    for (int64_t i = 0; i < V; ++i) {
      const size_t k = size_t(r * V + i);
      const double zz = z.f64[k], silu = zz * sigmoid(zz);
      exact[k] = o.f64[k] * rs * w.f64[i] * silu;
      const double nb = bf16_value(bf16_bits(float(o.f64[k] * rs)));
      cast[k] = double(bf16_value(bf16_bits(float(w.f64[i] * nb)))) * silu;
    }
  }
  const std::string tag = std::string(kt.isa) + (dt == DType::f32 ? " f32 " : " bf16 ") + std::to_string(rows) + "x" +
                          std::to_string(V);
  if (dt == DType::f32) {
    check("gated rms norm " + tag, rel_rmse(got, exact), 1e-6);
  } else {
    int64_t over0 = 0, over2 = 0;
    for (size_t k = 0; k < n; ++k) {
      const int64_t a = int64_t(bf16_bits(float(got[k]))), b = int64_t(bf16_bits(float(cast[k])));
      const int64_t steps = (a >> 15) != (b >> 15) ? std::abs((a & 0x7fff) + (b & 0x7fff)) : std::abs(a - b);
      over0 += steps > 0;
      over2 += steps > 2;
    }
    check_true("gated rms norm " + tag + " the reference's casts", over0 <= int64_t(n) / 1000 && over2 == 0,
               std::to_string(over0) + " differ, " + std::to_string(over2) + " by more than 2 steps");
    check("gated rms norm " + tag + " vs exact", rel_rmse(got, exact), 4e-3);
  }
  check_true("gated rms norm " + tag + " 3 threads bit-identical", y1 == y3);
}

// --- conv ---------------------------------------------------------------------------------
// Weight and bias hold bf16-representable values, so either parameter dtype (wdt) gives the
// same float64 reference; without a bias (has_bias false) the kernel gets a null pointer.
// W = 5 takes the generic path (W <= 4 are specialised).
// The row filter of the serving step (RowFilter, handlers/step.cc): the rows of kind 1, then
// those of kind 2, run as two filtered calls on the same buffers give the bits of one
// unfiltered call (out_all, st_all from pool0), and after the first call the other rows'
// output tokens are untouched. set(args, out, state) points a call at the buffers.
template <class Args, class Set, class Fn>
void check_row_filter(const std::string& what, Args p, int64_t token_bytes, const std::vector<uint8_t>& pool0,
                      const std::vector<uint8_t>& out_all, const std::vector<uint8_t>& st_all, Set set, Fn run) {
  std::vector<int32_t> kind(size_t(p.S));
  for (int64_t s = 0; s < p.S; ++s) kind[size_t(s)] = 1 + int32_t(s % 2);
  std::vector<uint8_t> out(out_all.size(), 0xab), st = pool0;
  set(p, out.data(), st.data());
  p.rows = RowFilter{kind.data(), 1u << 1};
  run(p);
  bool untouched = true;
  for (int64_t s = 1; s < p.S; s += 2)
    for (int64_t b = p.query_start_loc[s] * token_bytes; b < p.query_start_loc[s + 1] * token_bytes; ++b)
      untouched &= out[size_t(b)] == 0xab;
  p.rows = RowFilter{kind.data(), 1u << 2};
  run(p);
  const size_t n = size_t(p.T * token_bytes);
  check_true(what, untouched && std::memcmp(out.data(), out_all.data(), n) == 0 && st == st_all);
}

// The same call with the state pool at a 64-byte boundary (then the recurrence writes a slot
// it did not read with non-temporal stores where the ISA has them: recurrent.h) and 16 bytes
// past one (plain stores): both give the bits of the reference run. A std::vector's data is
// only 16-byte aligned.
template <class Args, class Set, class Fn>
void check_pool_placement(const std::string& what, Args p, const std::vector<uint8_t>& pool0,
                          const std::vector<uint8_t>& out_ref, const std::vector<uint8_t>& st_ref, Set set, Fn run) {
  bool same = true;
  for (size_t off : {size_t(0), size_t(16)}) {
    std::vector<uint8_t> buf(pool0.size() + 128), out(out_ref.size(), 0xff);
    uint8_t* st = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64 + off;
    std::memcpy(st, pool0.data(), pool0.size());
    set(p, out.data(), st);
    run(p);
    same &= out == out_ref && std::memcmp(st, st_ref.data(), st_ref.size()) == 0;
  }
  check_true(what, same);
}


void test_conv(const KernelTable& kt, DType act, bool ds, int W, DType wdt, bool has_bias, std::mt19937& rng) {
  const int64_t D = 72, N = 5, num_spec = 6, L = W - 1 + num_spec;
  const std::vector<int32_t> lens = {5, 0, 2, 9};
  const int64_t S = int64_t(lens.size());
  std::vector<int32_t> qsl(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) qsl[s + 1] = qsl[s] + lens[s];
  const int64_t T = qsl[S] + 2;  // two tokens past the last row
  std::vector<int32_t> idx = {3, 1, -1, 0};
  std::vector<uint8_t> has_init = {1, 0, 1, 0};
  Act x(T * D, rng), pool(N * L * D, rng);
  const Act wa(D * W, rng, 0.5), ba(D, rng, 0.5);
  std::vector<double> w = wa.f64, bias = ba.f64;
  if (!has_bias) std::fill(bias.begin(), bias.end(), 0.0);
  auto at = [&](int64_t n, int64_t t, int64_t c) { return n * L * D + (ds ? c * L + t : t * D + c); };
  std::vector<uint8_t> y(T * D * 4, 0);
  std::vector<uint8_t> st(pool.f32.size() * 4);
  std::memcpy(st.data(), pool.ptr(act), pool.f32.size() * (act == DType::f32 ? 4 : 2));
  ConvArgs p{};
  p.act = act; p.x = x.ptr(act); p.y = y.data(); p.weight = wa.ptr(wdt); p.bias = has_bias ? ba.ptr(wdt) : nullptr;
  p.weight_dtype = wdt; p.bias_dtype = wdt;
  p.T = T; p.D = D; p.W = W; p.silu = true; p.conv_state = st.data(); p.N = N; p.L = L;
  p.slot_stride = L * D; p.time_stride = ds ? 1 : D; p.chan_stride = ds ? L : 1;
  p.query_start_loc = qsl.data(); p.state_indices = idx.data();
  p.has_initial_state = reinterpret_cast<const bool*>(has_init.data()); p.S = S;
  const std::vector<uint8_t> st0 = st;
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
                          " W=" + std::to_string(W) + (wdt == DType::f32 ? " w f32" : " w bf16") +
                          (has_bias ? " bias" : " no bias");
  const double budget = act == DType::f32 ? 1e-6 : 4e-3;
  check("conv_fwd y     " + tag, rel_rmse(read_act(y.data(), act, T * D), yr), budget);
  check("conv_fwd state " + tag, rel_rmse(read_act(st.data(), act, N * L * D), sr), 0.0);
  const int64_t es = act == DType::f32 ? 4 : 2;
  auto conv_bufs = [](ConvArgs& a, void* out, void* state) { a.y = out; a.conv_state = state; };
  check_row_filter("conv_fwd, row filter " + tag, p, D * es, st0, y, st, conv_bufs,
                   [&](const ConvArgs& m) { kt.conv_fwd(m, Parallel{}); });

  // Spec rolling-buffer update on the state just written: rows q = {3, 1, 2, 7}, acc = {2, 1, 3, 2}
  // (7 tokens: more than one of the kernel's runs of 4).
  const std::vector<int32_t> q2 = {3, 1, 2, 7}, acc = {2, 1, 3, 2}, idx2 = {0, 4, 3, 2};
  std::vector<int32_t> qsl2 = {0, 3, 4, 6, 13};
  const int64_t T2 = 13, S2 = 4;
  Act x2(T2 * D, rng);
  std::vector<double> base = read_act(st.data(), act, N * L * D);
  std::vector<uint8_t> y2(T2 * D * 4, 0);
  ConvArgs u = p;
  u.x = x2.ptr(act); u.y = y2.data(); u.T = T2; u.S = S2; u.query_start_loc = qsl2.data();
  u.state_indices = idx2.data(); u.has_initial_state = nullptr; u.num_accepted = acc.data();
  const std::vector<uint8_t> st1 = st;
  kt.conv_update(u, Parallel{});
  std::vector<double> y2r(T2 * D, 0.0), s2r = base;
  for (int64_t r = 0; r < S2; ++r) {
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
  check_row_filter("conv_update, row filter " + tag, u, D * es, st1, y2, st, conv_bufs,
                   [&](const ConvArgs& m) { kt.conv_update(m, Parallel{}); });
}

// The decode update at D = 8192 (Qwen3-Next's channels), W = 4, on 4 threads: B = 1 (one token
// x D x W = 32 Ki: under kConvUpdateSerialWork, so the caller runs it alone, no parallel-for) and
// B = 9 (9 rows x 8 channel ranges: parallel) give the bits of the serial run. The rows'
// slots are distinct; a padding row (B = 9) and two tokens past the last row get zero outputs.
// conv_fwd with stream_y (the handler's choice for a y larger than half the LLC): the same bits
// as plain stores, on 4 threads, with several sequences, an uncovered token and a padding row;
// and a y that is not 64-byte aligned, where the kernel must fall back to plain stores.
void test_conv_stream(const KernelTable& kt, DType act, std::mt19937& rng) {
  const int64_t D = 288, W = 4, L = W - 1, N = 4;  // 256 + 32 channels: a short last channel block
  const std::vector<int32_t> qsl = {0, 70, 71, 140, 203};
  const std::vector<int32_t> idx = {2, 0, -1, 3};
  const std::vector<uint8_t> has_init = {1, 0, 1, 1};
  const int64_t S = 4, T = 205;
  const size_t es = act == DType::f32 ? 4 : 2;
  const Act x(T * D, rng), wa(D * W, rng, 0.5), pool(N * L * D, rng);
  ConvArgs p{};
  p.act = act; p.x = x.ptr(act); p.weight = wa.ptr(DType::bf16); p.bias = nullptr;
  p.weight_dtype = DType::bf16; p.bias_dtype = DType::bf16;
  p.T = T; p.D = D; p.W = W; p.silu = true; p.N = N; p.L = L;
  p.slot_stride = L * D; p.time_stride = D; p.chan_stride = 1;
  p.query_start_loc = qsl.data(); p.state_indices = idx.data();
  p.has_initial_state = reinterpret_cast<const bool*>(has_init.data()); p.S = S;
  ThreadedParallel tp{4};
  auto run = [&](bool stream, size_t offset, std::vector<uint8_t>& y, std::vector<uint8_t>& st) {
    std::vector<uint8_t> buf(T * D * es + 128, 0xcd);
    uint8_t* yp = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64 + offset;
    st.resize(N * L * D * es);
    std::memcpy(st.data(), pool.ptr(act), st.size());
    p.y = yp; p.conv_state = st.data(); p.stream_y = stream;
    kt.conv_fwd(p, tp.par());
    y.assign(yp, yp + T * D * es);
  };
  std::vector<uint8_t> y0, s0, y1, s1, y2, s2;
  run(false, 0, y0, s0);
  run(true, 0, y1, s1);
  run(true, 16, y2, s2);
  const std::string tag = std::string(kt.isa) + (act == DType::f32 ? " f32" : " bf16");
  check_true("conv_fwd stream_y = plain stores " + tag, y0 == y1 && s0 == s1);
  check_true("conv_fwd stream_y, y not 64-byte aligned " + tag, y0 == y2 && s0 == s2);
}

void test_conv_update_threads(const KernelTable& kt, DType act, std::mt19937& rng) {
  const int64_t D = 8192, W = 4, L = W - 1, N = 12;
  const Act wa(D * W, rng, 0.5), ba(D, rng, 0.5), pool(N * L * D, rng);
  const size_t es = act == DType::f32 ? 4 : 2;
  for (int64_t B : {1, 9}) {
    const int64_t T = B + 2;
    const Act x(T * D, rng);
    std::vector<int32_t> qsl(B + 1), idx(B), acc(B, 1);
    for (int64_t s = 0; s < B; ++s) qsl[s + 1] = int32_t(s + 1), idx[s] = int32_t((s * 5) % N);
    if (B > 1) idx[3] = -1;
    ConvArgs p{};
    p.act = act; p.x = x.ptr(act); p.weight = wa.ptr(DType::bf16); p.bias = ba.ptr(DType::bf16);
    p.weight_dtype = DType::bf16; p.bias_dtype = DType::bf16;
    p.T = T; p.D = D; p.W = W; p.silu = true; p.N = N; p.L = L;
    p.slot_stride = L * D; p.time_stride = D; p.chan_stride = 1;
    p.query_start_loc = qsl.data(); p.state_indices = idx.data(); p.num_accepted = acc.data(); p.S = B;
    std::vector<uint8_t> st0(N * L * D * es);
    std::memcpy(st0.data(), pool.ptr(act), st0.size());
    std::vector<uint8_t> y1(T * D * es, 0xff), y4(T * D * es, 0xff), st1 = st0, st4 = st0;
    p.y = y1.data();
    p.conv_state = st1.data();
    kt.conv_update(p, Parallel{});
    struct Counted {
      ThreadedParallel tp{4};
      int forks = 0;
      static void run(void* ctx, int64_t n, int64_t grain, Parallel::Body body, void* body_ctx) {
        auto* c = static_cast<Counted*>(ctx);
        ++c->forks;
        ThreadedParallel::run(&c->tp.threads, n, grain, body, body_ctx);
      }
    } counted;
    p.y = y4.data();
    p.conv_state = st4.data();
    kt.conv_update(p, Parallel{&counted, Counted::run, 4});
    const std::string tag = std::string(kt.isa) + (act == DType::f32 ? " f32" : " bf16") + " B=" + std::to_string(B);
    check_true("conv_update, 4 threads = serial " + tag, y4 == y1 && st4 == st1);
    bool zero = true;  // the padding row's output and the two tokens past the last row
    auto zero_rows = [&](int64_t t0, int64_t t1) {
      for (size_t i = size_t(t0 * D) * es; i < size_t(t1 * D) * es; ++i) zero &= y1[i] == 0;
    };
    if (B > 1) zero_rows(3, 4);
    zero_rows(B, T);
    check_true("conv_update, padding and uncovered tokens zero " + tag, zero);
    check_true("conv_update, " + std::string(B == 1 ? "no parallel-for " : "parallel ") + tag,
               B == 1 ? counted.forks == 0 : counted.forks > 0, "forks " + std::to_string(counted.forks));
    if (B == 1) continue;
    // A thread keeps the taps it transposed for the rest of its update call only
    // (conv_update_params): weights rewritten in place between two calls give the new bits.
    const Act wb(D * W, rng, 0.5);
    std::vector<uint16_t> w_inplace = wa.b16;
    std::vector<uint8_t> y_a(T * D * es), y_b(T * D * es), y_c(T * D * es), st_a = st0, st_b = st0, st_c = st0;
    p.weight = w_inplace.data();
    p.y = y_a.data();
    p.conv_state = st_a.data();
    kt.conv_update(p, Parallel{});
    w_inplace = wb.b16;
    p.y = y_b.data();
    p.conv_state = st_b.data();
    kt.conv_update(p, Parallel{});
    p.weight = wb.ptr(DType::bf16);
    p.y = y_c.data();
    p.conv_state = st_c.data();
    kt.conv_update(p, Parallel{});
    check_true("conv_update, weights rewritten in place between calls " + tag,
               y_a == y1 && y_b == y_c && st_b == st_c && y_b != y_a);
  }
}

// conv_fwd over one fresh sequence of T tokens, D channels, W = 2, taps (0, 1) and a zero bias,
// so y[t] = silu(0 * x[t-1] + x[t]): how the SiLU tests reach each ISA's vsilu / vsilu_bf16.
void conv_silu_of_rows(const KernelTable& kt, DType act, const void* x, void* y, int64_t T, int64_t D) {
  const int64_t W = 2;
  std::vector<float> w(D * W), bias(D, 0.f), st((W - 1) * D, 0.f);  // st: room for either dtype
  for (int64_t c = 0; c < D; ++c) w[c * W] = 0.f, w[c * W + 1] = 1.f;
  const std::vector<int32_t> qsl = {0, int32_t(T)}, idx = {0};
  const std::vector<uint8_t> has_init = {0};
  ConvArgs p{};
  p.act = act; p.x = x; p.y = y; p.weight = w.data(); p.bias = bias.data();
  p.T = T; p.D = D; p.W = W; p.silu = true; p.conv_state = st.data(); p.N = 1; p.L = W - 1;
  p.slot_stride = (W - 1) * D; p.time_stride = D; p.chan_stride = 1;
  p.query_start_loc = qsl.data(); p.state_indices = idx.data();
  p.has_initial_state = reinterpret_cast<const bool*>(has_init.data()); p.S = 1;
  kt.conv_fwd(p, Parallel{});
}

// SiLU at the edges of its range (each back end's vsilu has its own exp clamp and reciprocal)
// and on a dense sweep of [-90, 90] (every step of the exp polynomial's argument reduction),
// through the conv with taps (0, 1) and no bias, so y[t] = silu(0 * x[t-1] + x[t]) (a NaN in
// the window makes the float64 value NaN too). Per element: NaN exactly where float64 has
// NaN, else |y - silu| <= 2e-6 |silu| + 1e-30 (the floor covers x < -88, where the true value
// is below 1e-36 and a back end may flush it). The largest relative error is reported.
void test_silu_edges(const KernelTable& kt) {
  std::vector<float> vals = {0.f, 1e-30f, -1e-30f, 1e-5f, -1e-5f, 0.5f, -0.5f, 1.f, -1.f, 3.f, -3.f, 10.f,
                             -10.f, 20.f, -20.f, 50.f, -50.f, 80.f, -80.f, -87.f, -87.5f, -88.f, -88.5f,
                             -89.f, -90.f, -100.f, -1e3f, -1e30f, 87.f, 88.f, 88.8f, 89.f, 100.f, 1e4f,
                             1e30f, std::nanf(""), INFINITY, -INFINITY};
  for (int i = 0; i <= 36000; ++i) vals.push_back(-90.f + 0.005f * float(i) + 1e-4f * float(i % 7));
  const int64_t D = 40, T = int64_t(vals.size());  // D: two full vectors and a tail
  if (T % 7 == 0) std::abort();  // x below walks vals with step 7: it must visit every value
  std::vector<float> x(T * D), y(T * D, 1.f);
  for (int64_t i = 0; i < T * D; ++i) x[i] = vals[size_t(i * 7 % T)];
  conv_silu_of_rows(kt, DType::f32, x.data(), y.data(), T, D);
  int bad = 0;
  double worst = 0.0;
  std::string first;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < D; ++c) {
      const double prev = t > 0 ? double(x[(t - 1) * D + c]) : 0.0, xv = x[t * D + c];
      const double a = 0.0 * prev + xv;
      const double want = a / (1.0 + std::exp(-a)), got = y[t * D + c];
      const bool ok = std::isnan(want)   ? std::isnan(got)
                      : std::isinf(want) ? got == want
                                         : !std::isnan(got) && std::fabs(got - want) <= 2e-6 * std::fabs(want) + 1e-30;
      if (!ok && bad++ == 0)
        first = "x " + std::to_string(xv) + " got " + std::to_string(got) + " want " + std::to_string(want);
      if (std::fabs(want) > 1e-30 && std::isfinite(want)) worst = std::max(worst, std::fabs(got - want) / std::fabs(want));
    }
  char info[64];
  std::snprintf(info, sizeof info, "max rel %.2e", worst);
  check_true(std::string("silu edges + sweep (conv_fwd f32) ") + kt.isa, bad == 0,
             bad ? std::to_string(bad) + " bad, first: " + first : info);
}

// The SiLU of bf16 outputs (vsilu_bf16, which may be cheaper than the f32 one). (1) Before the
// rounding, through kt.silu_bf16 on a dense sweep of [-90, 90] and edge values: relative error
// <= 1e-5 (about 1/200 of a bf16 half spacing; the AVX2 / NEON form reaches 3.6e-6, a degree-3
// polynomial 7.8e-5), or absolute <= 1e-30 where the true value is that small
// (x < -75; a back end may flush it); NaN exactly where float64 has NaN. (2) Through the conv
// with bf16 activations on every bf16 value (all 65536 bit patterns) as x, taps (0, 1) and no
// bias: odd rows hold the values and even rows zeros, so an odd row's pre-activation is
// 0 * 0 + x = x exactly. The output must be NaN / ±Inf exactly where float64 is, else within one
// bf16 spacing of the exact value (one of the two bf16 values around it), or within the 1e-30
// floor. How many outputs rounded to the other neighbour than RNE of the exact value is reported.
void test_silu_bf16(const KernelTable& kt) {
  {
    std::vector<float> xs = {0.f, 1e-30f, -1e-30f, 1e-5f, -1e-5f, 0.5f, -0.5f, 1.f, -1.f, 3.f, -3.f, 10.f, -10.f,
                             20.f, -20.f, 50.f, -50.f, 80.f, -80.f, -87.f, -88.f, -88.3f, -88.4f, -88.5f, -89.f,
                             -100.f, -1e30f, 87.f, 88.f, 89.f, 100.f, 1e30f, 3e38f, -3e38f, std::nanf(""),
                             INFINITY, -INFINITY};
    for (int i = 0; i <= 180000; ++i) xs.push_back(-90.f + 0.001f * float(i) + 1e-5f * float(i % 7));
    std::vector<float> ys(xs.size());
    kt.silu_bf16(xs.data(), ys.data(), int64_t(xs.size()));
    int bad = 0;
    double worst = 0.0;
    std::string first;
    for (size_t i = 0; i < xs.size(); ++i) {
      const double xv = xs[i], want = xv / (1.0 + std::exp(-xv)), got = ys[i];
      const double rel = std::fabs(got - want) / std::max(std::fabs(want), 1e-300);
      const bool ok = std::isnan(want) ? std::isnan(got)
                                       : !std::isnan(got) && (got == want || rel <= 1e-5 ||
                                                              (std::fabs(want) < 1e-30 && std::fabs(got - want) <= 1e-30));
      if (!ok && bad++ == 0) first = "x " + std::to_string(xv) + " got " + std::to_string(got) + " want " + std::to_string(want);
      if (std::fabs(want) > 1e-30 && std::isfinite(want)) worst = std::max(worst, rel);
    }
    char info[64];
    std::snprintf(info, sizeof info, "max rel %.2e", worst);
    check_true(std::string("silu bf16 before rounding, sweep ") + kt.isa, bad == 0,
               bad ? std::to_string(bad) + " bad, first: " + first : info);
  }
  const int64_t D = 40, rows = (65536 + D - 1) / D, T = 2 * rows;  // D: two vectors and a tail
  std::vector<uint16_t> x(T * D, 0), y(T * D, 0x3f80);
  for (int64_t i = 0; i < 65536; ++i) x[(2 * (i / D) + 1) * D + i % D] = uint16_t(i);
  conv_silu_of_rows(kt, DType::bf16, x.data(), y.data(), T, D);
  int bad = 0;
  int64_t other = 0, counted = 0;
  std::string first;
  for (int64_t i = 0; i < 65536; ++i) {
    const double xv = bf16_value(uint16_t(i));
    const double want = xv / (1.0 + std::exp(-xv));
    const double got = bf16_value(y[(2 * (i / D) + 1) * D + i % D]);
    bool ok;
    if (std::isnan(want)) ok = std::isnan(got);
    else if (std::isinf(want)) ok = got == want;
    else if (std::isnan(got)) ok = false;
    else if (std::fabs(want) < 1e-30) ok = std::fabs(got - want) <= 1e-30;
    else {
      const double spacing = std::ldexp(1.0, std::ilogb(want) - 7);  // bf16: 8 significant bits
      ok = std::fabs(got - want) < spacing;
      if (std::fabs(xv) >= 1e-3 && std::fabs(xv) <= 88.0) {  // where the SiLU is not x or ~0
        ++counted;
        other += got != bf16_value(bf16_bits(float(want)));
      }
    }
    if (!ok && bad++ == 0) first = "x " + std::to_string(xv) + " got " + std::to_string(got) + " want " + std::to_string(want);
  }
  char info[96];
  std::snprintf(info, sizeof info, "%.3f%% of 1e-3 <= |x| <= 88 rounded the other way", 100.0 * double(other) / double(counted));
  check_true(std::string("silu bf16, every bf16 input (conv_fwd) ") + kt.isa, bad == 0,
             bad ? std::to_string(bad) + " bad, first: " + first : info);
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

// Spec verify (with_spec) and chunked prefill on case c; tags name the dims when they are not
// the default case's.
// q, k, v token rows interleaved as one mixed [T, D = 2HK + HV V] buffer (the conv output the
// serving steps hand to the kernels without splitting it).
std::vector<uint8_t> mix_qkv(const Act& q, const Act& k, const Act& v, DType act, int64_t T, int64_t HK,
                             int64_t HVV) {
  const size_t es = act == DType::f32 ? 4 : 2, D = size_t(2 * HK + HVV);
  std::vector<uint8_t> m(size_t(T) * D * es);
  const auto* pq = static_cast<const uint8_t*>(q.ptr(act));
  const auto* pk = static_cast<const uint8_t*>(k.ptr(act));
  const auto* pv = static_cast<const uint8_t*>(v.ptr(act));
  for (int64_t t = 0; t < T; ++t) {
    uint8_t* row = m.data() + size_t(t) * D * es;
    std::memcpy(row, pq + t * HK * es, HK * es);
    std::memcpy(row + HK * es, pk + t * HK * es, HK * es);
    std::memcpy(row + 2 * HK * es, pv + t * HVV * es, HVV * es);
  }
  return m;
}

// The same kernel call on the mixed buffer (row strides D) must give the same bits.
template <class Args, class Fn>
void check_mixed_qkv(const std::string& what, Args p, const Act& q, const Act& k, const Act& v, DType act,
                     const std::vector<uint8_t>& pool0, const std::vector<uint8_t>& o_dense,
                     const std::vector<uint8_t>& st_dense, Fn run) {
  const int64_t HK = p.H * p.K, HVV = p.HV * p.V, es = act == DType::f32 ? 4 : 2;
  const std::vector<uint8_t> m = mix_qkv(q, k, v, act, p.T, HK, HVV);
  std::vector<uint8_t> o(o_dense.size(), 0xff), st = pool0;
  p.q = m.data();
  p.k = m.data() + HK * es;
  p.v = m.data() + 2 * HK * es;
  p.qk_ld = p.v_ld = 2 * HK + HVV;
  p.o = o.data();
  p.ssm_state = st.data();
  run(p);
  const size_t ob = size_t(p.T * HVV * es);
  check_true(what, std::memcmp(o.data(), o_dense.data(), ob) == 0 && st == st_dense);
}

// A recurrence call's rows (decode / spec verify): query_start_loc, state_indices (cols per
// row), num_accepted, T tokens; its per-head gate parameters; the kernel's arguments and the
// float64 evaluation of the same call (padding rows skipped).
struct RecRows {
  std::vector<int32_t> qsl, idx, acc;
  int64_t cols, T;
  int64_t S() const { return int64_t(acc.size()); }
};

struct RecGates {
  std::vector<float> A_log, dt;
  explicit RecGates(int64_t HV) : A_log(size_t(HV)), dt(size_t(HV)) {
    for (int h = 0; h < HV; ++h) { A_log[h] = std::log(1.f + 3 * h); dt[h] = 0.3f - 0.1f * h; }
  }
};

RecurrentArgs rec_args(DType act, DType sdt, const Act& q, const Act& k, const Act& v, const Act& a, const Act& b,
                       const RecGates& gt, const RecRows& rw, void* st, void* o, int64_t N, int64_t H, int64_t HV,
                       int64_t K, int64_t V, double scale, double eps) {
  RecurrentArgs p{};
  p.act = act; p.state = sdt; p.q = q.ptr(act); p.k = k.ptr(act); p.v = v.ptr(act); p.a = a.ptr(act);
  p.b = b.ptr(act); p.A_log = gt.A_log.data(); p.dt_bias = gt.dt.data(); p.ssm_state = st; p.o = o;
  p.query_start_loc = rw.qsl.data(); p.state_indices = rw.idx.data(); p.num_accepted = rw.acc.data();
  p.index_cols = rw.cols; p.T = rw.T; p.S = rw.S(); p.N = N; p.H = H; p.HV = HV; p.K = K; p.V = V;
  p.scale = float(scale); p.eps = float(eps); p.l2norm = true;
  return p;
}

// orf [T, HV, V] and sref (the pool S0r after the call) in float64.
void rec_oracle(const Act& q, const Act& k, const Act& v, const Act& a, const Act& b, const RecGates& gt,
                const RecRows& rw, const std::vector<double>& S0r, int64_t H, int64_t HV, int64_t K, int64_t V,
                double scale, double eps, std::vector<double>& orf, std::vector<double>& sref) {
  const int64_t G = HV / H, cols = rw.cols;
  const int32_t* idx = rw.idx.data();
  orf.assign(size_t(rw.T * HV * V), 0.0);
  sref = S0r;
  std::vector<double> qh(K), kh(K);
  for (int64_t r = 0; r < rw.S(); ++r) {
    if (idx[r * cols] < 0) continue;
    for (int64_t h = 0; h < HV; ++h) {
      const int64_t src = idx[r * cols + rw.acc[r] - 1];
      std::vector<double> Sm(S0r.begin() + (src * HV + h) * K * V, S0r.begin() + (src * HV + h + 1) * K * V);
      for (int64_t t = 0; t < rw.qsl[r + 1] - rw.qsl[r]; ++t) {
        const int64_t j = rw.qsl[r] + t;
        normalise(&q.f64[(j * H + h / G) * K], K, eps, scale, qh.data());
        normalise(&k.f64[(j * H + h / G) * K], K, eps, 1.0, kh.data());
        const double g = -std::exp(double(gt.A_log[h])) * softplus(a.f64[j * HV + h] + gt.dt[h]);
        step64(Sm, qh.data(), kh.data(), &v.f64[(j * HV + h) * V], g, sigmoid(b.f64[j * HV + h]), K, V,
               &orf[(j * HV + h) * V]);
        std::copy(Sm.begin(), Sm.end(), sref.begin() + (idx[r * cols + t] * HV + h) * K * V);
      }
    }
  }
}

void test_recurrent_and_chunk(const KernelTable& kt, DType act, DType sdt, std::mt19937& rng,
                              const GdnCase& c = GdnCase{}, bool with_spec = true) {
  const int64_t H = c.H, HV = c.HV, K = c.K, V = c.V, N = c.N, G = HV / H;
  const double eps = 1e-6, scale = 1.0 / std::sqrt(double(K));
  std::vector<double> S0(N * HV * K * V);
  std::normal_distribution<double> nd(0, 0.1);
  for (auto& s : S0) s = nd(rng);
  const size_t ssize = S0.size() * (sdt == DType::f32 ? 4 : 2);
  std::vector<uint8_t> pool(ssize);
  store_state(pool, sdt, S0);
  const std::vector<double> S0r = read_act(pool.data(), sdt, S0.size());  // what the pool holds
  std::string tag = std::string(kt.isa) + (act == DType::f32 ? " act f32" : " act bf16") +
                    (sdt == DType::f32 ? " state f32" : " state bf16");
  if (K != GdnCase{}.K || V != GdnCase{}.V) tag += " K" + std::to_string(K) + " V" + std::to_string(V);
  const bool f32all = act == DType::f32 && sdt == DType::f32;
  const int64_t es = act == DType::f32 ? 4 : 2;

  // One recurrence call on rows rw from the pool's states, checked against float64; `more` runs
  // further checks on the call (its args, inputs, output and state).
  auto rec_rows = [&](const char* what, const RecRows& rw, auto&& more) {
    const int64_t T = rw.T;
    Act q(T * H * K, rng), k(T * H * K, rng), v(T * HV * V, rng), a(T * HV, rng), b(T * HV, rng);
    const RecGates gt(HV);
    std::vector<uint8_t> o(T * HV * V * 4, 0xff), st = pool;
    const RecurrentArgs p = rec_args(act, sdt, q, k, v, a, b, gt, rw, st.data(), o.data(), N, H, HV, K, V, scale, eps);
    kt.recurrent(p, Parallel{});
    more(p, q, k, v, o, st);
    std::vector<double> orf, sref;
    rec_oracle(q, k, v, a, b, gt, rw, S0r, H, HV, K, V, scale, eps, orf, sref);
    check(std::string("recurrent ") + what + " o     " + tag, rel_rmse(read_act(o.data(), act, T * HV * V), orf),
          f32all ? 1e-5 : 2e-3);
    // bf16 state: one bf16 rounding per stored state per token (2^-9 relative, RMSE ~1.6e-3).
    check(std::string("recurrent ") + what + " state " + tag, rel_rmse(read_act(st.data(), sdt, S0.size()), sref),
          sdt == DType::bf16 ? 4e-3 : (act == DType::f32 ? 1e-5 : 1e-4));
  };

  // Spec verify: rows with q = {3, 1, 2}, acc = {2, 1, 3}, 3 columns; row 1 is padding.
  if (with_spec)
    rec_rows("spec", RecRows{{0, 3, 4, 6}, {0, 1, 2, -1, -1, -1, 3, 4, 5}, {2, 1, 3}, 3, 7},
             [&](const RecurrentArgs& p, const Act& q, const Act& k, const Act& v, const std::vector<uint8_t>& o,
                 const std::vector<uint8_t>& st) {
               check_mixed_qkv("recurrent spec, mixed qkv rows = dense " + tag, p, q, k, v, act, pool, o, st,
                               [&](const RecurrentArgs& m) { kt.recurrent(m, Parallel{}); });
               check_row_filter("recurrent spec, row filter " + tag, p, HV * V * es, pool, o, st,
                                [](RecurrentArgs& a, void* out, void* state) { a.o = out; a.ssm_state = state; },
                                [&](const RecurrentArgs& m) { kt.recurrent(m, Parallel{}); });
               check_pool_placement("recurrent spec, pool 64-byte aligned (streaming stores) and not " + tag, p, pool,
                                    o, st,
                                    [](RecurrentArgs& a, void* out, void* state) { a.o = out; a.ssm_state = state; },
                                    [&](const RecurrentArgs& m) { kt.recurrent(m, Parallel{}); });
             });
  // Decode: three one-token rows in place (on AVX-512, V >= 128 takes 128-column blocks, a rest
  // 32-column ones: recurrent.h, "wide").
  rec_rows("decode", RecRows{{0, 1, 2, 3}, {4, 0, 6}, {1, 1, 1}, 1, 3}, [](auto&&...) {});

  // Chunked prefill: lengths {70, 0, 5, 64, 150} (several chunks, empty, short, tails); row 3
  // starts fresh on a slot full of NaN; row 1 is padding. At both chunk sizes compiled (32, 64),
  // forced for every sequence as the tests and benchmarks can.
  for (int chunk_size : {32, 64}) {
    const std::string ctag = tag + " C=" + std::to_string(chunk_size);
    const std::vector<int32_t> lens = {70, 0, 5, 64, 150};
    const int64_t S = 5;
    std::vector<int32_t> qsl(S + 1, 0);
    for (int64_t s = 0; s < S; ++s) qsl[s + 1] = qsl[s] + lens[s];
    const int64_t T = qsl[S] + 1;
    std::vector<int32_t> idx = {2, -1, 5, 6, 1};
    std::vector<uint8_t> hs = {1, 1, 1, 0, 1};
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
    p.eps = float(eps); p.l2norm = true; p.chunk_size = chunk_size;
    const std::vector<uint8_t> st0 = st;
    kt.chunk(p, Parallel{});
    check_mixed_qkv("chunk, mixed qkv rows = dense " + ctag, p, q, k, v, act, st0, o, st,
                    [&](const ChunkArgs& m) { kt.chunk(m, Parallel{}); });
    check_row_filter("chunk, row filter " + ctag, p, HV * V * es, st0, o, st,
                     [](ChunkArgs& a, void* out, void* state) { a.o = out; a.ssm_state = state; },
                     [&](const ChunkArgs& m) { kt.chunk(m, Parallel{}); });
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
    check("chunk o              " + ctag, rel_rmse(read_act(o.data(), act, T * HV * V), orf), f32all ? 1e-5 : 3e-3);
    // bf16 state: one rounding of the final state (and of the initial one, already in S0r).
    check("chunk final state    " + ctag, rel_rmse(read_act(st.data(), sdt, S0.size()), sref),
          sdt == DType::bf16 ? 4e-3 : (act == DType::f32 ? 1e-5 : 2e-3));
  }
}

// Non-finite values through the recurrence (decode and spec rows): a start slot with +Inf,
// -Inf and NaN in a few elements (a full 32-column block and the 16-column tail piece), a NaN
// in v, in k (every column of its head), in b (beta) and in a (alpha); a spec row carries a
// NaN from its first token to the states after it. Against float64 element by element: NaN
// exactly where float64 is NaN, the same infinity where it is infinite, the finite rest within
// the usual budgets (the state's one rounding for a bf16 pool). With f32 activations the NaNs
// reach the bf16 store with full payloads, so this also guards the store's NaN test.
void test_recurrent_nonfinite(const KernelTable& kt, DType act, DType sdt, std::mt19937& rng) {
  const int64_t H = 1, HV = 2, K = 32, V = 48, N = 9;
  const double eps = 1e-6, scale = 1.0 / std::sqrt(double(K));
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  const int64_t slot_elems = HV * K * V;
  std::vector<double> S0(N * slot_elems);
  std::normal_distribution<double> nd(0, 0.1);
  for (auto& x : S0) x = nd(rng);
  auto at = [&](int64_t slot, int64_t h, int64_t k, int64_t c) -> double& {
    return S0[size_t(((slot * HV + h) * K + k) * V + c)];
  };
  at(0, 0, 3, 5) = inf;     // full block
  at(0, 0, 10, 33) = -inf;  // tail piece
  at(0, 1, 7, 40) = nan;
  // Rows: 0 decode from slot 0; 1 decode, NaN in v; 2 decode, NaN in k; 3 decode, NaN in b
  // (head 1) and a (head 0); 4 spec of 3 tokens from slot 0 (acc 1): the start's Inf / NaN
  // carried through f32 between its tokens.
  RecRows rw{{0, 1, 2, 3, 4, 7}, {0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1, -1, 4, 5, 6}, {1, 1, 1, 1, 1}, 3, 7};
  const int64_t T = rw.T;
  // Row 4 reads slot 0 too, which row 0 writes: give row 0 a copy in slot 7 instead.
  std::copy(S0.begin(), S0.begin() + slot_elems, S0.begin() + 7 * slot_elems);
  rw.idx[0] = 7;
  Act q(T * H * K, rng), k(T * H * K, rng), v(T * HV * V, rng), a(T * HV, rng), b(T * HV, rng);
  // NaNs with every payload bit set: rounding such an f32 NaN to bf16 without the NaN test
  // carries into the sign or out of the word (-0 or +0), so these catch a missing test.
  auto poison = [&](Act& x, size_t i, bool negative) {
    const uint32_t bits = negative ? 0xffffffffu : 0x7fffffffu;
    std::memcpy(&x.f32[i], &bits, 4);
    x.b16[i] = uint16_t(bits >> 16);
    x.f64[i] = nan;
  };
  poison(v, size_t((1 * HV + 0) * V + 20), false);
  poison(k, size_t((2 * H + 0) * K + 9), true);
  poison(b, size_t(3 * HV + 1), false);
  poison(a, size_t(3 * HV + 0), true);
  std::vector<uint8_t> pool(S0.size() * (sdt == DType::f32 ? 4 : 2));
  store_state(pool, sdt, S0);
  const std::vector<double> S0r = read_act(pool.data(), sdt, S0.size());
  const RecGates gt(HV);
  std::vector<uint8_t> o(T * HV * V * 4, 0xff), st = pool;
  kt.recurrent(rec_args(act, sdt, q, k, v, a, b, gt, rw, st.data(), o.data(), N, H, HV, K, V, scale, eps),
               Parallel{});
  std::vector<double> orf, sref;
  rec_oracle(q, k, v, a, b, gt, rw, S0r, H, HV, K, V, scale, eps, orf, sref);
  const std::string tag = std::string(kt.isa) + (act == DType::f32 ? " act f32" : " act bf16") +
                          (sdt == DType::f32 ? " state f32" : " state bf16");
  auto compare = [&](const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                     double budget) {
    std::vector<double> gf, wf;
    int64_t bad = 0, nonfinite = 0;
    std::string first;
    for (size_t i = 0; i < want.size(); ++i) {
      const double w = want[i], g = got[i];
      bool ok;
      if (std::isnan(w)) ok = std::isnan(g);
      else if (std::isinf(w)) ok = g == w;
      else ok = std::isfinite(g);
      if (!std::isfinite(w)) ++nonfinite;
      else if (ok) { gf.push_back(g); wf.push_back(w); }
      if (!ok && bad++ == 0) first = "element " + std::to_string(i) + " got " + std::to_string(g) + " want " + std::to_string(w);
    }
    check_true(what + " non-finite where float64 is " + tag, bad == 0 && nonfinite > 0,
               bad ? std::to_string(bad) + " bad, first: " + first : std::to_string(nonfinite) + " non-finite");
    check(what + " finite rest " + tag, rel_rmse(gf, wf), budget);
  };
  const bool f32all = act == DType::f32 && sdt == DType::f32;
  compare("recurrent non-finite o    ", read_act(o.data(), act, T * HV * V), orf, f32all ? 1e-5 : 2e-3);
  compare("recurrent non-finite state", read_act(st.data(), sdt, S0.size()), sref,
          sdt == DType::bf16 ? 4e-3 : (act == DType::f32 ? 1e-5 : 1e-4));
}

// The serving step's prefill (conv_chunk: the conv's outputs made per chunk and fed to the
// chunk without a [T, D] result) gives the bits of conv_fwd into y followed by the chunk reading
// q, k, v from y's rows, with the step's row filters (conv: prefill rows; chunk: prefill and
// padding rows): the output, both pools, y untouched. Lengths {40, 0, 5, 70, 1, 3}: several
// chunks at either size, empty, short, a decode-kind row (another kernel's: nothing of it
// written), padding; fresh and continued sequences. `par`: serial, or real threads with a
// smaller head group. (Small on purpose: it runs on the slow ISAs and under qemu in CI.)
void test_conv_chunk(const KernelTable& kt, DType act, DType sdt, int W, bool ds, bool silu, const GdnCase& c,
                     Parallel par, const std::string& par_tag, std::mt19937& rng) {
  const int64_t H = c.H, HV = c.HV, K = c.K, V = c.V, N = 9, D = 2 * H * K + HV * V, L = W - 1;
  const int64_t es = act == DType::f32 ? 4 : 2;
  const std::vector<int32_t> lens = {40, 0, 5, 70, 1, 3}, kind = {1, 1, 1, 1, 2, 0};
  const std::vector<int32_t> idx = {2, 0, 5, 1, 3, -1};
  const std::vector<uint8_t> hs = {1, 1, 0, 1, 1, 0};
  const int64_t S = int64_t(lens.size());
  std::vector<int32_t> qsl(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) qsl[s + 1] = qsl[s] + lens[s];
  const int64_t T = qsl[S] + 2;  // two tokens no row covers
  Act x(T * D, rng), conv0(N * L * D, rng), wa(D * W, rng, 0.5), ba(D, rng, 0.5), ssm0(N * HV * K * V, rng, 0.1);
  std::vector<float> g(T * HV), beta(T * HV);
  std::uniform_real_distribution<float> ug(-0.3f, 0.f), ub(0.f, 1.f);
  for (auto& v : g) v = ug(rng);
  for (auto& v : beta) v = ub(rng);
  auto bytes = [](const Act& a, DType t) {
    const auto* p = static_cast<const uint8_t*>(a.ptr(t));
    return std::vector<uint8_t>(p, p + a.f32.size() * (t == DType::f32 ? 4 : 2));
  };
  const std::vector<uint8_t> cpool0 = bytes(conv0, act), spool0 = bytes(ssm0, sdt);
  ConvArgs f{};
  f.act = act; f.x = x.ptr(act); f.weight = wa.ptr(DType::f32); f.bias = ba.ptr(DType::bf16);
  f.weight_dtype = DType::f32; f.bias_dtype = DType::bf16; f.T = T; f.D = D; f.W = W; f.silu = silu;
  f.N = N; f.L = L; f.slot_stride = L * D; f.time_stride = ds ? 1 : D; f.chan_stride = ds ? L : 1;
  f.query_start_loc = qsl.data(); f.state_indices = idx.data();
  f.has_initial_state = reinterpret_cast<const bool*>(hs.data()); f.S = S;
  f.rows = RowFilter{kind.data(), 1u << 1};
  ChunkArgs p{};
  p.act = act; p.state = sdt; p.g = g.data(); p.beta = beta.data(); p.query_start_loc = qsl.data();
  p.state_indices = idx.data(); p.has_initial_state = f.has_initial_state; p.T = T; p.S = S; p.N = N; p.H = H;
  p.HV = HV; p.K = K; p.V = V; p.scale = float(1.0 / std::sqrt(double(K))); p.eps = 1e-6f; p.l2norm = true;
  p.qk_ld = p.v_ld = D;
  p.rows = RowFilter{kind.data(), (1u << 1) | 1u};
  auto point = [&](std::vector<uint8_t>& y, std::vector<uint8_t>& o, std::vector<uint8_t>& cpool,
                   std::vector<uint8_t>& spool) {
    f.y = y.data(); f.conv_state = cpool.data();
    p.q = y.data(); p.k = y.data() + H * K * es; p.v = y.data() + 2 * H * K * es;
    p.o = o.data(); p.ssm_state = spool.data();
  };
  const std::string tag = std::string(kt.isa) + (act == DType::f32 ? " act f32" : " act bf16") +
                          (sdt == DType::f32 ? " state f32" : " state bf16") + " W=" + std::to_string(W) +
                          (ds ? " DS" : " SD") + (silu ? "" : " no silu") + " HV" + std::to_string(HV) + "/H" +
                          std::to_string(H) + " " + par_tag;
  for (int chunk_size : {32, 64}) {
    p.chunk_size = chunk_size;
    std::vector<uint8_t> y1(T * D * es, 0xcd), o1(T * HV * V * es, 0xee), c1 = cpool0, s1 = spool0;
    point(y1, o1, c1, s1);
    kt.conv_fwd(f, par);
    kt.chunk(p, par);
    std::vector<uint8_t> y2(T * D * es, 0xcd), o2(T * HV * V * es, 0xee), c2 = cpool0, s2 = spool0;
    point(y2, o2, c2, s2);
    kt.conv_chunk(f, p, par);
    bool y_untouched = true;
    for (uint8_t b : y2) y_untouched &= b == 0xcd;
    bool dec_untouched = true;  // the decode row's token (another kernel's)
    for (int64_t i = qsl[4] * HV * V * es; i < qsl[5] * HV * V * es; ++i) dec_untouched &= o2[size_t(i)] == 0xee;
    check_true("conv_chunk = conv_fwd + chunk " + tag + " C=" + std::to_string(chunk_size),
               o1 == o2 && c1 == c2 && s1 == s2 && y_untouched && dec_untouched,
               std::string(o1 == o2 ? "" : "output ") + (c1 == c2 ? "" : "conv_state ") +
                   (s1 == s2 ? "" : "ssm_state ") + (y_untouched ? "" : "y written ") +
                   (dec_untouched ? "" : "decode row written"));
  }
}

// The huge-page hint of large outputs: the range is the whole 2 MiB pages inside the buffer
// (none below two of them), and on Linux the hint is accepted for an anonymous mapping.
void test_huge_page_hint() {
  const uintptr_t M = kHugePage;
  struct Case { uintptr_t p; size_t bytes; uintptr_t a, e; };
  const Case cases[] = {
      {4 * M, 4 * M, 4 * M, 8 * M},                // aligned: all of it
      {4 * M + 64, 4 * M, 5 * M, 8 * M},           // start rounded up, end rounded down
      {4 * M + 64, 2 * M + 100, 5 * M, 6 * M},     // two pages long, one whole page inside
      {4 * M, 2 * M - 1, 4 * M, 4 * M},            // under two pages: empty
      {4 * M + 64, 2 * M - 1, 4 * M + 64, 4 * M + 64},
      {4 * M - 1, 3 * M + 2, 4 * M, 7 * M},
  };
  bool ok = true;
  std::string detail;
  for (const Case& c : cases) {
    uintptr_t a, e;
    huge_page_range(reinterpret_cast<const void*>(c.p), c.bytes, &a, &e);
    if (a != c.a || e != c.e) {
      ok = false;
      detail += " [" + std::to_string(c.p) + "+" + std::to_string(c.bytes) + " -> " + std::to_string(a) + ", " +
                std::to_string(e) + "]";
    }
  }
  check_true("huge_page_range: whole 2 MiB pages inside the buffer", ok, detail);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const size_t bytes = 16 * M;
  void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m != MAP_FAILED) {
    std::memset(m, 1, 4096);
    const bool advised = advise_huge_pages(m, bytes);
    const bool kept = static_cast<unsigned char*>(m)[4095] == 1 && static_cast<unsigned char*>(m)[0] == 1;
    // madvise(MADV_HUGEPAGE) fails only where the kernel has no THP at all (EINVAL).
    FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    const bool thp = f != nullptr;
    if (f) std::fclose(f);
    check_true("advise_huge_pages on a 32 MiB mapping", (advised || !thp) && kept,
               std::string(advised ? "accepted" : "refused") + (thp ? "" : " (no THP in this kernel)"));
    munmap(m, bytes);
  }
#endif
}

// The benchmarks' peak probes count their work right: the f32 FMA probe sums to
// iters * fmas * 2^-20 exactly (each FMA adds 2^-10 * 2^-10), and the bf16 dot probe (present
// exactly on the ISAs with a bf16 dot instruction) to iters * macs * 2^-20 (its operands are 1
// and 2^-20, see probe.h). The spec-pattern piece rewrites its piece in place (x * 0.5 + 0.5)
// and gives the three pieces after it the same values, through this ISA's streamed stores.
void test_probes(const std::string& isa, const KernelTable& kt) {
  {
    const int64_t n = 16384;
    const int64_t g = kSpecProbeGroup;
    std::vector<float> mem(size_t(g * n + 16));
    float* buf = mem.data() + (64 - reinterpret_cast<uintptr_t>(mem.data()) % 64) % 64 / sizeof(float);
    for (int64_t i = 0; i < g * n; ++i) buf[i] = float(i % 1000) - (i >= n ? 7.f : 0.f);
    const float first = kt.spec_probe_piece(buf, n);
    bool ok = first == 0.5f && g == 4;  // roofline.SPEC_GROUP counts the bytes with 4
    for (int64_t c = 0; c < g; ++c)
      for (int64_t i = 0; i < n; ++i) ok = ok && buf[c * n + i] == float(i % 1000) * 0.5f + 0.5f;
    check_true("spec_probe_piece " + isa + ": the piece rewritten in place, copied to the next three", ok);
  }
  {  // every accumulator gains exactly 2^-10 * 2^-10 per iteration
    const int64_t iters = 256;
    const double want_sum = double(iters) * double(kt.fma_probe_flops / 2) * std::ldexp(1.0, -20);
    const double got = kt.fma_probe(iters);
    check_true("fma_probe " + isa + " = iters * fmas * 2^-20", kt.fma_probe_flops > 0 && got == want_sum,
               "got " + std::to_string(got) + ", want " + std::to_string(want_sum));
  }
  const bool want = isa == "avx512bf16" || isa == "amx" || isa == "amx_model" || isa == "neon_bf16";
  check_true("bf16_dot_probe " + isa + (want ? " present" : " absent"), (kt.bf16_dot_probe != nullptr) == want);
  if (!kt.bf16_dot_probe) return;
  const int64_t iters = 256;
  const double macs = double(kt.bf16_dot_probe_flops) / 2;
  const double want_sum = double(iters) * macs * std::ldexp(1.0, -20);
  const double got = kt.bf16_dot_probe(iters);
  check_true("bf16_dot_probe " + isa + " = iters * macs * 2^-20", got == want_sum,
             "got " + std::to_string(got) + ", want " + std::to_string(want_sum));
}

// The ISA's vector f32 -> bf16 store, bit for bit against round-to-nearest-even with NaN kept
// as the same NaN made quiet: every high half with low halves at the rounding edges (ties
// either way, one off, all ones), so NaNs whose payload is only in the low half (a plain
// rounding add turns those into Inf or carries into the sign), Inf, the largest finite
// values (which round to Inf), zeros and denormals. ISAs converting in hardware (AVX512-BF16,
// AMX, Armv8.6 BFCVT) may flush a denormal input to a zero of its sign. A short tail checks
// vstore_n.
void test_bf16_rounding(const std::string& isa, const KernelTable& kt) {
  const bool hw = isa == "avx512bf16" || isa == "amx" || isa == "neon_bf16";
  const uint32_t lows[] = {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu};
  std::vector<uint32_t> in;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi)
    for (uint32_t lo : lows) in.push_back(hi << 16 | lo);
  for (uint32_t u : {0x7f800001u, 0x7fffffffu, 0xff808000u, 0x3f808000u, 0x00000001u, 0x7f7fffffu, 0x40400000u})
    in.push_back(u);  // 7 more: a partial last vector
  std::vector<float> x(in.size());
  std::memcpy(x.data(), in.data(), in.size() * 4);
  std::vector<uint16_t> y(in.size(), 0x1234u);
  kt.round_bf16(x.data(), reinterpret_cast<bf16*>(y.data()), int64_t(in.size()));
  int64_t bad = 0;
  std::string first;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint32_t u = in[i];
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint16_t want = nan ? uint16_t((u >> 16) | 0x40u) : bf16_bits(x[i]);
    const bool denormal = (u & 0x7f800000u) == 0 && (u & 0x7fffffu) != 0;
    const bool ok = y[i] == want || (hw && denormal && y[i] == uint16_t((u >> 16) & 0x8000u));
    if (!ok && bad++ == 0) {
      char buf[96];
      std::snprintf(buf, sizeof buf, "0x%08x -> 0x%04x, want 0x%04x", u, unsigned(y[i]), unsigned(want));
      first = buf;
    }
  }
  check_true("bf16 rounding " + isa + " (" + std::to_string(in.size()) + " values) = RNE, NaN quiet", bad == 0,
             bad == 0 ? "" : std::to_string(bad) + " differ, first " + first);

  // The recurrence's bf16-state conversions (the pair order on AVX2 and AVX-512): the same bits in memory
  // order as the plain store, and the exact widening back.
  std::vector<uint16_t> yp(in.size(), 0x1234u);
  std::vector<uint32_t> w(in.size(), 0x12345678u);
  kt.round_bf16_pairs(x.data(), reinterpret_cast<bf16*>(yp.data()), reinterpret_cast<float*>(w.data()),
                      int64_t(in.size()));
  int64_t bad_round = 0, bad_widen = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    bad_round += yp[i] != y[i];
    bad_widen += w[i] != uint32_t(yp[i]) << 16;
  }
  check_true("bf16 pair order " + isa + " = the plain store's bits, widened exactly", bad_round == 0 && bad_widen == 0,
             std::to_string(bad_round) + " rounded differently, " + std::to_string(bad_widen) + " widened wrong");
}

#if GDN_TEST_AMX
// --- AMX tile model (x86 builds) ------------------------------------------------------------
namespace am = gdn::amx_model_test;

struct TileCfg {
  uint8_t b[64] = {};
  TileCfg() { b[0] = 1; }
  TileCfg& tile(int t, int rows, int colsb) {
    b[16 + 2 * t] = uint8_t(colsb & 0xff);
    b[17 + 2 * t] = uint8_t(colsb >> 8);
    b[48 + t] = uint8_t(rows);
    return *this;
  }
};

float f32_of_bits(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
uint32_t bits_of_f32(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
// The SDM's make_fp32 with DAZ, and FTZ on an f32 result.
float daz_bf16(uint16_t h) { return (h & 0x7f80u) == 0 ? f32_of_bits(uint32_t(h & 0x8000u) << 16) : bf16_value(h); }
float ftz(float x) { return (bits_of_f32(x) & 0x7f800000u) == 0 ? f32_of_bits(bits_of_f32(x) & 0x80000000u) : x; }

// TDPBF16PS transcribed from the Intel SDM pseudo-code with std::fma (f32, one rounding):
// even/odd partial sums per column over k, then C += even + odd. a: rows x 2kp bf16 (row
// stride 2kp), b: kp x 2n VNNI, c: rows x n f32, updated in place.
void tdpbf16ps_transcribed(int rows, int n, int kp, const uint16_t* a, const uint16_t* b, float* c) {
  for (int m = 0; m < rows; ++m) {
    std::vector<float> even(n, 0.f), odd(n, 0.f);
    for (int k = 0; k < kp; ++k)
      for (int j = 0; j < n; ++j) {
        even[j] = ftz(std::fma(daz_bf16(a[m * 2 * kp + 2 * k]), daz_bf16(b[k * 2 * n + 2 * j]), even[j]));
        odd[j] = ftz(std::fma(daz_bf16(a[m * 2 * kp + 2 * k + 1]), daz_bf16(b[k * 2 * n + 2 * j + 1]), odd[j]));
      }
    for (int j = 0; j < n; ++j) c[m * n + j] = ftz(ftz(c[m * n + j]) + ftz(even[j] + odd[j]));
  }
}

// One tdpbf16ps of a rows x (2kp) A by a kp x n VNNI B into a nonzero C, all shapes from the
// config; checked against a float64 product (error bound of f32 summation) and bit for bit
// against the transcription above; stored bytes and the register's zeroed parts checked too.
void test_amx_model_dp(int rows, int n, int kp, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const int lda = 2 * kp + 6, ldb = 2 * n + 2, ldc = n + 5;  // element strides wider than the rows
  std::vector<uint16_t> a(rows * lda, 0xffff), b(kp * ldb, 0xffff);  // padding: NaN bits, must be ignored
  std::vector<float> c(rows * ldc, std::nanf(""));
  for (int m = 0; m < rows; ++m)
    for (int k = 0; k < 2 * kp; ++k) a[m * lda + k] = bf16_bits(nd(rng));
  for (int k = 0; k < kp; ++k)
    for (int j = 0; j < 2 * n; ++j) b[k * ldb + j] = bf16_bits(nd(rng));
  for (int m = 0; m < rows; ++m)
    for (int j = 0; j < n; ++j) c[m * ldc + j] = 4.f * nd(rng);
  TileCfg cfg;
  cfg.tile(0, rows, 4 * n).tile(5, rows, 4 * kp).tile(7, kp, 4 * n);
  am::ldtilecfg(cfg.b);
  am::tileloadd(0, c.data(), ldc * 4);
  am::tileloadd(5, a.data(), lda * 2);
  am::tileloadd(7, b.data(), ldb * 2);
  am::tdpbf16ps(0, 5, 7);
  const float sentinel = -12345.f;
  std::vector<float> out(rows * ldc + 16 * ldc, sentinel);
  am::tilestored(0, out.data(), ldc * 4);
  std::vector<uint8_t> raw(am::tile_bytes(0), am::tile_bytes(0) + 1024);
  am::tilerelease();

  // float64 product and the f32 summation bound (2kp + 2 roundings of partial sums).
  double worst = 0;
  std::vector<uint16_t> ap(rows * 2 * kp), bp(kp * 2 * n);
  std::vector<float> ct(rows * n);
  for (int m = 0; m < rows; ++m) {
    for (int k = 0; k < 2 * kp; ++k) ap[m * 2 * kp + k] = a[m * lda + k];
    for (int j = 0; j < n; ++j) {
      double ref = c[m * ldc + j], mag = std::fabs(ref);
      for (int k = 0; k < kp; ++k)
        for (int e = 0; e < 2; ++e) {
          const double t = double(bf16_value(a[m * lda + 2 * k + e])) * bf16_value(b[k * ldb + 2 * j + e]);
          ref += t;
          mag += std::fabs(t);
        }
      const double bound = (2 * kp + 2) * std::ldexp(1.0, -24) * mag;
      worst = std::max(worst, std::fabs(out[m * ldc + j] - ref) / bound);
      ct[m * n + j] = c[m * ldc + j];
    }
  }
  for (int k = 0; k < kp; ++k)
    for (int j = 0; j < 2 * n; ++j) bp[k * 2 * n + j] = b[k * ldb + j];
  tdpbf16ps_transcribed(rows, n, kp, ap.data(), bp.data(), ct.data());
  bool same = true, untouched = true, zeroed = true;
  for (int m = 0; m < rows + 16; ++m)
    for (int j = 0; j < ldc; ++j) {
      const float v = out[m * ldc + j];
      if (m < rows && j < n) same &= bits_of_f32(v) == bits_of_f32(ct[m * n + j]);
      else untouched &= v == sentinel;
    }
  for (int r = 0; r < 16; ++r)
    for (int byte = 0; byte < 64; ++byte)
      if (r >= rows || byte >= 4 * n) zeroed &= raw[r * 64 + byte] == 0;
  char tag[96];
  std::snprintf(tag, sizeof tag, "amx model tdpbf16ps C %dx%d += A %dx%d . B", rows, n, rows, 2 * kp);
  char detail[64];
  std::snprintf(detail, sizeof detail, "max err / f32 bound %.2f", worst);
  check_true(std::string(tag) + " vs f64", worst <= 1.0, detail);
  check_true(std::string(tag) + " = SDM transcription", same);
  check_true(std::string(tag) + " store/zero shape", untouched && zeroed);
}

// Denormal inputs are zero (DAZ), denormal results flush (FTZ), the pair order of the
// accumulation is the SDM's (even and odd sums apart, then added).
void test_amx_model_dp_edges() {
  auto one = [](uint16_t a0, uint16_t a1, uint16_t b0, uint16_t b1, float c0) {
    TileCfg cfg;
    cfg.tile(0, 1, 4).tile(1, 1, 4).tile(2, 1, 4);
    uint16_t a[2] = {a0, a1}, b[2] = {b0, b1};
    am::ldtilecfg(cfg.b);
    am::tileloadd(0, &c0, 4);
    am::tileloadd(1, a, 4);
    am::tileloadd(2, b, 4);
    am::tdpbf16ps(0, 1, 2);
    float c;
    am::tilestored(0, &c, 4);
    am::tilerelease();
    return c;
  };
  const uint16_t two100 = bf16_bits(std::ldexp(1.f, 100)), tiny = bf16_bits(std::ldexp(1.f, -70));
  check_true("amx model DAZ: denormal bf16 input is zero", one(0x0040, 0, two100, 0, 0.f) == 0.f);
  check_true("amx model FTZ: 2^-70 * 2^-70 flushes", one(tiny, 0, tiny, 0, 0.f) == 0.f);
  check_true("amx model normal control: 2^-60 * 2^-60 = 2^-120",
             one(bf16_bits(std::ldexp(1.f, -60)), 0, bf16_bits(std::ldexp(1.f, -60)), 0, 0.f) == std::ldexp(1.f, -120));
  // even = (1 + 2^-7)^2 = 1 + 2^-6 + 2^-14 (exact), odd = 1.5 * 2^-30, C = -1. SDM order:
  // even + odd rounds the odd part away at 1, so C = 2^-6 + 2^-14. Adding the products to C
  // one after the other would keep it: 2^-6 + 2^-14 + 2^-29 (1.5 * 2^-30 is 0.75 ulp there).
  const uint16_t x = bf16_bits(1.f + std::ldexp(1.f, -7));
  const float got = one(x, bf16_bits(1.5f * std::ldexp(1.f, -15)), x, bf16_bits(std::ldexp(1.f, -15)), -1.f);
  const float sdm = std::ldexp(1.f, -6) + std::ldexp(1.f, -14);
  const float sequential = (-1.f + float(1.0 + std::ldexp(1.0, -6) + std::ldexp(1.0, -14))) + 1.5f * std::ldexp(1.f, -30);
  check_true("amx model accumulation order: C + (even + odd)", got == sdm && sequential != sdm);
}

// tileloadd fills the configured rows x colsb and clears the rest of the register (stale
// contents planted first); tilestored writes exactly rows x colsb at the stride.
void test_amx_model_load_store() {
  const int rows = 5, colsb = 24, stride = 40;
  std::vector<uint8_t> src(16 * stride);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint8_t(i * 7 + 3);
  TileCfg cfg;
  cfg.tile(3, rows, colsb);
  am::ldtilecfg(cfg.b);
  std::memset(am::tile_bytes(3), 0xab, 1024);  // stale contents
  am::tileloadd(3, src.data(), stride);
  bool ok = true;
  for (int r = 0; r < 16; ++r)
    for (int byte = 0; byte < 64; ++byte)
      ok &= am::tile_bytes(3)[r * 64 + byte] == (r < rows && byte < colsb ? src[r * stride + byte] : 0);
  check_true("amx model tileloadd 5x24B: shape loaded, rest zeroed", ok);
  std::vector<uint8_t> dst(16 * stride, 0xcd);
  am::tilestored(3, dst.data(), stride);
  ok = true;
  for (int r = 0; r < 16; ++r)
    for (int byte = 0; byte < stride; ++byte)
      ok &= dst[r * stride + byte] == (r < rows && byte < colsb ? src[r * stride + byte] : 0xcd);
  check_true("amx model tilestored 5x24B: only the shape written", ok);
  am::tilezero(3);
  ok = true;
  for (int i = 0; i < 1024; ++i) ok &= am::tile_bytes(3)[i] == 0;
  check_true("amx model tilezero", ok);
  am::tilerelease();
}

// What the hardware refuses, the model must refuse too (it aborts with a message): run in a
// child process, expect SIGABRT and the reason on stderr. The valid control must exit 0.
template <class F>
void expect_fault(const std::string& what, const char* reason, F&& f) {
  int pipefd[2];
  if (pipe(pipefd) != 0) { check_true("amx model fault: " + what, false, "pipe failed"); return; }
  std::fflush(stdout);
  const pid_t pid = fork();
  if (pid == 0) {
    close(pipefd[0]);
    dup2(pipefd[1], 2);
    f();
    _exit(0);
  }
  close(pipefd[1]);
  std::string err;
  char buf[256];
  ssize_t got;
  while ((got = read(pipefd[0], buf, sizeof buf)) > 0) err.append(buf, size_t(got));
  close(pipefd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  const bool faulted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  if (reason == nullptr) {
    check_true("amx model control (valid ops): " + what, WIFEXITED(status) && WEXITSTATUS(status) == 0, err);
  } else {
    check_true("amx model fault: " + what, faulted && err.find(reason) != std::string::npos,
               err.empty() ? "no message" : err.substr(0, err.size() - 1));
  }
}

void test_amx_model_faults() {
  float buf[256] = {};
  expect_fault("full 16x64B config, load, dp, store", nullptr, [&] {
    TileCfg c; c.tile(0, 16, 64).tile(1, 16, 64).tile(2, 16, 64);
    am::ldtilecfg(c.b); am::tileloadd(1, buf, 64); am::tileloadd(2, buf, 64); am::tdpbf16ps(0, 1, 2);
    am::tilestored(0, buf, 64); am::tilerelease();
  });
  expect_fault("rows 17", "rows > 16", [&] { TileCfg c; c.tile(0, 17, 64); am::ldtilecfg(c.b); });
  expect_fault("colsb 68", "colsb > 64", [&] { TileCfg c; c.tile(0, 16, 68); am::ldtilecfg(c.b); });
  expect_fault("tile 8 in palette 1", "tile >= 8", [&] { TileCfg c; c.tile(8, 1, 4); am::ldtilecfg(c.b); });
  expect_fault("palette 2", "palette", [&] { TileCfg c; c.b[0] = 2; am::ldtilecfg(c.b); });
  expect_fault("load without config", "no tile configuration", [&] { am::tileloadd(0, buf, 64); });
  expect_fault("unconfigured tile", "not configured", [&] {
    TileCfg c; c.tile(0, 4, 16); am::ldtilecfg(c.b); am::tilezero(1);
  });
  expect_fault("after tilerelease", "no tile configuration", [&] {
    TileCfg c; c.tile(0, 4, 16); am::ldtilecfg(c.b); am::tilerelease(); am::tilezero(0);
  });
  expect_fault("dp C.rows != A.rows", "C.rows != A.rows", [&] {
    TileCfg c; c.tile(0, 4, 64).tile(1, 5, 64).tile(2, 16, 64); am::ldtilecfg(c.b); am::tdpbf16ps(0, 1, 2);
  });
  expect_fault("dp A.colsb / 4 != B.rows", "B.rows", [&] {
    TileCfg c; c.tile(0, 4, 64).tile(1, 4, 60).tile(2, 16, 64); am::ldtilecfg(c.b); am::tdpbf16ps(0, 1, 2);
  });
  expect_fault("dp C.colsb != B.colsb", "C.colsb != B.colsb", [&] {
    TileCfg c; c.tile(0, 4, 32).tile(1, 4, 64).tile(2, 16, 64); am::ldtilecfg(c.b); am::tdpbf16ps(0, 1, 2);
  });
  expect_fault("dp colsb not a multiple of 4", "multiple of 4", [&] {
    TileCfg c; c.tile(0, 4, 30).tile(1, 4, 64).tile(2, 16, 30); am::ldtilecfg(c.b); am::tdpbf16ps(0, 1, 2);
  });
  expect_fault("dp with a tile twice", "twice", [&] {
    TileCfg c; c.tile(0, 16, 64).tile(1, 16, 64); am::ldtilecfg(c.b); am::tdpbf16ps(0, 1, 1);
  });
}

// The packed projection's tile paths through the model, at sizes the kernel table sends to the
// unpacked tiles: x packed in panels of 64 rows (several panels, the last partial) with w
// groups of 2 block pairs (several groups, the last short, a last pair of one block) and with
// the defaults (panels of 8 MiB of packed x: one panel here; one group), against float64 and
// bit for bit against the unpacked tiles (every row count here stays on tiles there: the rows
// left after the 16-row tiles are 0 or at least kAmxMinRows), on 1 and 3 threads; nothing
// written past y.
void test_amx_linear_panels(std::mt19937& rng) {
  for (auto s : {std::array<int64_t, 3>{150, 100, 600}, {37, 64, 40}, {70, 33, 17}, {64, 2048, 32}})
    for (DType ydt : {DType::f32, DType::bf16}) {
      const int64_t T = s[0], in = s[1], out = s[2];
      const std::string tag = "amx linear panels y " + std::string(ydt == DType::f32 ? "f32 " : "bf16 ") +
                              std::to_string(T) + "x" + std::to_string(in) + "x" + std::to_string(out);
      Act x(size_t(T * in), rng), w(size_t(out * in), rng);
      const std::vector<uint16_t> wp = pack_w(w, in, out);
      const std::vector<double> ref = linear_f64(x, w, T, in, out);
      const size_t esz = ydt == DType::f32 ? 4 : 2, ybytes = size_t(T * out) * esz, guard = 64;
      const int64_t pair_bytes = (in + 1) / 2 * 2 * 16 * 2 * 2;  // a block pair of wp: 2 x 16 rows of in (even)
      ThreadedParallel tp{3};
      std::vector<std::vector<uint8_t>> ys;
      for (auto run : {std::array<int64_t, 3>{0, 0, 1}, {64, 2 * pair_bytes, 1}, {64, 2 * pair_bytes, 3},
                       {-1, int64_t(1) << 20, 3}}) {
        std::vector<uint8_t> y(ybytes + guard, 0xAB);
        LinearArgs p{DType::bf16, DType::bf16, ydt, x.ptr(DType::bf16), wp.data(), y.data(), T, in, out};
        am::linear_packed_tiles(one_part(p), run[2] == 3 ? tp.par() : Parallel{}, run[0], run[1]);
        check_true(tag + " nothing written past y (panel " + std::to_string(run[0]) + ", " + std::to_string(run[2]) +
                       " thread" + (run[2] == 1 ? ")" : "s)"),
                   std::all_of(y.begin() + ybytes, y.end(), [](uint8_t b) { return b == 0xAB; }));
        y.resize(ybytes);
        ys.push_back(y);
      }
      check_linear_y(tag, read_act(ys[1].data(), ydt, size_t(T * out)), ref, ydt);
      check_true(tag + ": panels, 1 and 3 threads, bit-identical to the unpacked tiles",
                 ys[1] == ys[0] && ys[2] == ys[0] && ys[3] == ys[0]);
    }
}

// AMX availability: the verdict for each situation, and Linux's answer on this machine.
void test_amx_dispatch() {
  const AmxDecision no_cpu = decide_amx(false, true, 0), no_os = decide_amx(true, false, 0),
                    denied = decide_amx(true, true, 95), ok = decide_amx(true, true, 0);
  check_true("amx decision: CPU without AMX", !no_cpu.available && no_cpu.token.empty() &&
                                                   no_cpu.why.find("lacks a feature") != std::string::npos);
  check_true("amx decision: OS without tile state", !no_os.available && no_os.token == "amx_os_disabled");
  check_true("amx decision: permission refused (EOPNOTSUPP)",
             !denied.available && denied.token == "amx_permission_denied" &&
                 denied.why.find("refused tile data permission") != std::string::npos &&
                 denied.why.find("errno 95") != std::string::npos, denied.why);
  check_true("amx decision: all present", ok.available && ok.token.empty() && ok.why.empty());
  const std::vector<std::string> isas = available_isas();
  const bool amx_listed = std::find(isas.begin(), isas.end(), "amx") != isas.end();
  const std::string feats = " " + cpu_features() + " ";
  const int perm = request_amx_permission();
  char detail[64];
  std::snprintf(detail, sizeof detail, "arch_prctl -> %d", perm);
  if (amx_listed) check_true("amx permission granted (amx available)", perm == 0, detail);
  else if (feats.find(" amx_tile ") == std::string::npos)
    check_true("amx permission refused on a CPU without AMX", perm != 0, detail);
  check_true("amx_model listed last, after generic",
             isas.size() >= 2 && isas.back() == "amx_model" && isas[isas.size() - 2] == "generic");
}

#endif

// --- split-bf16 micro-GEMMs (chunk.h's gemm() contract) -------------------------------------
// The AMX GEMM through the tile model (x86) and the BFMMLA GEMM (aarch64 with BF16), through
// their test hooks, against a float64 product. layout of A: 0 row-major (csa = 1), 1
// transposed (rsa = 1), 2 other strides. Returns the rel RMSE over the entries the shape
// needs; checks that the others are untouched.
using SplitGemmFn = void (*)(int parts, bool out_bf16, int M, int N, int P, const float* A, int64_t rsa, int64_t csa,
                             const float* B, int64_t ldb, int64_t bsb, const float* Cin, int64_t ldc, int64_t bsc,
                             const float* crs, void* Cout, int64_t ldo, int64_t bso, int shape);

struct GemmCase {
  int M, N, P, layout, shape;
  bool cin, exact_a, exact_b;
};

double run_split_gemm(SplitGemmFn gemm, const GemmCase& g, int parts, std::mt19937& rng, bool* untouched, std::vector<float>* out_f32 = nullptr,
                    std::vector<uint16_t>* out_b16 = nullptr) {
  std::normal_distribution<float> nd(0.f, 1.f);
  const int M = g.M, N = g.N, P = g.P;
  int64_t rsa, csa;
  if (g.layout == 0) { rsa = P + 3; csa = 1; }
  else if (g.layout == 1) { rsa = 1; csa = M + 2; }
  else { rsa = 2; csa = 2 * M + 1; }
  std::vector<float> A(size_t((M + 2) * (P + 3) * 3 + 8), std::nanf(""));
  auto aat = [&](int i, int p) -> float& { return A[size_t(i * rsa + p * csa)]; };
  for (int i = 0; i < M; ++i)
    for (int p = 0; p < P; ++p) {
      float x = nd(rng);
      if (g.exact_a) x = bf16_value(bf16_bits(x));
      if (g.shape == 2 && p > i) x = 0.f;  // triangular depth: zeros stored above the diagonal
      aat(i, p) = x;
    }
  // B, Cin as panels (ld 16, bs 16 P) and Cout row-major with a wider row.
  std::vector<float> B(size_t(P * N + 16), std::nanf("")), Cin(size_t(M * N), 0.f), crs(M);
  for (auto& x : B) x = g.exact_b ? bf16_value(bf16_bits(nd(rng))) : nd(rng);
  for (auto& x : Cin) x = nd(rng);
  for (auto& x : crs) x = nd(rng);
  auto bat = [&](int p, int c) { return B[size_t((c / 16) * 16 * P + p * 16 + c % 16)]; };
  auto cat = [&](int i, int c) { return Cin[size_t((c / 16) * 16 * M + i * 16 + c % 16)]; };
  const int ldo = N + 16;
  const float sentinel = -777.f;
  std::vector<float> Cf(size_t(M * ldo), sentinel);
  std::vector<uint16_t> Cb(size_t(M * ldo), 0xdead);
  const bool bf16_out = out_b16 != nullptr;
  gemm(parts, bf16_out, M, N, P, A.data(), rsa, csa, B.data(), 16, 16 * P, g.cin ? Cin.data() : nullptr, 16,
           16 * M, g.cin ? crs.data() : nullptr, bf16_out ? (void*)Cb.data() : (void*)Cf.data(), ldo, 16, g.shape);
  std::vector<double> got, ref;
  *untouched = true;
  for (int i = 0; i < M; ++i)
    for (int c = 0; c < ldo; ++c) {
      const bool needed = c < N && !(g.shape == 1 && c / 16 > i / 16);
      const double v = bf16_out ? bf16_value(Cb[i * ldo + c]) : Cf[i * ldo + c];
      if (!needed) {
        *untouched &= bf16_out ? Cb[i * ldo + c] == 0xdead : Cf[i * ldo + c] == sentinel;
        continue;
      }
      double r = g.cin ? double(crs[i]) * cat(i, c) : 0.0;
      for (int p = 0; p < P; ++p) r += double(aat(i, p)) * bat(p, c);
      got.push_back(v);
      ref.push_back(r);
    }
  if (out_f32) *out_f32 = Cf;
  if (out_b16) *out_b16 = Cb;
  return rel_rmse(got, ref);
}

void test_split_gemm(const std::string& name, SplitGemmFn gemm, std::mt19937& rng) {
  const GemmCase cases[] = {
      {64, 128, 128, 0, 0, false, false, false},  // Q S0 at K = V = 128
      {128, 128, 64, 1, 0, true, false, false},   // state update: A = K^T by strides, Cin, row scale
      {37, 48, 45, 0, 0, true, false, false},     // M, N, depth tails
      {21, 32, 70, 2, 0, false, false, false},    // other strides
      {50, 64, 32, 0, 1, false, false, false},    // raw scores: triangular columns
      {60, 128, 60, 0, 2, true, false, false},    // P V_new: triangular depth, Cin
      {16, 16, 1, 0, 0, true, false, false},      // depth 1
      {3, 16, 0, 0, 0, true, false, false},       // depth 0: Cout = crs Cin
      {13, 16, 7, 1, 2, true, false, false},      // transposed, triangular depth, depth tail
      {9, 80, 3, 2, 1, true, false, false},       // strided, triangular columns past the rows
      {64, 80, 40, 0, 1, false, false, false},    // tiles stored in place: triangular, no 2nd column tile
      {96, 48, 33, 0, 0, false, false, false},    // tiles stored in place: no 2nd column tile, depth tail
  };
  for (const GemmCase& g : cases) {
    char tag[96];
    std::snprintf(tag, sizeof tag, "%s %dx%dx%d A%s%s%s", name.c_str(), g.M, g.N, g.P,
                  g.layout == 0 ? " rows" : g.layout == 1 ? " transposed" : " strided",
                  g.shape == 1 ? " tri-cols" : g.shape == 2 ? " tri-depth" : "", g.cin ? " +Cin" : "");
    bool untouched, u;
    std::mt19937 r1(rng), r2(rng), r3(rng);  // the same operands for every variant
    const double e2 = run_split_gemm(gemm, g, 2, r2, &untouched);
    const double e3 = run_split_gemm(gemm, g, 3, r3, &u);
    check(std::string(tag) + " 2 parts (bf16 act)", e2, 1e-5);
    check(std::string(tag) + " 3 parts (f32 act)", e3, 5e-7);
    check_true(std::string(tag) + " writes only what the shape needs", untouched && u);
    if (g.P >= 32) {
      const double e1 = run_split_gemm(gemm, g, 1, r1, &u);
      char d[96];
      std::snprintf(d, sizeof d, "plain bf16 %.1e, 2 parts %.1e, 3 parts %.1e", e1, e2, e3);
      // The split is what makes it accurate: one bf16 rounding per operand is ~2^-9.
      check_true(std::string(tag) + " parts matter", e1 > 30 * e2 && e2 > 10 * e3, d);
    }
    rng.discard(1);
  }
  // bf16 output: exactly the f32 result rounded once (RNE).
  {
    const GemmCase g{40, 48, 50, 0, 0, true, false, false};
    std::mt19937 r1(rng), r2(rng);
    bool u1, u2;
    std::vector<float> f;
    std::vector<uint16_t> b;
    run_split_gemm(gemm, g, 2, r1, &u1, &f, nullptr);
    const double e = run_split_gemm(gemm, g, 2, r2, &u2, nullptr, &b);
    bool same = true;
    for (int i = 0; i < g.M; ++i)
      for (int c = 0; c < g.N; ++c) same &= b[i * (g.N + 16) + c] == bf16_bits(f[i * (g.N + 16) + c]);
    check(name + " 40x48x50 bf16 output", e, 4e-3);
    check_true(name + " bf16 output = RNE(f32 output)", same && u1 && u2);
  }
  // Operands exact in bf16: the zero low parts are skipped, the result is the same as the
  // plain bf16 product, and only f32 accumulation error remains.
  {
    const GemmCase g{64, 64, 96, 0, 0, false, true, true};
    std::mt19937 r1(rng), r2(rng);
    bool u;
    std::vector<float> f1, f2;
    run_split_gemm(gemm, g, 1, r1, &u, &f1);
    const double e = run_split_gemm(gemm, g, 2, r2, &u, &f2);
    check(name + " exact-bf16 operands", e, 1e-6);
    check_true(name + " exact-bf16 operands: low parts skipped (= plain bf16)",
               std::memcmp(f1.data(), f2.data(), f1.size() * 4) == 0);
  }
}
}  // namespace

// GDN_CORE_TEST_ISAS=a,b: run the kernel tests of those ISAs only ("none": the dispatch line and
// the model tests alone). run_core_tests.sh sets it for the qemu CPU model without BF16, whose
// neon and generic kernels are the same instructions the BF16 model's run has just tested.
static bool isa_selected_for_tests(const std::string& isa) {
  const char* env = std::getenv("GDN_CORE_TEST_ISAS");
  if (env == nullptr) return true;
  const std::string list = std::string(",") + env + ",";
  return list.find("," + isa + ",") != std::string::npos;
}

// Every Parallel range runs with denormals flushed (gdn/flush_denormals.h), serial or on
// threads that inherited a caller's IEEE setting, and the caller gets its own setting back.
using FpControl = FlushDenormals::Word;
#if defined(__x86_64__)
constexpr FpControl kFpStatusBits = 0x3f;  // MXCSR's sticky exception flags: not the setting
#else
constexpr FpControl kFpStatusBits = 0;
#endif
FpControl fp_control() { return FlushDenormals::control() & ~kFpStatusBits; }

float denormal_product() {  // 2^-70 * 2^-70 = 2^-140: a denormal, 0 when flushed
  volatile float a = 0x1p-70f, b = 0x1p-70f;
  return a * b;
}

void test_flush_denormals() {
#if defined(__x86_64__) || defined(__aarch64__)
  const FpControl saved = fp_control();
  for (const bool caller_flushes : {false, true}) {
    FlushDenormals::set_control(caller_flushes ? saved | FlushDenormals::kBits : saved & ~FlushDenormals::kBits);
    const FpControl before = fp_control();
    for (const int threads : {1, 3}) {
      ThreadedParallel tp{threads};
      std::mutex mu;
      int ranges = 0, flushed = 0;
      tp.par()(12, 2, [&](int64_t, int64_t) {
        const bool ok = FlushDenormals::active() && denormal_product() == 0.f;
        std::lock_guard<std::mutex> lock(mu);
        ++ranges;
        flushed += ok;
      });
      const std::string tag = std::string("flush denormals, caller ") + (caller_flushes ? "flushing" : "IEEE") +
                              ", " + std::to_string(threads) + " thread(s)";
      check_true(tag + ": every range flushed", ranges > 0 && flushed == ranges,
                 std::to_string(flushed) + " of " + std::to_string(ranges));
      check_true(tag + ": the caller's setting back", fp_control() == before &&
                 (denormal_product() == 0.f) == caller_flushes);
    }
  }
  FlushDenormals::set_control(saved);
#else
  check_true("flush denormals: no control on this target", !FlushDenormals::active());
#endif
}

// WorkBlocks (the parallel-for's range sharing): a worker alone runs its block in order, then
// the others' from their backs; workers on threads claim every range exactly once.
void test_work_blocks() {
  {
    WorkBlocks blocks(10, 3);  // blocks [0, 3), [3, 6), [6, 10)
    std::vector<int64_t> order;
    const int64_t ran = blocks.drain(1, [&](int64_t r) { order.push_back(r); });
    const std::vector<int64_t> want = {3, 4, 5, 9, 8, 7, 6, 2, 1, 0};
    check_true("work blocks: a lone worker's order", ran == 10 && order == want);
    check_true("work blocks: nothing left after", blocks.drain(0, [](int64_t) {}) == 0);
  }
  std::mt19937 rng(5);
  std::atomic<int64_t> bad{0};
  for (int trial = 0; trial < 300; ++trial) {
    const int64_t R = 1 + int64_t(rng() % 64), W = 1 + int64_t(rng() % 5);
    WorkBlocks blocks(R, W);
    std::vector<std::atomic<int>> hits(static_cast<size_t>(R));
    std::atomic<int64_t> total{0};
    std::vector<std::thread> pool;
    for (int64_t w = 0; w < W; ++w)
      pool.emplace_back([&, w] {
        total += blocks.drain(w, [&](int64_t r) {
          if (r < 0 || r >= R) return void(++bad);
          hits[size_t(r)]++;
        });
      });
    for (auto& t : pool) t.join();
    for (auto& h : hits) bad += h.load() != 1;
    bad += total.load() != R;
  }
  check_true("work blocks: 300 random cuts, each range once", bad == 0, std::to_string(bad.load()) + " bad");
}

// The recurrent kernel's prefetch targets (kernels/rec_prefetch.h) as recurrent_impl walks one
// item's column blocks (narrow, 32 columns; a decode row's pass prefetches row pairs k, k + 1 of
// its target, 32 elements each, in full blocks only). Head-ahead: the shares of the next head lie
// in it, never overlap, and cover every row pair of its full blocks; a head no item fetched also
// prefetches each of its own later blocks; the block-by-block scheme: the next block, then the
// next head's first.
namespace rec_prefetch_test {
#include "kernels/rec_prefetch.h"
}

void test_rec_prefetch() {
  using rec_prefetch_test::rec_prefetch_targets;
  constexpr int64_t kBlock = 32;
  int64_t bad = 0, cases = 0;
  std::string first;
  auto fail = [&](const std::string& why) {
    if (bad++ == 0) first = why;
  };
  for (int64_t K : {1, 2, 7, 16, 128, 129, 256}) {
    for (int64_t V : {16, 32, 48, 64, 128, 160, 256}) {
      for (int mode = 0; mode < 4; ++mode) {
        const bool ahead = mode < 3, next_head = mode != 2, fetched = mode == 1;
        const int64_t KV = K * V, nfull = V / kBlock, pairs = K / 2;
        std::vector<int> next_hits(size_t(KV), 0), own_hits(size_t(KV), 0);
        std::string tag = "K=" + std::to_string(K) + " V=" + std::to_string(V) + " mode " + std::to_string(mode);
        int64_t old_pf_blocks = 0;
        for (int64_t col = 0, w = 0; col < V; col += w) {
          w = std::min(kBlock, V - col);
          const auto t = rec_prefetch_targets(ahead, K, V, kBlock, col, w, kBlock, V, next_head, fetched);
          ++cases;
          if (w < kBlock) {  // tail pieces prefetch nothing (rec_block); head-ahead gives them no share
            if (ahead && t.pf >= 0) fail(tag + ": a tail piece given a share");
            continue;
          }
          if (!ahead) {               // the block-by-block scheme
            const int64_t want = col + kBlock < V ? col + kBlock : (next_head ? KV : -1);
            if (t.pf != want || t.pf_ld != V || t.pf2 != -1) fail(tag + " block-by-block col " + std::to_string(col));
            old_pf_blocks += t.pf >= 0;
            continue;
          }
          if (next_head != (t.pf >= 0)) fail(tag + ": a share without a next head, or none with one");
          if (t.pf >= 0 && t.pf_ld != kBlock) fail(tag + ": share row stride " + std::to_string(t.pf_ld));
          const int64_t want2 = !fetched && col + kBlock < V ? col + kBlock : -1;
          if (t.pf2 != want2) fail(tag + ": own next block at " + std::to_string(t.pf2));
          for (int64_t k = 0; k < 2 * pairs; ++k) {
            for (int64_t c = 0; c < kBlock; ++c) {
              if (t.pf >= 0) {
                const int64_t e = t.pf + k * t.pf_ld + c;
                if (e < KV || e >= 2 * KV) fail(tag + ": share element " + std::to_string(e) + " outside the next head");
                else next_hits[size_t(e - KV)]++;
              }
              if (t.pf2 >= 0 && t.pf2 + k * V + c < KV) own_hits[size_t(t.pf2 + k * V + c)]++;
            }
          }
        }
        if (!ahead) {
          if (old_pf_blocks != (nfull > 1 ? nfull - 1 : 0) + (nfull > 0 && next_head ? 1 : 0))
            fail(tag + ": block-by-block targets");
          continue;
        }
        // The next head: element e is prefetched once iff it is in full block b's share
        // [b K 32, (b + 1) K 32) and in one of the share's row pairs.
        for (int64_t e = 0; e < KV; ++e) {
          const int64_t b = e / (K * kBlock), r = (e % (K * kBlock)) / kBlock;
          const int want = next_head && b < nfull && r < 2 * pairs ? 1 : 0;
          if (next_hits[size_t(e)] != want) {
            fail(tag + ": next head element " + std::to_string(e) + " prefetched " +
                 std::to_string(next_hits[size_t(e)]) + " times");
            break;
          }
        }
        // This head, when no item fetched it: every column after the first block, in the row pairs
        // (a tail target is prefetched as a full block, so its rows' pieces run on into the next
        // row: at least once, not exactly once); when an item fetched it, nothing.
        for (int64_t e = 0; e < KV; ++e) {
          const int64_t r = e / V, col = e % V;
          const bool want = !fetched && nfull > 0 && col >= kBlock && r < 2 * pairs;
          if (fetched ? own_hits[size_t(e)] != 0 : (want && own_hits[size_t(e)] == 0)) {
            fail(tag + ": own element " + std::to_string(e) + " prefetched " + std::to_string(own_hits[size_t(e)]) +
                 " times");
            break;
          }
        }
      }
    }
  }
  check_true("recurrent prefetch targets: " + std::to_string(cases) + " blocks, head-ahead shares tile the next head",
             bad == 0, bad == 0 ? "" : std::to_string(bad) + " wrong, first: " + first);
}

int main() {
  std::printf("CPU features: %s\n", cpu_features().c_str());
  {
    std::string names;
    for (const std::string& isa : available_isas()) names += (names.empty() ? "" : " ") + isa;
    std::printf("ISAs: %s; selected: %s\n", names.c_str(), selected_isa().c_str());
  }
  test_huge_page_hint();
  test_work_blocks();
  test_rec_prefetch();
  test_flush_denormals();
#if GDN_TEST_AMX
  {
    std::mt19937 rng(99);
    for (auto rnk : {std::array<int, 3>{16, 16, 16}, {5, 6, 10}, {16, 3, 16}, {1, 16, 1}, {9, 16, 7}, {12, 9, 3}})
      test_amx_model_dp(rnk[0], rnk[1], rnk[2], rng);
    test_amx_model_dp_edges();
    test_amx_model_load_store();
    test_amx_model_faults();
    test_split_gemm("amx gemm", am::gemm, rng);
    test_amx_linear_panels(rng);
    for (auto run : {std::array<int64_t, 2>{64, 2 * 4096}, {-1, int64_t(1) << 20}})
      test_linear_packed_parts(
          "amx linear panels parts (panel " + std::to_string(run[0]) + ")",
          [&](const LinearPackedArgs& a, const Parallel& par) { am::linear_packed_tiles(a, par, run[0], run[1]); },
          DType::bf16, DType::bf16, 150, 64, {100, 0, 33, 16, 7}, rng);
    test_amx_dispatch();
  }
#endif
#if GDN_TEST_ARM_BF16
  {
    const std::vector<std::string> isas = available_isas();
    if (std::find(isas.begin(), isas.end(), "neon_bf16") != isas.end()) {
      std::mt19937 rng(77);
      test_split_gemm("bfmmla gemm", neon_bf16_test::gemm, rng);
    } else {
      std::printf("bfmmla gemm: skipped (no BF16 on this CPU)\n");
    }
  }
#endif
  for (const std::string& isa : available_isas()) {
    if (!isa_selected_for_tests(isa)) {
      std::printf("%s kernels: not run (GDN_CORE_TEST_ISAS)\n", isa.c_str());
      continue;
    }
    std::string why;
    if (!select_isa(isa, &why)) {
      std::printf("cannot select %s: %s\n", isa.c_str(), why.c_str());
      ++g_fail;
      continue;
    }
    const KernelTable& kt = current_table();
    test_probes(isa, kt);
    test_bf16_rounding(isa, kt);
    test_silu_edges(kt);
    test_silu_bf16(kt);
    std::mt19937 rng(1234);
    for (DType act : {DType::f32, DType::bf16}) {
      test_gating(kt, act, 37, 24, rng);
      test_gating(kt, act, 37, 32, rng);
      test_gating(kt, act, 150, 48, rng);
      test_gated_rms_norm(kt, act, 150, 128, rng);
      test_gated_rms_norm(kt, act, 37, 40, rng);
      for (bool ds : {false, true})
        for (int W : {4, 3, 5})
          for (DType wdt : {DType::f32, DType::bf16})
            for (bool has_bias : {true, false}) test_conv(kt, act, ds, W, wdt, has_bias, rng);
      test_conv_update_threads(kt, act, rng);
      test_conv_stream(kt, act, rng);
      for (DType sdt : {DType::f32, DType::bf16}) test_recurrent_and_chunk(kt, act, sdt, rng);
      for (DType sdt : {DType::f32, DType::bf16}) test_recurrent_nonfinite(kt, act, sdt, rng);
      // The chunk at Qwen3-Next head dims (K = V = 128: GEMM depths of 128, 8 panels).
      GdnCase big;
      big.H = 1; big.HV = 2; big.K = 128; big.V = 128;
      test_recurrent_and_chunk(kt, act, DType::f32, rng, big, false);
      // V = 160: one 128-column block and one 32-column block on AVX-512 (recurrent.h, "wide"):
      // decode with either state, spec verify with an f32 one (streamed and plain stores).
      GdnCase wide_v;
      wide_v.H = 1; wide_v.HV = 2; wide_v.V = 160;
      for (DType sdt : {DType::f32, DType::bf16}) test_recurrent_and_chunk(kt, act, sdt, rng, wide_v, true);
      // The serving step's fused prefill: every width path (W = 5: the generic one), both
      // layouts, a v range of more than 256 channels (HV 8 on one key head: two conv pieces),
      // real threads with single-head items.
      GdnCase wide;
      wide.H = 1; wide.HV = 8;
      ThreadedParallel tp{4};
      for (DType sdt : {DType::f32, DType::bf16})
        test_conv_chunk(kt, act, sdt, 4, false, true, GdnCase{}, Parallel{}, "serial", rng);
      for (int W : {2, 5}) test_conv_chunk(kt, act, DType::f32, W, W == 2, W != 5, GdnCase{}, Parallel{}, "serial", rng);
      test_conv_chunk(kt, act, DType::f32, 3, false, true, wide, Parallel{}, "serial", rng);
      test_conv_chunk(kt, act, DType::f32, 4, true, true, GdnCase{}, tp.par(), "4 threads", rng);
    }
    // Odd sizes (in not a multiple of the vector width, T and out not multiples of the tile),
    // then several t and o blocks (the threaded split).
    for (DType xdt : {DType::f32, DType::bf16})
      for (DType wdt : {DType::f32, DType::bf16})
        for (DType ydt : {DType::f32, DType::bf16}) {
          for (auto s : {std::array<int64_t, 3>{1, 1, 1}, {1, 17, 9}, {3, 15, 5}, {5, 33, 13}, {2, 100, 31}})
            test_linear(kt, xdt, wdt, ydt, s[0], s[1], s[2], rng);
          test_linear(kt, xdt, wdt, ydt, 67, 257, 600, rng);
        }
    // Packed w: odd `in` (the zero-padded last pair), out past the last full block, 1 .. 3
    // blocks per tile, row tiles and the rows left, several row blocks (threaded split); for the
    // AMX units also 16-row tiles in pairs and alone, in a multiple of 32, below 32 and odd, and
    // short tiles (5 rows or more, kAmxMinRows): alone (T < 16), after a 16-row tile in one item
    // (21, 87) and in the last row block after full ones (70); fewer rows left take the vector
    // step (20, 67, 130); x past 2 MiB is packed in tile order (520 x 2048: one panel, one group;
    // test_amx_linear_panels has the rest).
    for (DType xdt : {DType::f32, DType::bf16})
      for (DType ydt : {DType::f32, DType::bf16})
        for (auto s : {std::array<int64_t, 3>{1, 1, 1}, {1, 17, 9}, {3, 15, 5}, {5, 33, 13}, {2, 100, 31}, {8, 64, 50},
                       {12, 2, 48}, {9, 64, 64}, {67, 257, 600}, {130, 40, 70}, {48, 96, 48}, {16, 31, 16},
                       {80, 64, 33}, {20, 64, 40}, {21, 64, 40}, {87, 33, 40}, {70, 40, 70}, {15, 2048, 32},
                       {520, 2048, 40}})
          test_linear_packed(kt, xdt, ydt, s[0], s[1], s[2], rng);
    // Parts: decode-sized T (the vector step; on AMX short tiles and the 16-row ones), row
    // blocks, and x past 2 MiB (AMX: packed once for all parts); out 0 and single blocks.
    const auto table_run = [&](const LinearPackedArgs& a, const Parallel& par) { kt.linear_packed(a, par); };
    for (DType xdt : {DType::f32, DType::bf16})
      for (auto T : {int64_t(1), int64_t(8), int64_t(21), int64_t(130)})
        test_linear_packed_parts(std::string("linear packed parts ") + kt.isa, table_run, xdt, DType::bf16, T, 33,
                                 {40, 0, 16, 1, 70}, rng);
    test_linear_packed_parts(std::string("linear packed parts ") + kt.isa, table_run, DType::bf16, DType::f32, 520,
                             2048, {40, 33, 0, 64}, rng);
  }
  std::printf("%d passed, %d failed\n", g_pass, g_fail);
  return g_fail ? 1 : 0;
}
