// gdn_jax_batch_status: a serving step's metadata checked in one call (validate.h,
// check_step_batch), the native form of gdn_jax.batch.batch_status. In jnp that check is a
// dozen small XLA fusions and a sort, ~0.1 ms of a decode step's fixed cost on the CPU.
#include "handlers/common.h"

namespace gdn {

static ffi::Error BatchStatusImpl(ffi::Buffer<ffi::S32> qsl, ffi::Buffer<ffi::S32> state_indices,
                                  ffi::Buffer<ffi::S32> row_kind, ffi::Buffer<ffi::S32> num_accepted,
                                  ffi::Result<ffi::Buffer<ffi::S32>> status, int64_t num_tokens, int64_t num_slots,
                                  int32_t allowed_kinds) {
  const auto d = state_indices.dimensions();
  if (d.size() != 2) return bad("batch_status", "state_indices must be [S, C], got " + dims_str(d));
  const int64_t S = d[0], C = d[1];
  if (qsl.element_count() != size_t(S + 1) || row_kind.element_count() != size_t(S) ||
      num_accepted.element_count() != size_t(S) || C < 1)
    return bad("batch_status", "query_start_loc must be [S + 1], row_kind and num_accepted_tokens [S], "
                               "state_indices [S, C >= 1]; got S = " + std::to_string(S));
  write_status(status, check_step_batch(qsl.typed_data(), state_indices.typed_data(), C, row_kind.typed_data(),
                                        num_accepted.typed_data(), S, num_tokens, num_slots, allowed_kinds));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnBatchStatus, BatchStatusImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()    // query_start_loc [S + 1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // state_indices [S, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // row_kind [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_accepted_tokens [S]
                                  .Ret<ffi::Buffer<ffi::S32>>()    // status [4]
                                  .Attr<int64_t>("num_tokens")
                                  .Attr<int64_t>("num_slots")
                                  .Attr<int32_t>("allowed_kinds"));

}  // namespace gdn
