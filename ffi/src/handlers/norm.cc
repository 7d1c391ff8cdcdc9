// gdn_jax_gated_rms_norm: (o, z [..., V], weight [V]; attribute eps) -> y [..., V], all f32 or
// all bf16: the layer's gated RMSNorm per value head (kernels/norm.h). Leading dims flattened.
#include <algorithm>

#include "handlers/common.h"

namespace gdn {

static ffi::Error GatedRmsNormImpl(ffi::ThreadPool pool, ffi::AnyBuffer o, ffi::AnyBuffer z, ffi::AnyBuffer weight,
                                   float eps, ffi::Result<ffi::AnyBuffer> y) {
  constexpr const char* op = "gated_rms_norm";
  GatedNormArgs p{};
  if (!to_dtype(o.element_type(), &p.dtype)) return bad(op, "o must be float32 or bfloat16");
  if (z.element_type() != o.element_type() || weight.element_type() != o.element_type() ||
      y->element_type() != o.element_type())
    return bad(op, "o, z, weight and the result must have one dtype");
  const auto od = o.dimensions();
  if (od.size() < 1) return bad(op, "o must have rank >= 1");
  p.V = od.back();
  const auto same = [&](ffi::AnyBuffer::Dimensions d) { return std::equal(d.begin(), d.end(), od.begin(), od.end()); };
  if (!same(z.dimensions()) || !same(y->dimensions()))
    return bad(op, "z and the result must be o's shape " + dims_str(od) + ", got z " + dims_str(z.dimensions()) +
                       " and " + dims_str(y->dimensions()));
  if (weight.dimensions().size() != 1 || weight.dimensions()[0] != p.V)
    return bad(op, "weight must be [V] = [" + std::to_string(p.V) + "], got " + dims_str(weight.dimensions()));
  if (!(eps > 0.f)) return bad(op, "eps must be > 0");
  p.rows = p.V ? int64_t(o.element_count()) / p.V : 0;
  p.o = o.untyped_data();
  p.z = z.untyped_data();
  p.weight = weight.untyped_data();
  p.y = y->untyped_data();
  p.eps = eps;
  current_table().gated_rms_norm(p, make_parallel(&pool));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnGatedRmsNorm, GatedRmsNormImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()  // o [..., V]
                                  .Arg<ffi::AnyBuffer>()  // z [..., V]
                                  .Arg<ffi::AnyBuffer>()  // weight [V]
                                  .Attr<float>("eps")
                                  .Ret<ffi::AnyBuffer>());  // y [..., V]

}  // namespace gdn
