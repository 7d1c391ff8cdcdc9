// gdn_jax_gating: (a, b [T, HV], A_log, dt_bias [HV] f32 or bf16) -> (g, beta [T, HV] f32).
// Leading dims of a/b are flattened, so vmap "expand_dims" works (A_log, dt_bias unbatched).
#include "handlers/common.h"

namespace gdn {

static ffi::Error GatingImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                             ffi::AnyBuffer A_log, ffi::AnyBuffer dt_bias,
                             ffi::ResultBuffer<ffi::F32> g, ffi::ResultBuffer<ffi::F32> beta) {
  GatingArgs p;
  if (!to_dtype(a.element_type(), &p.act) || b.element_type() != a.element_type())
    return bad("fused_gdn_gating", "a and b must both be float32 or bfloat16");
  const auto d = a.dimensions();
  if (d.size() < 1) return bad("fused_gdn_gating", "a must have rank >= 1");
  p.HV = d.back();
  p.T = p.HV ? int64_t(a.element_count()) / p.HV : 0;
  if (b.element_count() != a.element_count() || A_log.element_count() != size_t(p.HV) ||
      dt_bias.element_count() != size_t(p.HV))
    return bad("fused_gdn_gating", "shape mismatch: a " + dims_str(d) + ", b " + dims_str(b.dimensions()) +
                                       " (A_log and dt_bias [HV] must not be batched)");
  p.a = a.untyped_data();
  p.b = b.untyped_data();
  std::vector<float> A_log_tmp, dt_bias_tmp;
  p.A_log = head_params_f32(A_log, A_log_tmp);
  p.dt_bias = head_params_f32(dt_bias, dt_bias_tmp);
  if (!p.A_log || !p.dt_bias) return bad("fused_gdn_gating", "A_log and dt_bias must be float32 or bfloat16");
  p.g = g->typed_data();
  p.beta = beta->typed_data();
  const Parallel par = make_parallel(&pool);
  current_table().gating(p, par);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnGating, GatingImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // a
                                  .Arg<ffi::AnyBuffer>()          // b
                                  .Arg<ffi::AnyBuffer>()          // A_log [HV], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()          // dt_bias [HV], f32 or bf16
                                  .Ret<ffi::Buffer<ffi::F32>>()   // g
                                  .Ret<ffi::Buffer<ffi::F32>>()); // beta

}  // namespace gdn
