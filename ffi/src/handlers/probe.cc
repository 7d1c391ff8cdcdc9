// gdn_jax_bandwidth_probe (benchmarks only): the memory roofline measured the way the decode
// kernel moves its state, on the same threads, i.e. inside an XLA custom call on XLA's
// intra-op pool through make_parallel, in 64 KiB pieces (one f32 state head, the decode
// kernel's work item), `threads x 4` caller-helps ranges. mode 0 (rmw): dst = dst * a + b
// in place (the decode's read-modify-write of a slot); 1 (read): sum of dst; 2 (copy):
// dst = src; 3 (spec): groups of 4 pieces, the first read and written in place as in mode 0
// and its result written to the other three with the selected ISA's non-temporal stores (the
// spec verify's traffic: a row of 4 tokens reads its start slot and writes 4 states, one of
// them back into that slot; kernels/probe.h). dst is aliased to result 0; result 1 is a sum
// (mode 3: of each group's first value), so no pass can be optimised out.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gdn/dispatch.h"
#include "handlers/common.h"

namespace gdn {
namespace {

constexpr int64_t kPiece = 16384;  // floats: 64 KiB, one K = V = 128 f32 head
typedef float V4 __attribute__((vector_size(16)));  // SSE2 / NEON width: every x86-64 and arm64 has it

// One piece of n floats (a multiple of 32), eight vectors (two 64-byte lines) per iteration.
// The mode is a template parameter and the loops unrolled, so the eight vectors stay in
// registers: with the mode tested inside the loop GCC kept them in a stack array, and the
// probe's rmw became bound by its own store-forwarding round trips (88 GB/s on a Zen 5 whose
// memory took 118 from a register loop: ffi/README.md, Limits).
template <int kMode>
float piece(const float* src, float* dst, int64_t n) {
  const V4 a = {0.5f, 0.5f, 0.5f, 0.5f}, b = a;
  const float* in = kMode == 2 ? src : dst;
  V4 s[8] = {};
  for (int64_t i = 0; i < n; i += 32) {
    V4 x[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) std::memcpy(&x[j], in + i + 4 * j, sizeof(V4));
    if constexpr (kMode == 1) {
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) s[j] += x[j];
    } else {
      if constexpr (kMode == 0) {
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) x[j] = x[j] * a + b;
      }
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) std::memcpy(dst + i + 4 * j, &x[j], sizeof(V4));
    }
  }
  float t = 0.f;
  for (int j = 0; j < 8; ++j) t += s[j][0] + s[j][1] + s[j][2] + s[j][3];
  return t;
}

float piece(int mode, const float* src, float* dst, int64_t n) {
  if (mode == 0) return piece<0>(src, dst, n);
  if (mode == 1) return piece<1>(src, dst, n);
  return piece<2>(src, dst, n);
}

ffi::Error BandwidthProbeImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> src, ffi::Buffer<ffi::F32> dst,
                              ffi::Result<ffi::Buffer<ffi::F32>> dst_out, ffi::Result<ffi::Buffer<ffi::F32>> sum,
                              int32_t mode) {
  const char* op = "bandwidth_probe";
  if (mode < 0 || mode > 3) return bad(op, "mode must be 0 (rmw), 1 (read), 2 (copy) or 3 (spec)");
  if (dst_out->untyped_data() != dst.untyped_data()) return bad(op, "dst is not aliased to its result");
  const int64_t n = int64_t(dst.element_count());
  if (n % kPiece != 0) return bad(op, "dst must hold a multiple of 16384 floats");
  if (mode == 2 && int64_t(src.element_count()) != n) return bad(op, "src must be as large as dst for a copy");
  float* d = dst.typed_data();
  if (mode == 3) {
    if (n % (kSpecProbeGroup * kPiece) != 0)
      return bad(op, "dst must hold a multiple of " + std::to_string(kSpecProbeGroup) + " x 16384 floats for mode 3");
    if (reinterpret_cast<uintptr_t>(d) % 64 != 0) return bad(op, "dst must be 64-byte aligned for mode 3");
  }
  const int64_t pieces = n / kPiece, items = mode == 3 ? pieces / kSpecProbeGroup : pieces;
  std::vector<float> part(size_t(items), 0.f);
  const float* s = src.typed_data();
  const KernelTable& kt = current_table();
  make_parallel(&pool)(items, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      part[size_t(p)] = mode == 3 ? kt.spec_probe_piece(d + p * kSpecProbeGroup * kPiece, kPiece)
                                  : piece(mode, s + (mode == 2 ? p * kPiece : 0), d + p * kPiece, kPiece);
  });
  float t = 0.f;
  for (float x : part) t += x;
  sum->typed_data()[0] = t;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnBandwidthProbe, BandwidthProbeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // src [n] (copy), else any
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dst [n], n a multiple of 16384
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dst (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sum [1]
                                  .Attr<int32_t>("mode"));

}  // namespace gdn
