// Parallel-for on XLA's own intra-op pool (ffi::ThreadPool): never our own threads.
#pragma once
#include "gdn/types.h"
#include "xla/ffi/api/ffi.h"

namespace gdn {

// The returned Parallel refers to `pool`; use it only during the handler call.
Parallel make_parallel(xla::ffi::ThreadPool* pool);

}  // namespace gdn
