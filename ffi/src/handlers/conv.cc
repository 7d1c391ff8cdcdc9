// gdn_jax_conv_fwd (varlen prefill) and gdn_jax_conv_update (decode / spec rolling buffer).
// conv_state is aliased to result 1 and updated in place; result 2 is the batch status.
#include "handlers/common.h"

namespace gdn {
namespace {

// Fills the shape part of ConvArgs shared by both ops; layout 0 = SD [N, L, D], 1 = DS [N, D, L].
// weight and bias come in the model's dtype (f32 or bf16, each its own); a bias of 0
// elements means none.
ffi::Error conv_common(const char* op, ffi::AnyBuffer& x, ffi::AnyBuffer& weight, ffi::AnyBuffer& bias,
                       ffi::AnyBuffer& conv_state, int32_t layout, ConvArgs& p) {
  if (!to_dtype(x.element_type(), &p.act) || conv_state.element_type() != x.element_type())
    return bad(op, "x and conv_state must share one dtype, float32 or bfloat16");
  const auto xd = x.dimensions(), wd = weight.dimensions(), sd = conv_state.dimensions();
  if (xd.size() != 2) return bad(op, "x must be [T, D], got " + dims_str(xd));
  p.T = xd[0];
  p.D = xd[1];
  if (wd.size() != 2 || wd[0] != p.D) return bad(op, "weight must be [D, W], got " + dims_str(wd));
  p.W = wd[1];
  if (!to_dtype(weight.element_type(), &p.weight_dtype)) return bad(op, "weight must be float32 or bfloat16");
  if (!to_dtype(bias.element_type(), &p.bias_dtype)) return bad(op, "bias must be float32 or bfloat16");
  if (bias.element_count() != size_t(p.D) && bias.element_count() != 0)
    return bad(op, "bias must be [D], or [0] for no bias, got " + dims_str(bias.dimensions()));
  if (sd.size() != 3) return bad(op, "conv_state must be rank 3, got " + dims_str(sd));
  p.N = sd[0];
  if (layout == 0) {
    p.L = sd[1];
    if (sd[2] != p.D) return bad(op, "conv_state (SD layout) must be [N, L, D], got " + dims_str(sd));
    p.slot_stride = p.L * p.D; p.time_stride = p.D; p.chan_stride = 1;
  } else {
    p.L = sd[2];
    if (sd[1] != p.D) return bad(op, "conv_state (DS layout) must be [N, D, L], got " + dims_str(sd));
    p.slot_stride = p.L * p.D; p.time_stride = 1; p.chan_stride = p.L;
  }
  if (p.W < 1 || p.L < p.W - 1) return bad(op, "conv_state length L must be >= W - 1");
  p.x = x.untyped_data();
  p.weight = weight.untyped_data();
  p.bias = bias.element_count() ? bias.untyped_data() : nullptr;
  p.conv_state = conv_state.untyped_data();
  return ffi::Error::Success();
}

}  // namespace

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
