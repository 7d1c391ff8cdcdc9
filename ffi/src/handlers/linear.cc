// gdn_jax_linear: (x [T, in], w [out, in]) -> y [T, out], each f32 or bf16 on its own; the
// layer's projections (w in Hugging Face's [out, in] layout). f32 accumulation, y rounded once.
#include "handlers/common.h"

namespace gdn {

static ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Result<ffi::AnyBuffer> y) {
  LinearArgs p;
  if (!to_dtype(x.element_type(), &p.x_dtype)) return bad("linear", "x must be float32 or bfloat16");
  if (!to_dtype(w.element_type(), &p.w_dtype)) return bad("linear", "w must be float32 or bfloat16");
  if (!to_dtype(y->element_type(), &p.y_dtype)) return bad("linear", "the result must be float32 or bfloat16");
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2) return bad("linear", "x must be [T, in], got " + dims_str(xd));
  if (wd.size() != 2 || wd[1] != xd[1])
    return bad("linear", "w must be [out, in] with in = " + std::to_string(xd[1]) + " (x " + dims_str(xd) +
                             "), got " + dims_str(wd));
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0])
    return bad("linear", "the result must be [T, out] = [" + std::to_string(xd[0]) + ", " + std::to_string(wd[0]) +
                             "], got " + dims_str(yd));
  p.T = xd[0];
  p.in = xd[1];
  p.out = wd[0];
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.y = y->untyped_data();
  const Parallel par = make_parallel(&pool);
  current_table().linear(p, par);
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnLinear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // x [T, in]
                                  .Arg<ffi::AnyBuffer>()    // w [out, in]
                                  .Ret<ffi::AnyBuffer>());  // y [T, out]

}  // namespace gdn
