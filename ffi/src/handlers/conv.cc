// gdn_jax_conv_fwd (varlen prefill) and gdn_jax_conv_update (decode / spec rolling buffer).
// conv_state is aliased to result 1 and updated in place; result 2 is the batch status.
#include "handlers/common.h"

namespace gdn {

static ffi::Error ConvFwdImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                              ffi::AnyBuffer bias, ffi::AnyBuffer conv_state,
                              ffi::Buffer<ffi::S32> qsl, ffi::Buffer<ffi::S32> state_indices,
                              ffi::Buffer<ffi::PRED> has_initial_state, ffi::Result<ffi::AnyBuffer> y,
                              ffi::Result<ffi::AnyBuffer> conv_state_out,
                              ffi::Result<ffi::Buffer<ffi::S32>> status, int32_t silu, int32_t layout) {
  ConvArgs p;
  if (auto e = conv_common("causal_conv1d_fwd", x, weight, bias, conv_state, layout, p); e.failure()) return e;
  if (conv_state_out->untyped_data() != conv_state.untyped_data())
    return bad("causal_conv1d_fwd", "conv_state is not aliased to its result");
  p.S = int64_t(state_indices.element_count());
  if (qsl.element_count() != size_t(p.S + 1) || has_initial_state.element_count() != size_t(p.S))
    return bad("causal_conv1d_fwd", "query_start_loc must be [S + 1] and has_initial_state [S] for state_indices [S]");
  p.silu = silu != 0;
  p.y = y->untyped_data();
  p.query_start_loc = qsl.typed_data();
  p.state_indices = state_indices.typed_data();
  p.has_initial_state = has_initial_state.typed_data();
  p.num_accepted = nullptr;
  // Larger than half the LLC, y would not stay cached for its reader beside x: streamed, it
  // saves the write-allocate reads of its lines (ffi/README.md, "Causal conv1d").
  p.stream_y = uint64_t(y->size_bytes()) > last_level_cache_bytes() / 2;
  Status s = check_query_start_loc(p.query_start_loc, p.S, p.T);
  if (s.ok()) s = check_slots(p.state_indices, p.S, p.N);
  if (accept_batch(s, status, y)) current_table().conv_fwd(p, make_parallel(&pool));
  return ffi::Error::Success();
}

static ffi::Error ConvUpdateImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer weight,
                                 ffi::AnyBuffer bias, ffi::AnyBuffer conv_state,
                                 ffi::Buffer<ffi::S32> qsl, ffi::Buffer<ffi::S32> state_indices,
                                 ffi::Buffer<ffi::S32> num_accepted, ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::AnyBuffer> conv_state_out,
                                 ffi::Result<ffi::Buffer<ffi::S32>> status, int32_t silu, int32_t layout) {
  ConvArgs p;
  if (auto e = conv_common("causal_conv1d_update", x, weight, bias, conv_state, layout, p); e.failure()) return e;
  if (conv_state_out->untyped_data() != conv_state.untyped_data())
    return bad("causal_conv1d_update", "conv_state is not aliased to its result");
  p.S = int64_t(state_indices.element_count());
  if (qsl.element_count() != size_t(p.S + 1) || num_accepted.element_count() != size_t(p.S))
    return bad("causal_conv1d_update", "query_start_loc must be [S + 1] and num_accepted_tokens [S] for state_indices [S]");
  p.silu = silu != 0;
  p.y = y->untyped_data();
  p.query_start_loc = qsl.typed_data();
  p.state_indices = state_indices.typed_data();
  p.has_initial_state = nullptr;
  p.num_accepted = num_accepted.typed_data();
  // Window rows [acc-1, acc-1+W-1) and written rows [0, W-2+q) must fit in L.
  const int64_t max_rows = p.L - p.W + 2;
  Status s = check_query_start_loc(p.query_start_loc, p.S, p.T);
  if (s.ok()) s = check_spec_rows(p.query_start_loc, p.state_indices, 1, p.num_accepted, p.S, p.N, max_rows, max_rows);
  if (accept_batch(s, status, y)) current_table().conv_update(p, make_parallel(&pool));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnConvFwd, ConvFwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // x [T, D]
                                  .Arg<ffi::AnyBuffer>()           // weight [D, W], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()           // bias [D], or [0]: none
                                  .Arg<ffi::AnyBuffer>()           // conv_state pool
                                  .Arg<ffi::Buffer<ffi::S32>>()    // query_start_loc [S+1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // state_indices [S]
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // has_initial_state [S]
                                  .Ret<ffi::AnyBuffer>()           // y [T, D]
                                  .Ret<ffi::AnyBuffer>()           // conv_state (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()    // status [4]
                                  .Attr<int32_t>("silu")
                                  .Attr<int32_t>("layout"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnConvUpdate, ConvUpdateImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // x [T, D]
                                  .Arg<ffi::AnyBuffer>()           // weight [D, W], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()           // bias [D], or [0]: none
                                  .Arg<ffi::AnyBuffer>()           // conv_state pool
                                  .Arg<ffi::Buffer<ffi::S32>>()    // query_start_loc [S+1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // state_indices [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_accepted_tokens [S]
                                  .Ret<ffi::AnyBuffer>()           // y [T, D]
                                  .Ret<ffi::AnyBuffer>()           // conv_state (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()    // status [4]
                                  .Attr<int32_t>("silu")
                                  .Attr<int32_t>("layout"));

}  // namespace gdn
