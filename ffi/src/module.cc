// The nanobind module: the table of FFI targets (registered from Python at import under
// "gdn_jax_<name>") and the ISA controls.
#include <atomic>
#include <chrono>
#include <optional>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "gdn/dispatch.h"
#include "parallel.h"
#include "round_trip.h"
#include "xla/ffi/api/c_api.h"

namespace nb = nanobind;

namespace gdn {
extern "C" {
XLA_FFI_Error* GdnGating(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnConvFwd(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnConvUpdate(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnRecurrent(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnChunk(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnCopySlots(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnReport(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnBatchStatus(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnStep(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnBandwidthProbe(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnLinear(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnLinearPacked(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnGatedRmsNorm(XLA_FFI_CallFrame*);
XLA_FFI_Error* GdnZeroPool(XLA_FFI_CallFrame*);
}
}  // namespace gdn

namespace {
// GFLOP/s of `probe` (flops_per_iter per iteration) on `threads` threads at once, doubling
// the iteration count until one run lasts `seconds`.
double peak_gflops(float (*probe)(int64_t), int64_t flops_per_iter, int threads, double seconds) {
  int64_t iters = 1 << 10;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    std::atomic<float> sink{0.f};
    for (int i = 0; i < threads; ++i) pool.emplace_back([&] { sink = sink + probe(iters); });
    for (auto& th : pool) th.join();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt >= seconds || iters > (int64_t(1) << 40))
      return double(flops_per_iter) * double(iters) * threads / dt / 1e9;
    iters *= 2;
  }
}

template <class Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_gdn_ffi, m) {
  m.def("registrations", [] {
    nb::dict d;
    d["gating"] = capsule(gdn::GdnGating);
    d["conv_fwd"] = capsule(gdn::GdnConvFwd);
    d["conv_update"] = capsule(gdn::GdnConvUpdate);
    d["recurrent"] = capsule(gdn::GdnRecurrent);
    d["chunk"] = capsule(gdn::GdnChunk);
    d["copy_slots"] = capsule(gdn::GdnCopySlots);
    d["report"] = capsule(gdn::GdnReport);
    d["batch_status"] = capsule(gdn::GdnBatchStatus);
    d["step"] = capsule(gdn::GdnStep);
    d["bandwidth_probe"] = capsule(gdn::GdnBandwidthProbe);  // benchmarks only
    d["gated_rms_norm"] = capsule(gdn::GdnGatedRmsNorm);
    d["linear"] = capsule(gdn::GdnLinear);
    d["linear_packed"] = capsule(gdn::GdnLinearPacked);
    d["zero_pool"] = capsule(gdn::GdnZeroPool);
    return d;
  });
  // The XLA FFI API version of the headers this module was compiled with: a jaxlib whose own
  // version is older cannot register the handlers (gdn_jax/_ffi.py checks before registering).
  m.def("ffi_api_version", [] { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); });
  m.def("available_isas", &gdn::available_isas, "ISAs compiled in and supported by this CPU, best first.");
  m.def("selected_isa", &gdn::selected_isa, "The ISA whose kernels the FFI targets run now.");
  m.def("cpu_features", &gdn::cpu_features);
  m.def(
      "fma_peak_gflops",
      [](int threads, double seconds) {
        // Benchmark-only: f32 FMA peak of the selected ISA on `threads` threads.
        const auto& t = gdn::current_table();
        nb::gil_scoped_release release;
        return peak_gflops(t.fma_probe, t.fma_probe_flops, threads, seconds);
      },
      nb::arg("threads") = 1, nb::arg("seconds") = 0.2);
  m.def(
      "bf16_dot_peak_gflops",
      [](int threads, double seconds) -> std::optional<double> {
        // Benchmark-only: bf16 dot-product peak of the selected ISA (vdpbf16ps, AMX tiles,
        // BFMMLA); None where the ISA has no bf16 dot instruction.
        const auto& t = gdn::current_table();
        if (!t.bf16_dot_probe) return std::nullopt;
        nb::gil_scoped_release release;
        return peak_gflops(t.bf16_dot_probe, t.bf16_dot_probe_flops, threads, seconds);
      },
      nb::arg("threads") = 1, nb::arg("seconds") = 0.2);
  m.def(
      "core_round_trip_ns",
      [](int a, int b, int trips) -> std::optional<double> {
        if (a < 0 || b < 0 || a == b || trips < 1) throw nb::value_error("two distinct CPUs >= 0 and trips >= 1");
        nb::gil_scoped_release release;
        return gdn::core_round_trip_ns(a, b, trips);
      },
      nb::arg("cpu_a"), nb::arg("cpu_b"), nb::arg("trips") = 20000,
      "Benchmark-only: median ns of a cache line's round trip between threads pinned to two CPUs "
      "(None where they cannot be pinned).");
  m.def(
      "parallel_counters",
      [](bool reset) {
        // Benchmark-only: the fork/join counters of make_parallel and the serving steps'
        // handler times (parallel.h), summed since the last reset.
        static const char* names[gdn::kNumParallelCounters] = {
            "jobs", "helpers", "helper_start_ns", "helper_start_max_ns", "late_helpers",
            "helper_ranges", "ranges", "join_wait_ns", "join_sleeps", "job_ns", "steps", "step_ns",
            "step_entry_ns", "step_exit_ns"};
        int64_t v[gdn::kNumParallelCounters];
        gdn::parallel_counters(v, reset);
        nb::dict d;
        for (int i = 0; i < gdn::kNumParallelCounters; ++i) d[names[i]] = v[i];
        return d;
      },
      nb::arg("reset") = false);
  m.def(
      "force_chunk_size",
      [](int size) {
        if (!gdn::force_chunk_size(size))
          throw nb::value_error(("chunk size must be 32, 64 or 0 (each ISA's choice), got " + std::to_string(size)).c_str());
      },
      nb::arg("size"), "Benchmarks and tests: the chunked prefill's chunk size for every sequence (0: the ISA's choice).");
  m.def("forced_chunk_size", &gdn::forced_chunk_size);
  m.def(
      "chunk_size_for",
      [](int64_t length) { return gdn::current_table().chunk_size_for(gdn::forced_chunk_size(), length); },
      nb::arg("length"), "The chunk size the selected ISA's chunked prefill uses for a sequence of `length` tokens.");
  m.def(
      "chunk_bf16_pairs_for",
      [](int64_t length) {
        const int64_t min_tokens = gdn::current_table().chunk_pairs_min_tokens;
        return min_tokens > 0 && length >= min_tokens;
      },
      nb::arg("length"),
      "Whether the selected ISA's chunked prefill takes Q S0 and K S0 on bf16 pairs for a sequence of `length` "
      "tokens with bf16 activations (benchmarks: the flop mix).");
  m.def(
      "select_isa",
      [](const std::string& name) {
        std::string why;
        if (!gdn::select_isa(name, &why)) throw nb::value_error(why.c_str());
      },
      "Force the kernels of one available ISA (raises ValueError otherwise).");
}
