// gdn_jax_linear: (x [T, in], w [out, in]) -> y [T, out], each f32 or bf16 on its own; the
// layer's projections (w in Hugging Face's [out, in] layout). f32 accumulation, y rounded once.
// gdn_jax_linear_packed: (x, w_1 .. w_n) -> y_1 .. y_n, each w packed once at load time
// (gdn_jax.ops.pack_linear_weight): [ceil(out_i / 16), ceil(in / 2), 16, 2] bf16; n <=
// kMaxLinearParts, one kernel call for all (gdn_jax.ops.merged_linear).
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
  current_table().linear(p, make_parallel(&pool));
  return ffi::Error::Success();
}

static ffi::Error LinearPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::RemainingArgs ws,
                                   ffi::RemainingRets ys) {
  constexpr const char* op = "linear_packed";
  LinearPackedArgs p{};
  if (!to_dtype(x.element_type(), &p.x_dtype)) return bad(op, "x must be float32 or bfloat16");
  const auto xd = x.dimensions();
  if (xd.size() != 2) return bad(op, "x must be [T, in], got " + dims_str(xd));
  const int64_t T = xd[0], in = xd[1];
  const size_t n = ws.size();
  if (n == 0 || n != ys.size() || n > size_t(kMaxLinearParts))
    return bad(op, "needs 1 to " + std::to_string(kMaxLinearParts) + " packed w and as many results, got " +
                       std::to_string(n) + " w and " + std::to_string(ys.size()) + " results");
  for (size_t i = 0; i < n; ++i) {
    const std::string part = n > 1 ? " " + std::to_string(i) : "";
    auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (w.has_error() || y.has_error()) return bad(op, "w and result" + part + " must be buffers");
    DType wdt, ydt;
    if (!to_dtype(w->element_type(), &wdt) || wdt != DType::bf16)
      return bad(op, "the packed w" + part + " must be bfloat16");
    if (!to_dtype((*y)->element_type(), &ydt)) return bad(op, "the result" + part + " must be float32 or bfloat16");
    if (i == 0) p.y_dtype = ydt;
    else if (ydt != p.y_dtype) return bad(op, "every result must have the first one's dtype (result" + part + ")");
    const auto wd = w->dimensions(), yd = (*y)->dimensions();
    if (yd.size() != 2 || yd[0] != T)
      return bad(op, "the result" + part + " must be [T, out] with T = " + std::to_string(T) + ", got " + dims_str(yd));
    const int64_t out = yd[1];
    if (wd.size() != 4 || wd[0] != (out + 15) / 16 || wd[1] != (in + 1) / 2 || wd[2] != 16 || wd[3] != 2)
      return bad(op, "the packed w" + part + " must be [ceil(out / 16), ceil(in / 2), 16, 2] = [" +
                         std::to_string((out + 15) / 16) + ", " + std::to_string((in + 1) / 2) + ", 16, 2] for in = " +
                         std::to_string(in) + ", out = " + std::to_string(out) + ", got " + dims_str(wd));
    p.parts[i] = {w->untyped_data(), (*y)->untyped_data(), out};
  }
  p.x = x.untyped_data();
  p.T = T;
  p.in = in;
  p.n_parts = int(n);
  current_table().linear_packed(p, make_parallel(&pool));
  return ffi::Error::Success();
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
                                  .Arg<ffi::AnyBuffer>()  // x [T, in]
                                  .RemainingArgs()        // w_i packed [ceil(out_i / 16), ceil(in / 2), 16, 2]
                                  .RemainingRets());      // y_i [T, out_i]

}  // namespace gdn
