// gdn_jax_linear: (x [T, in], w [out, in]) -> y [T, out], each f32 or bf16 on its own; the
// layer's projections (w in Hugging Face's [out, in] layout). f32 accumulation, y rounded once.
// gdn_jax_linear_packed: the same with w packed once at load time (gdn_jax.ops.
// pack_linear_weight): [ceil(out / 16), ceil(in / 2), 16, 2] bf16.
#include "handlers/common.h"

namespace gdn {

// The three dtypes into p (f32 or bf16 each; a packed w bf16 only), or an error naming the op.
static ffi::Error linear_dtypes(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer>& y, bool packed,
                                LinearArgs& p) {
  const char* op = packed ? "linear_packed" : "linear";
  if (!to_dtype(x.element_type(), &p.x_dtype)) return bad(op, "x must be float32 or bfloat16");
  if (!to_dtype(w.element_type(), &p.w_dtype) || (packed && p.w_dtype != DType::bf16))
    return bad(op, packed ? "the packed w must be bfloat16" : "w must be float32 or bfloat16");
  if (!to_dtype(y->element_type(), &p.y_dtype)) return bad(op, "the result must be float32 or bfloat16");
  return ffi::Error::Success();
}

// Sizes and buffers into p, then `kernel` on XLA's pool.
static ffi::Error run_linear(void (*kernel)(const LinearArgs&, const Parallel&), LinearArgs p, ffi::ThreadPool& pool,
                             ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer>& y, int64_t T,
                             int64_t in, int64_t out) {
  p.T = T;
  p.in = in;
  p.out = out;
  p.x = x.untyped_data();
  p.w = w.untyped_data();
  p.y = y->untyped_data();
  const Parallel par = make_parallel(&pool);
  kernel(p, par);
  return ffi::Error::Success();
}

static ffi::Error LinearImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Result<ffi::AnyBuffer> y) {
  LinearArgs p;
  if (auto e = linear_dtypes(x, w, y, false, p); e.failure()) return e;
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2) return bad("linear", "x must be [T, in], got " + dims_str(xd));
  if (wd.size() != 2 || wd[1] != xd[1])
    return bad("linear", "w must be [out, in] with in = " + std::to_string(xd[1]) + " (x " + dims_str(xd) +
                             "), got " + dims_str(wd));
  if (yd.size() != 2 || yd[0] != xd[0] || yd[1] != wd[0])
    return bad("linear", "the result must be [T, out] = [" + std::to_string(xd[0]) + ", " + std::to_string(wd[0]) +
                             "], got " + dims_str(yd));
  return run_linear(current_table().linear, p, pool, x, w, y, xd[0], xd[1], wd[0]);
}

static ffi::Error LinearPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                   ffi::Result<ffi::AnyBuffer> y) {
  LinearArgs p;
  if (auto e = linear_dtypes(x, w, y, true, p); e.failure()) return e;
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2) return bad("linear_packed", "x must be [T, in], got " + dims_str(xd));
  if (yd.size() != 2 || yd[0] != xd[0]) return bad("linear_packed", "the result must be [T, out], got " + dims_str(yd));
  const int64_t in = xd[1], out = yd[1];
  if (wd.size() != 4 || wd[0] != (out + 15) / 16 || wd[1] != (in + 1) / 2 || wd[2] != 16 || wd[3] != 2)
    return bad("linear_packed", "the packed w must be [ceil(out / 16), ceil(in / 2), 16, 2] = [" +
                                    std::to_string((out + 15) / 16) + ", " + std::to_string((in + 1) / 2) +
                                    ", 16, 2] for in = " + std::to_string(in) + ", out = " + std::to_string(out) +
                                    ", got " + dims_str(wd));
  return run_linear(current_table().linear_packed, p, pool, x, w, y, xd[0], in, out);
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnLinear, LinearImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // x [T, in]
                                  .Arg<ffi::AnyBuffer>()    // w [out, in]
                                  .Ret<ffi::AnyBuffer>());  // y [T, out]

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnLinearPacked, LinearPackedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // x [T, in]
                                  .Arg<ffi::AnyBuffer>()    // w packed [ceil(out / 16), ceil(in / 2), 16, 2]
                                  .Ret<ffi::AnyBuffer>());  // y [T, out]

}  // namespace gdn
