// gdn_jax_copy_slots: pool[dst[i]] = pool[src[i]] for every row with dst[i] != -1, in place
// (the pool is aliased to result 0). Any dtype of a byte or more, any rank: a slot is one index
// of the leading dim. Used by commit_accepted (index-scatter rollback into column 0): a jnp
// scatter into a bf16 pool makes XLA:CPU convert the whole pool.
#include <algorithm>
#include <utility>
#include <vector>

#include "handlers/common.h"

namespace gdn {

static Status check_copy_slots(const int32_t* src, const int32_t* dst, int64_t S, int64_t N) {
  Status s;
  std::vector<std::pair<int32_t, int32_t>> written, read;
  for (int64_t i = 0; i < S; ++i) {
    if (dst[i] == -1) continue;
    if (dst[i] < 0 || dst[i] >= N) return Status{kCopyDstRange, int32_t(i), dst[i], int32_t(N)};
    if (src[i] < 0 || src[i] >= N) return Status{kCopySrcRange, int32_t(i), src[i], int32_t(N)};
    written.emplace_back(dst[i], int32_t(i));
    if (src[i] != dst[i]) read.emplace_back(src[i], int32_t(i));
  }
  std::sort(written.begin(), written.end());
  for (size_t i = 1; i < written.size(); ++i)
    if (written[i].first == written[i - 1].first)
      return Status{kSlotTwice, written[i].second, written[i].first, written[i - 1].second};
  // A slot one row reads and another writes would make the result depend on the order.
  for (const auto& r : read) {
    auto it = std::lower_bound(written.begin(), written.end(), std::make_pair(r.first, INT32_MIN));
    if (it != written.end() && it->first == r.first && it->second != r.second)
      return Status{kSlotTwice, std::max(r.second, it->second), r.first, std::min(r.second, it->second)};
  }
  return s;
}

static ffi::Error CopySlotsImpl(ffi::ThreadPool pool, ffi::AnyBuffer state, ffi::Buffer<ffi::S32> src,
                                ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> state_out,
                                ffi::Result<ffi::Buffer<ffi::S32>> status) {
  const auto d = state.dimensions();
  if (d.size() < 1) return bad("copy_slots", "pool must have a leading slot dimension");
  if (sub_byte(state.element_type())) return bad("copy_slots", "a pool dtype narrower than a byte is not supported");
  if (state_out->untyped_data() != state.untyped_data()) return bad("copy_slots", "pool is not aliased to its result");
  const int64_t N = d[0], S = int64_t(src.element_count());
  if (dst.element_count() != size_t(S)) return bad("copy_slots", "src and dst must both be [S]");
  const Status s = check_copy_slots(src.typed_data(), dst.typed_data(), S, N);
  write_status(status, s);
  if (!s.ok() || N == 0) return ffi::Error::Success();
  const size_t slot_bytes = state.size_bytes() / size_t(N);
  char* base = static_cast<char*>(state.untyped_data());
  const int32_t* sp = src.typed_data();
  const int32_t* dp = dst.typed_data();
  make_parallel(&pool)(S, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      if (dp[i] != -1 && sp[i] != dp[i]) std::memcpy(base + dp[i] * slot_bytes, base + sp[i] * slot_bytes, slot_bytes);
  });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnCopySlots, CopySlotsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // pool [N, ...]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // src [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // dst [S] (-1: skip)
                                  .Ret<ffi::AnyBuffer>()           // pool (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>());  // status [4]

}  // namespace gdn
