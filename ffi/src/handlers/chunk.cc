// gdn_jax_chunk: chunked gated delta rule prefill over varlen sequences; the initial state
// is read from and the final state written to ssm_state[state_indices[s]] in place.
#include "handlers/common.h"

namespace gdn {

static ffi::Error ChunkImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                            ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta, ffi::AnyBuffer ssm_state,
                            ffi::Buffer<ffi::S32> qsl, ffi::Buffer<ffi::S32> state_indices,
                            ffi::Buffer<ffi::PRED> has_initial_state, ffi::Result<ffi::AnyBuffer> o,
                            ffi::Result<ffi::AnyBuffer> ssm_state_out, ffi::Result<ffi::Buffer<ffi::S32>> status,
                            float scale, float eps, int32_t l2norm) {
  const char* op = "chunk_gated_delta_rule";
  ChunkArgs p;
  if (auto e = qkv_state_shapes(op, q, k, v, ssm_state, p); e.failure()) return e;
  if (auto e = chunk_head_dims(op, p.K, p.V); e.failure()) return e;
  if (ssm_state_out->untyped_data() != ssm_state.untyped_data()) return bad(op, "ssm_state is not aliased to its result");
  if (g.element_count() != size_t(p.T * p.HV) || beta.element_count() != size_t(p.T * p.HV))
    return bad(op, "g and beta must be [T, HV] float32");
  p.S = int64_t(state_indices.element_count());
  if (qsl.element_count() != size_t(p.S + 1) || has_initial_state.element_count() != size_t(p.S))
    return bad(op, "query_start_loc must be [S + 1] and has_initial_state [S] for state_indices [S]");
  p.g = g.typed_data();
  p.beta = beta.typed_data();
  p.o = o->untyped_data();
  p.query_start_loc = qsl.typed_data();
  p.state_indices = state_indices.typed_data();
  p.has_initial_state = has_initial_state.typed_data();
  p.scale = scale;
  p.eps = eps;
  p.l2norm = l2norm != 0;
  p.chunk_size = forced_chunk_size();
  Status s = check_query_start_loc(p.query_start_loc, p.S, p.T);
  if (s.ok()) s = check_slots(p.state_indices, p.S, p.N);
  if (accept_batch(s, status, o)) current_table().chunk(p, make_parallel(&pool));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(GdnChunk, ChunkImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()           // q [T, H, K], or mixed qkv [T, D]
                                  .Arg<ffi::AnyBuffer>()           // k [T, H, K], or the same [T, D]
                                  .Arg<ffi::AnyBuffer>()           // v [T, HV, V], or the same [T, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // g [T, HV]
                                  .Arg<ffi::Buffer<ffi::F32>>()    // beta [T, HV]
                                  .Arg<ffi::AnyBuffer>()           // ssm_state [N, HV, K, V]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // query_start_loc [S+1]
                                  .Arg<ffi::Buffer<ffi::S32>>()    // state_indices [S]
                                  .Arg<ffi::Buffer<ffi::PRED>>()   // has_initial_state [S]
                                  .Ret<ffi::AnyBuffer>()           // o [T, HV, V]
                                  .Ret<ffi::AnyBuffer>()           // ssm_state (aliased)
                                  .Ret<ffi::Buffer<ffi::S32>>()    // status [4]
                                  .Attr<float>("scale")
                                  .Attr<float>("eps")
                                  .Attr<int32_t>("l2norm"));

}  // namespace gdn
