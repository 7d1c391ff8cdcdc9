// gdn_jax_recurrent: the token recurrence with fused gating for decode (index_cols = 1,
// num_accepted = 1, one token per row) and spec verify (index_cols = num_spec + 1).
// ssm_state is aliased to result 1; result 2 is the batch status.
#include "handlers/common.h"

namespace gdn {

static ffi::Error RecurrentImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::AnyBuffer A_log,
                                ffi::AnyBuffer dt_bias, ffi::AnyBuffer ssm_state,
                                ffi::Buffer<ffi::S32> qsl, ffi::Buffer<ffi::S32> state_indices,
                                ffi::Buffer<ffi::S32> num_accepted, ffi::Result<ffi::AnyBuffer> o,
                                ffi::Result<ffi::AnyBuffer> ssm_state_out,
                                ffi::Result<ffi::Buffer<ffi::S32>> status, float scale, float eps,
                                int32_t l2norm) {
  const char* op = "fused_sigmoid_gating_delta_rule_update";
  RecurrentArgs p;
  if (auto e = qkv_state_shapes(op, q, k, v, ssm_state, p); e.failure()) return e;
  if (ssm_state_out->untyped_data() != ssm_state.untyped_data()) return bad(op, "ssm_state is not aliased to its result");
  if (a.element_type() != q.element_type() || b.element_type() != q.element_type() ||
      a.element_count() != size_t(p.T * p.HV) || b.element_count() != size_t(p.T * p.HV))
    return bad(op, "a and b must be [T, HV] in the dtype of q");
  if (A_log.element_count() != size_t(p.HV) || dt_bias.element_count() != size_t(p.HV))
    return bad(op, "A_log and dt_bias must be [HV]");
  const auto id = state_indices.dimensions();
  if (id.size() != 2) return bad(op, "state_indices must be [S, cols], got " + dims_str(id));
  p.S = id[0];
  p.index_cols = id[1];
  if (p.index_cols < 1 || qsl.element_count() != size_t(p.S + 1) || num_accepted.element_count() != size_t(p.S))
    return bad(op, "query_start_loc must be [S + 1] and num_accepted_tokens [S] for state_indices [S, cols >= 1]");
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  std::vector<float> A_log_tmp, dt_bias_tmp;
  p.A_log = head_params_f32(A_log, A_log_tmp);
  p.dt_bias = head_params_f32(dt_bias, dt_bias_tmp);
  if (!p.A_log || !p.dt_bias) return bad(op, "A_log and dt_bias must be float32 or bfloat16");
  p.o = o->untyped_data();
  p.query_start_loc = qsl.typed_data();
  p.state_indices = state_indices.typed_data();
  p.num_accepted = num_accepted.typed_data();
  p.scale = scale;
  p.eps = eps;
  p.l2norm = l2norm != 0;
  Status s = check_query_start_loc(p.query_start_loc, p.S, p.T);
  if (s.ok())
    s = check_spec_rows(p.query_start_loc, p.state_indices, p.index_cols, p.num_accepted, p.S, p.N,
                        p.index_cols, p.index_cols);
  if (accept_batch(s, status, o)) current_table().recurrent(p, make_parallel(&pool));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnRecurrent, RecurrentImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // q [T, H, K], or mixed qkv [T, D]
                                  .Arg<ffi::AnyBuffer>()           // k [T, H, K], or the same [T, D]
                                  .Arg<ffi::AnyBuffer>()           // v [T, HV, V], or the same [T, D]
                                  .Arg<ffi::AnyBuffer>()           // a [T, HV]
                                  .Arg<ffi::AnyBuffer>()           // b [T, HV]
                                  .Arg<ffi::AnyBuffer>()           // A_log [HV], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()           // dt_bias [HV], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()           // ssm_state [N, HV, K, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // query_start_loc [S+1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // state_indices [S, cols]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_accepted_tokens [S]
                                  .Ret<ffi::AnyBuffer>()           // o [T, HV, V]
                                  .Ret<ffi::AnyBuffer>()           // ssm_state (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()    // status [4]
                                  .Attr<float>("scale")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("l2norm"));

}  // namespace gdn
