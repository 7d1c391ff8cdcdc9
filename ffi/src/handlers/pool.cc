// gdn_jax_zero_pool: a new zero-filled cache pool (any shape; dtypes of a byte and more), its
// whole 2 MiB pages advised as transparent huge pages before anything writes them
// (memory_hints.h).
//
// Why: the decode kernel reads a 32-column block of a state head as K rows V elements apart
// (kernels/recurrent.h), so one block spans 16 4 KiB pages at K = V = 128 f32: every block
// pays TLB misses, and the hardware prefetchers stop at each 4 KiB boundary. A pool made by
// jnp.zeros gets 4 KiB pages where THP is in "madvise" mode (a common default); advising the
// pool after it is written would need a synchronous collapse that copies it (~0.5 GB/s
// measured), so the pool is created here instead: XLA allocates the result (large results
// come fresh from mmap), the hint comes first, then the zero fill faults huge pages in.
// Where THP is off or "always" the hint changes nothing; the result is zeros either way.
#include <algorithm>
#include <cstring>

#include "handlers/common.h"

namespace gdn {
namespace {

ffi::Error ZeroPoolImpl(ffi::ThreadPool pool, ffi::Result<ffi::AnyBuffer> out) {
  if (sub_byte(out->element_type())) return bad("zeros_pool", "a pool dtype narrower than a byte is not supported");
  char* p = static_cast<char*>(out->untyped_data());
  const size_t bytes = out->size_bytes();
  advise_huge_pages(p, bytes);
  // In 2 MiB pieces on the intra-op pool: a pool of many GiB is zeroed (and faulted in) by
  // every thread at once.
  const int64_t pieces = int64_t((bytes + kHugePage - 1) / kHugePage);
  make_parallel(&pool)(pieces, 1, [&](int64_t i0, int64_t i1) {
    const size_t a = size_t(i0) * kHugePage, e = std::min(bytes, size_t(i1) * kHugePage);
    std::memset(p + a, 0, e - a);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnZeroPool, ZeroPoolImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Ret<ffi::AnyBuffer>());  // the pool, any dtype and shape

}  // namespace gdn
