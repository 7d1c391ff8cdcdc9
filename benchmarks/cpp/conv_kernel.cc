// The conv kernels alone (no XLA, jit or Python; one thread, or --threads N of the benchmark's own
// pool, bench_workers.h, whose helpers spin between calls unless --helpers sleep): the selected ISA's
// conv_fwd (one sequence of --tokens T from a slot) and conv_update (--batch B decode rows, one
// token each, slots 7 apart in a 64-slot pool), bf16 (or --act f32) activations and parameters,
// SiLU, W = 4, SD layout, D = --dim (8192, Qwen3-Next). The buffers are written once before
// timing, so no call faults in pages; after the first calls x, y and the touched slots sit in the
// caches (the update's slots: B x 48 KiB), so this is the kernel's compute cost per vector.
// --pool-mib M (M > 0): the update's pool holds M MiB of slots instead, and each call takes the
// next B slots (a cold pool, as in a serving loop, when M is well above the LLC).
// Prints the minimum and the median over --calls calls of each, and ns per 16-channel vector
// (per token for conv_fwd). For A/B work on the kernel: its minimum moves by ~1% between runs
// where the jitted op's median moves by 10-30% (ffi/README.md, "Causal conv1d", Update). Built
// with the core tests (build/dev/gdn_conv_kernel_bench); GDN_JAX_ISA picks the ISA.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_workers.h"
#include "gdn/dispatch.h"

namespace {

using gdn::ConvArgs;
using gdn::DType;
using gdn::Parallel;

struct Times {
  double min_us, median_us;
};

template <class F>
Times time_calls(F&& f, int calls) {
  std::vector<double> us;
  f();  // first touch of the slots and y
  for (int i = 0; i < calls; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(us.begin(), us.end());
  return {us.front(), us[us.size() / 2]};
}

int usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: gdn_conv_kernel_bench [--tokens T] [--batch B] [--dim D] [--act bf16|f32] "
               "[--calls N] [--pool-mib M] [--threads N (default 1)] [--helpers spin|sleep (default spin)]\n",
               why);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t T = 256, B = 8, D = 8192;
  int calls = 200, threads = 1;
  bool sleep_helpers = false;
  int64_t pool_mib = 0;
  DType act = DType::bf16;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage(("missing value for " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--tokens") T = std::atoll(v.c_str());
    else if (a == "--batch") B = std::atoll(v.c_str());
    else if (a == "--dim") D = std::atoll(v.c_str());
    else if (a == "--calls") calls = std::atoi(v.c_str());
    else if (a == "--pool-mib") pool_mib = std::atoll(v.c_str());
    else if (a == "--threads") threads = std::atoi(v.c_str());
    else if (a == "--helpers" && (v == "spin" || v == "sleep")) sleep_helpers = v == "sleep";
    else if (a == "--act" && (v == "bf16" || v == "f32")) act = v == "bf16" ? DType::bf16 : DType::f32;
    else return usage(("bad argument " + a + " " + v).c_str());
  }
  constexpr int64_t W = 4, L = W - 1;
  const size_t es = act == DType::bf16 ? 2 : 4;
  const int64_t N = pool_mib > 0 ? std::max<int64_t>(64, (pool_mib << 20) / (L * std::max<int64_t>(D, 1) * int64_t(es))) : 64;
  if (T < 1 || B < 1 || B > 64 || D < 1 || calls < 1 || pool_mib < 0 || threads < 1 || threads > 256)
    return usage("need T >= 1, 1 <= B <= 64, D >= 1, calls >= 1, M >= 0, 1 <= threads <= 256");

  // Values as bf16 bits (the f32 buffers hold the same values), N(0, 1) activations.
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  auto fill = [&](size_t n, float scale) {
    std::vector<uint8_t> buf(n * es);
    for (size_t i = 0; i < n; ++i) {
      const float f = nd(rng) * scale;
      uint32_t u;
      std::memcpy(&u, &f, 4);
      u &= 0xffff0000u;
      if (es == 2) {
        const uint16_t h = uint16_t(u >> 16);
        std::memcpy(buf.data() + i * 2, &h, 2);
      } else {
        std::memcpy(buf.data() + i * 4, &u, 4);
      }
    }
    return buf;
  };
  const int64_t rows = std::max(T, B);
  std::vector<uint8_t> x = fill(size_t(rows * D), 1.f), weight = fill(size_t(D * W), 0.3f),
                       bias = fill(size_t(D), 0.1f), pool = fill(size_t(N * L * D), 1.f);
  std::vector<uint8_t> y(size_t(rows * D) * es, 0);
  std::vector<int32_t> qsl_fwd = {0, int32_t(T)}, idx_fwd = {3};
  std::vector<int32_t> qsl_upd(static_cast<size_t>(B + 1)), idx_upd(static_cast<size_t>(B));
  std::vector<int32_t> acc(static_cast<size_t>(B), 1);
  for (int64_t i = 0; i <= B; ++i) qsl_upd[size_t(i)] = int32_t(i);
  for (int64_t i = 0; i < B; ++i) idx_upd[size_t(i)] = int32_t((i * 7) % N);
  const bool has_init = true;

  ConvArgs p{};
  p.act = act;
  p.x = x.data();
  p.y = y.data();
  p.weight = weight.data();
  p.bias = bias.data();
  p.weight_dtype = p.bias_dtype = act;
  p.T = T;
  p.D = D;
  p.W = W;
  p.silu = true;
  p.conv_state = pool.data();
  p.N = N;
  p.L = L;
  p.slot_stride = L * D;
  p.time_stride = D;
  p.chan_stride = 1;
  p.query_start_loc = qsl_fwd.data();
  p.state_indices = idx_fwd.data();
  p.has_initial_state = &has_init;
  p.S = 1;
  ConvArgs u = p;
  u.T = B;
  u.S = B;
  u.query_start_loc = qsl_upd.data();
  u.state_indices = idx_upd.data();
  u.has_initial_state = nullptr;
  u.num_accepted = acc.data();

  const gdn::KernelTable& kt = gdn::current_table();
  gdn_bench::Workers workers(threads, sleep_helpers);
  const Parallel par = threads > 1 ? workers.parallel() : Parallel{};
  const Times f = time_calls([&] { kt.conv_fwd(p, par); }, calls);
  int64_t next = 0;  // first slot of the next call's set (cold pool)
  const Times up = time_calls(
      [&] {
        if (pool_mib > 0) {
          if (next + B > N) next = 0;
          for (int64_t i = 0; i < B; ++i) idx_upd[size_t(i)] = int32_t(next + i);
          next += B;
        }
        kt.conv_update(u, par);
      },
      calls * 10);
  const double vec = double((D + 15) / 16);
  std::printf("isa %s, %s, D = %lld, %d thread(s)%s, update pool %lld slots (%s)\n", gdn::selected_isa().c_str(),
              act == DType::bf16 ? "bf16" : "f32", static_cast<long long>(D), threads,
              threads > 1 ? (sleep_helpers ? ", helpers sleep" : ", helpers spin") : "", static_cast<long long>(N),
              pool_mib > 0 ? "a fresh slot set per call" : "the same slots every call");
  std::printf("conv_fwd    T = %-5lld min %9.1f us  median %9.1f us  %6.2f ns per vector and token\n",
              static_cast<long long>(T), f.min_us, f.median_us, f.min_us * 1e3 / (vec * double(T)));
  std::printf("conv_update B = %-5lld min %9.2f us  median %9.2f us  %6.2f ns per vector\n",
              static_cast<long long>(B), up.min_us, up.median_us, up.min_us * 1e3 / (vec * double(B)));
  return 0;
}
