// The recurrent kernel alone (decode / spec verify), without XLA, jit or Python in the way:
// the selected ISA's table entry on a cold slot pool (4x a 32 MiB LLC; on transparent huge pages
// unless --huge-pages 0, like gdn_jax.zeros_pool), threads of its own that spin between calls
// (no wake-up cost; --helpers sleep: they wait on a condition variable instead, as XLA's pool
// threads do once idle, and --gap-us sleeps between calls), a fresh slot set per call. Prints
// the median. --pool-mib M sizes the pool (at least one slot set): one set that stays in the LLC
// tells the kernel's own speed from the memory's. --tag-seconds S: groups of calls for S seconds,
// each tagged by the CPUs' round trip (round_trip.h), medians per placement of a VM's vCPUs.
// For A/B work on the kernel, where a jitted op's time moves more with the host than with the
// change (ffi/README.md, "Recurrent decode / spec", Prefetch). Built with the core tests
// (`make test-core`: build/dev/gdn_recurrent_kernel_bench), or alone:
//   cmake -S . -B build/core -G Ninja -DGDN_BUILD_PYTHON=OFF -DGDN_BUILD_CORE_TESTS=ON
//   cmake --build build/core && build/core/gdn_recurrent_kernel_bench --batch 8 --state f32
// GDN_JAX_ISA picks the ISA as for the extension.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench_workers.h"
#include "gdn/dispatch.h"
#include "memory_hints.h"
#include "round_trip.h"

namespace {

using gdn::Parallel;
using gdn_bench::Workers;

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--batch B] [--tokens T (per row; > 1: spec verify)] [--state f32|bf16] "
               "[--threads N] [--calls C] [--huge-pages 1|0 (default 1: the pool advised as THP, like gdn_jax.zeros_pool)] "
               "[--helpers spin|sleep (default spin)] [--gap-us G (sleep between calls, default 0)] "
               "[--pool-mib M (default 128: 4x a 32 MiB LLC)] [--tag-seconds S (instead of --calls: groups of 20 calls "
               "for S seconds, each tagged by the CPUs' round trip before and after, medians per placement)]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int B = 8, nq = 1, threads = 2, calls = 400;
  bool bf16_state = false, huge_pages = true;  // like the pools GDNCache.create makes
  bool sleep_helpers = false;
  int gap_us = 0;
  int64_t pool_mib = 128;
  double tag_seconds = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    const char* v = argv[++i];
    if (a == "--batch") B = std::atoi(v);
    else if (a == "--tokens") nq = std::atoi(v);
    else if (a == "--threads") threads = std::atoi(v);
    else if (a == "--calls") calls = std::atoi(v);
    else if (a == "--huge-pages") huge_pages = std::atoi(v) != 0;
    else if (a == "--helpers" && (std::string(v) == "spin" || std::string(v) == "sleep")) sleep_helpers = std::string(v) == "sleep";
    else if (a == "--gap-us") gap_us = std::atoi(v);
    else if (a == "--pool-mib") pool_mib = std::atoll(v);
    else if (a == "--tag-seconds") tag_seconds = std::atof(v);
    else if (a == "--state" && (std::string(v) == "f32" || std::string(v) == "bf16")) bf16_state = std::string(v) == "bf16";
    else return usage(argv[0]);
  }
  if (B < 1 || nq < 1 || threads < 1 || calls < 1 || gap_us < 0 || pool_mib < 1 || !(tag_seconds >= 0)) return usage(argv[0]);
  // Qwen3-Next-80B per-layer shapes, bf16 activations.
  const int64_t H = 16, HV = 32, K = 128, V = 128, T = int64_t(B) * nq;
  const size_t slot_bytes = size_t(HV * K * V) * (bf16_state ? 2 : 4);
  const int64_t per_call = int64_t(B) * nq;
  int64_t N = std::max<int64_t>(per_call, int64_t((uint64_t(pool_mib) << 20) / slot_bytes));
  N = N / per_call * per_call;
  // Page-aligned like XLA's buffers (the kernel streams only to 64-byte aligned slots), zeroed:
  // every page faulted in before the timing.
  const size_t pool_bytes = static_cast<size_t>(N) * slot_bytes;
  std::unique_ptr<char, decltype(&std::free)> pool(static_cast<char*>(std::aligned_alloc(size_t(2) << 20, (pool_bytes + (size_t(2) << 20) - 1) & ~((size_t(2) << 20) - 1))), &std::free);
  if (!pool) {
    std::fprintf(stderr, "cannot allocate the %zu-byte slot pool\n", pool_bytes);
    return 1;
  }
  if (huge_pages && !gdn::advise_huge_pages(pool.get(), pool_bytes)) std::fprintf(stderr, "huge-page hint refused\n");
  std::memset(pool.get(), 0, pool_bytes);
  std::mt19937 rng(1);
  std::uniform_int_distribution<int> byte(0, 255);
  // bf16 activations: a small random mantissa around 0.5 (sign and exponent fixed), so the
  // state stays bounded over the calls.
  auto act = [&](int64_t n) {
    std::vector<uint16_t> x(static_cast<size_t>(n));
    for (auto& e : x) e = uint16_t(0x3f00 | byte(rng) >> 1);
    return x;
  };
  const std::vector<uint16_t> q = act(T * H * K), k = act(T * H * K), v = act(T * HV * V), a = act(T * HV),
                              b = act(T * HV);
  std::vector<uint16_t> o(static_cast<size_t>(T * HV * V));
  std::vector<float> A_log(static_cast<size_t>(HV), 0.f), dt_bias(static_cast<size_t>(HV), 0.f);
  std::vector<int32_t> qsl(static_cast<size_t>(B + 1)), idx(static_cast<size_t>(N)),
      accepted(static_cast<size_t>(B), 1);
  for (int i = 0; i <= B; ++i) qsl[size_t(i)] = i * nq;
  for (int64_t i = 0; i < N; ++i) idx[size_t(i)] = int32_t(i);
  std::shuffle(idx.begin(), idx.end(), rng);

  gdn::RecurrentArgs r{};
  r.act = gdn::DType::bf16;
  r.state = bf16_state ? gdn::DType::bf16 : gdn::DType::f32;
  r.q = q.data();
  r.k = k.data();
  r.v = v.data();
  r.qk_ld = H * K;
  r.v_ld = HV * V;
  r.a = a.data();
  r.b = b.data();
  r.A_log = A_log.data();
  r.dt_bias = dt_bias.data();
  r.ssm_state = pool.get();
  r.o = o.data();
  r.query_start_loc = qsl.data();
  r.num_accepted = accepted.data();
  r.index_cols = nq;
  r.T = T;
  r.S = B;
  r.N = N;
  r.H = H;
  r.HV = HV;
  r.K = K;
  r.V = V;
  r.scale = 1.f / std::sqrt(float(K));
  r.eps = 1e-6f;
  r.l2norm = true;

  Workers workers(threads, sleep_helpers);
  const Parallel par = workers.parallel();
  const gdn::KernelTable& table = gdn::current_table();
  int64_t c = 0;
  auto call = [&] {
    r.state_indices = idx.data() + (c++ % (N / per_call)) * per_call;
    const auto t0 = std::chrono::steady_clock::now();
    table.recurrent(r, par);
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (gap_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
    return dt;
  };
  // Bytes of state: every row reads its start slot and writes one slot per token.
  const double bytes = double(B) * double(1 + nq) * double(slot_bytes);
  const std::string what = gdn::selected_isa() + " recurrent B=" + std::to_string(B) + " tokens=" + std::to_string(nq) +
                           " state=" + (bf16_state ? "bf16" : "f32") + " threads=" + std::to_string(threads) +
                           " helpers=" + (sleep_helpers ? "sleep" : "spin") + " gap=" + std::to_string(gap_us) +
                           "us pool=" + std::to_string(pool_bytes >> 20) + "MiB";
  for (int w = 0; w < 5; ++w) call();
  if (tag_seconds > 0) {
    // A VM's vCPUs move between placements (ffi/README.md, Limits): groups of calls tagged by the
    // round trip between the first two CPUs just before and after, with the helpers held meanwhile;
    // grouped as report.py groups the probes' readings (within 2x of the shortest, and longer).
    struct Group { double rt0, rt1, med; };
    std::vector<Group> groups;
    int cpu[2] = {0, 1};  // the first two CPUs this process may run on
#if defined(__linux__)
    cpu_set_t allowed;
    if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0)
      for (int i = 0, n = 0; i < CPU_SETSIZE && n < 2; ++i)
        if (CPU_ISSET(i, &allowed)) cpu[n++] = i;
#endif
    auto rt = [&] {
      workers.hold(true);
      const std::optional<double> ns = gdn::core_round_trip_ns(cpu[0], cpu[1], 500);
      workers.hold(false);
      return ns;
    };
    const auto t_end = std::chrono::steady_clock::now() + std::chrono::duration<double>(tag_seconds);
    do {  // one group at least
      const std::optional<double> rt0 = rt();
      if (!rt0) {
        std::fprintf(stderr, "--tag-seconds: threads cannot be pinned to CPUs %d and %d\n", cpu[0], cpu[1]);
        return 1;
      }
      std::vector<double> g;
      for (int i = 0; i < 20; ++i) g.push_back(call());
      std::sort(g.begin(), g.end());
      groups.push_back({*rt0, rt().value_or(*rt0), g[g.size() / 2]});
    } while (std::chrono::steady_clock::now() < t_end);
    double lo = groups.front().rt0;
    for (const Group& g : groups) lo = std::min({lo, g.rt0, g.rt1});
    std::printf("%s, %zu groups of 20 calls:\n", what.c_str(), groups.size());
    for (int apart = 0; apart < 2; ++apart) {
      std::vector<double> med, trip;
      for (const Group& g : groups) {
        const bool a0 = g.rt0 > 2 * lo, a1 = g.rt1 > 2 * lo;
        if (a0 == bool(apart) && a1 == bool(apart)) med.push_back(g.med), trip.push_back(g.rt0);
      }
      if (med.empty()) continue;
      std::sort(med.begin(), med.end());
      std::sort(trip.begin(), trip.end());
      const double m = med[med.size() / 2];
      std::printf("  round trip %s (%.0f-%.0f ns), %zu groups: median %.3f ms (groups' p10 %.3f, p90 %.3f), %.1f GB/s\n",
                  apart ? "longer than 2x the shortest" : "within 2x of the shortest", trip.front(), trip.back(),
                  med.size(), m, med[med.size() / 10], med[med.size() * 9 / 10], bytes / m / 1e6);
    }
    return 0;
  }
  std::vector<double> ms;
  for (int i = 0; i < calls; ++i) ms.push_back(call());
  std::sort(ms.begin(), ms.end());
  const double med = ms[ms.size() / 2];
  std::printf("%s: median %.3f ms (p10 %.3f, p90 %.3f), %.1f GB/s\n", what.c_str(), med, ms[ms.size() / 10],
              ms[ms.size() * 9 / 10], bytes / med / 1e6);
  return 0;
}
