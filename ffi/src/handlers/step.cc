// gdn_jax_step: one serving step of a GDN layer (gdn_jax/paths.py) in one call. After the batch
// check: prefill rows get the gates and the varlen conv fused with the chunked rule (conv_chunk);
// decode and spec rows the conv update and the recurrence with fused gating. Each kernel owns
// its rows (RowFilter) and writes only their tokens of the one output, so no masked outputs are
// summed and no index array is masked in XLA. Design notes: ffi/README.md, "Serving steps: one
// call".
#include <vector>

#include "handlers/common.h"

namespace gdn {

static ffi::Error StepImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer a, ffi::AnyBuffer b,
                           ffi::AnyBuffer A_log, ffi::AnyBuffer dt_bias, ffi::AnyBuffer weight, ffi::AnyBuffer bias,
                           ffi::AnyBuffer conv_state, ffi::AnyBuffer ssm_state, ffi::Buffer<ffi::S32> qsl,
                           ffi::Buffer<ffi::S32> state_indices, ffi::Buffer<ffi::S32> row_kind,
                           ffi::Buffer<ffi::PRED> has_initial_state, ffi::Buffer<ffi::S32> num_accepted,
                           ffi::Buffer<ffi::S32> status_in, ffi::Result<ffi::AnyBuffer> o,
                           ffi::Result<ffi::AnyBuffer> conv_state_out, ffi::Result<ffi::AnyBuffer> ssm_state_out,
                           ffi::Result<ffi::Buffer<ffi::S32>> status, ffi::Result<ffi::AnyBuffer> y,
                           ffi::Result<ffi::Buffer<ffi::F32>> gates, int32_t silu, int32_t layout, float scale,
                           float eps, int32_t l2norm, int32_t allowed_kinds) {
  const StepTimer timer;  // benchmarks: the handler's own wall time (parallel.h)
  const char* op = "gdn_step";
  ConvArgs cv;
  if (auto e = conv_common(op, x, weight, bias, conv_state, layout, cv); e.failure()) return e;
  if (conv_state_out->untyped_data() != conv_state.untyped_data() ||
      ssm_state_out->untyped_data() != ssm_state.untyped_data())
    return bad(op, "conv_state and ssm_state must be aliased to their results");
  if (y->element_type() != x.element_type() || y->element_count() != x.element_count())
    return bad(op, "the conv output y must be [T, D] like x");
  // The recurrence reads q, k, v from the rows of y (the mixed form); the chunk's pointers into
  // y name the channels of q, k, v, which conv_chunk makes from x's rows without touching y.
  ffi::AnyBuffer& yb = *y;
  RecurrentArgs r;
  ChunkArgs c;
  if (auto e = qkv_state_shapes(op, yb, yb, yb, ssm_state, r); e.failure()) return e;
  if (auto e = qkv_state_shapes(op, yb, yb, yb, ssm_state, c); e.failure()) return e;
  if (auto e = chunk_head_dims(op, c.K, c.V); e.failure()) return e;
  if (r.N != cv.N) return bad(op, "conv_state and ssm_state must have the same number of slots");
  if (a.element_type() != x.element_type() || b.element_type() != x.element_type() ||
      a.element_count() != size_t(r.T * r.HV) || b.element_count() != size_t(r.T * r.HV))
    return bad(op, "a and b must be [T, HV] in the dtype of x");
  if (gates->element_count() != size_t(2 * r.T * r.HV)) return bad(op, "gates must be [2, T, HV] float32");
  std::vector<float> A_log_tmp, dt_bias_tmp;
  const float* A = head_params_f32(A_log, A_log_tmp);
  const float* dtb = head_params_f32(dt_bias, dt_bias_tmp);
  if (!A || !dtb || A_log.element_count() != size_t(r.HV) || dt_bias.element_count() != size_t(r.HV))
    return bad(op, "A_log and dt_bias must be [HV], float32 or bfloat16");
  const auto id = state_indices.dimensions();
  if (id.size() != 2 || id[1] < 1) return bad(op, "state_indices must be [S, C >= 1], got " + dims_str(id));
  const int64_t S = id[0], C = id[1];
  if (qsl.element_count() != size_t(S + 1) || row_kind.element_count() != size_t(S) ||
      has_initial_state.element_count() != size_t(S) || num_accepted.element_count() != size_t(S) ||
      status_in.element_count() < 4)
    return bad(op, "query_start_loc must be [S + 1], row_kind, has_initial_state and num_accepted_tokens [S], "
                   "status [4]; got S = " + std::to_string(S));
  const uint32_t kinds = uint32_t(allowed_kinds);
  const uint32_t pre_bits = 1u << kRowPrefill, rec_bits = (1u << kRowDecode) | (1u << kRowSpec);
  // A spec row's conv window rows [acc-1, acc-1+W-1) and written rows [0, W-2+q) must fit in L
  // for every q, acc <= C that the batch check lets through.
  if ((kinds & (1u << kRowSpec)) && cv.L - cv.W + 2 < C)
    return bad(op, "conv_state length L = " + std::to_string(cv.L) + " is too short for spec rows of " +
                       std::to_string(C) + " tokens (needs L >= W - 2 + C)");

  // The step's own check (the caller's, status_in, comes first): every index is valid before
  // any kernel runs, so a refused batch writes nothing but a zero output.
  const int32_t* si = status_in.typed_data();
  Status s{si[0], si[1], si[2], si[3]};
  const int32_t* kind = row_kind.typed_data();
  const int32_t* idx = state_indices.typed_data();
  const int32_t* acc = num_accepted.typed_data();
  if (s.ok()) s = check_step_batch(qsl.typed_data(), idx, C, kind, acc, S, r.T, r.N, allowed_kinds);
  if (!accept_batch(s, status, o)) return ffi::Error::Success();

  std::vector<int32_t> col0(static_cast<size_t>(S));
  for (int64_t i = 0; i < S; ++i) col0[size_t(i)] = idx[i * C];
  const KernelTable& kt = current_table();
  const Parallel par = make_parallel(&pool);
  const bool pre = kinds & pre_bits;
  const bool rec = (kinds & rec_bits) || !pre;  // the recurrence also zeroes padding rows when alone

  cv.S = S;
  cv.silu = silu != 0;
  cv.y = y->untyped_data();
  cv.query_start_loc = qsl.typed_data();
  cv.state_indices = col0.data();
  if (rec) {
    ConvArgs u = cv;
    u.has_initial_state = nullptr;
    u.num_accepted = acc;
    u.rows = RowFilter{kind, rec_bits};
    kt.conv_update(u, par);
  }
  if (pre) {
    GatingArgs g{r.act, a.untyped_data(), b.untyped_data(), A, dtb, gates->typed_data(),
                 gates->typed_data() + r.T * r.HV, r.T, r.HV};
    kt.gating(g, par);
    c.g = g.g;
    c.beta = g.beta;
    c.o = o->untyped_data();
    c.query_start_loc = qsl.typed_data();
    c.state_indices = col0.data();
    c.has_initial_state = has_initial_state.typed_data();
    c.S = S;
    c.scale = scale;
    c.eps = eps;
    c.l2norm = l2norm != 0;
    c.chunk_size = forced_chunk_size();
    c.rows = RowFilter{kind, pre_bits | (1u << kRowPad)};
    ConvArgs f = cv;
    f.has_initial_state = has_initial_state.typed_data();
    f.num_accepted = nullptr;
    f.rows = RowFilter{kind, pre_bits};
    kt.conv_chunk(f, c, par);  // the conv's outputs go straight into the chunk, not through y
  }
  if (rec) {
    r.a = a.untyped_data();
    r.b = b.untyped_data();
    r.A_log = A;
    r.dt_bias = dtb;
    r.o = o->untyped_data();
    r.query_start_loc = qsl.typed_data();
    r.state_indices = idx;  // decode rows read column 0 only (1 token, num_accepted 1)
    r.index_cols = C;
    r.num_accepted = acc;
    r.S = S;
    r.scale = scale;
    r.eps = eps;
    r.l2norm = l2norm != 0;
    r.rows = RowFilter{kind, rec_bits | (pre ? 0u : 1u << kRowPad)};
    kt.recurrent(r, par);
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnStep, StepImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // mixed_qkv x [T, D]
                                  .Arg<ffi::AnyBuffer>()           // a [T, HV]
                                  .Arg<ffi::AnyBuffer>()           // b [T, HV]
                                  .Arg<ffi::AnyBuffer>()           // A_log [HV], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()           // dt_bias [HV], f32 or bf16
                                  .Arg<ffi::AnyBuffer>()           // conv weight [D, W]
                                  .Arg<ffi::AnyBuffer>()           // conv bias [D], or [0]: none
                                  .Arg<ffi::AnyBuffer>()           // conv_state pool
                                  .Arg<ffi::AnyBuffer>()           // ssm_state [N, HV, K, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // query_start_loc [S+1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // state_indices [S, C]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // row_kind [S]
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // has_initial_state [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // num_accepted_tokens [S]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // status of the caller's check [4]
                                  .Ret<ffi::AnyBuffer>()           // o [T, HV, V]
                                  .Ret<ffi::AnyBuffer>()           // conv_state (aliased)
                                  .Ret<ffi::AnyBuffer>()           // ssm_state (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()    // status [4]
                                  .Ret<ffi::AnyBuffer>()           // scratch: conv output y [T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>()    // scratch: g, beta [2, T, HV]
                                  .Attr<int32_t>("silu")
                                  .Attr<int32_t>("layout")
                                  .Attr<float>("scale")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("l2norm")
                                  .Attr<int32_t>("allowed_kinds"));

}  // namespace gdn
