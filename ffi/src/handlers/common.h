// Helpers shared by the XLA FFI handlers: dtype mapping, shape checks, status output.
// Handlers hold no math: they check, validate the batch, and call the dispatch table.
#pragma once
#include <cstring>
#include <string>
#include <vector>

#include "gdn/dispatch.h"
#include "gdn/types.h"
#include "memory_hints.h"
#include "parallel.h"
#include "validate.h"
#include "xla/ffi/api/ffi.h"

namespace gdn {
namespace ffi = xla::ffi;

// Element types narrower than a byte (S4, U4, S2, U2, S1, U1, F4E2M1FN: the C API's numbers,
// as older FFI headers lack some names). XLA:CPU may pack them, while AnyBuffer::size_bytes()
// counts a byte per element, so byte-wise handlers (pool zeroing, slot copies) refuse them.
// jaxlib 0.5.3 hands int4 / uint4 buffers over as INVALID (0, size_bytes() 0; packed two to a
// byte there): refused as well, since their size is unknown to the handler.
inline bool sub_byte(ffi::DataType t) {
  switch (static_cast<int>(t)) {
    case 0: case 21: case 22: case 26: case 27: case 30: case 31: case 32: return true;
    default: return false;
  }
}

inline bool to_dtype(ffi::DataType t, DType* out) {
  if (t == ffi::DataType::F32) { *out = DType::f32; return true; }
  if (t == ffi::DataType::BF16) { *out = DType::bf16; return true; }
  return false;
}

// A per-head parameter vector (A_log, dt_bias: f32 or bf16, as the model stores it) as f32:
// the buffer itself when f32, else converted into `tmp` (HV values, nothing per token), so
// the jitted step needs no convert op for a bf16 model. Null for another dtype.
inline const float* head_params_f32(ffi::AnyBuffer& a, std::vector<float>& tmp) {
  if (a.element_type() == ffi::DataType::F32) return static_cast<const float*>(a.untyped_data());
  if (a.element_type() != ffi::DataType::BF16) return nullptr;
  const uint16_t* src = static_cast<const uint16_t*>(a.untyped_data());
  tmp.resize(a.element_count());
  for (size_t i = 0; i < tmp.size(); ++i) {
    const uint32_t u = uint32_t(src[i]) << 16;
    std::memcpy(&tmp[i], &u, sizeof u);
  }
  return tmp.data();
}

inline ffi::Error bad(const std::string& op, const std::string& what) {
  return ffi::Error::InvalidArgument("gdn_jax." + op + ": " + what);
}

inline std::string dims_str(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// status: int32[4] = (code, row, value, aux); see validate.h.
inline void write_status(ffi::Result<ffi::Buffer<ffi::S32>>& out, const Status& s) {
  int32_t* p = out->typed_data();
  p[0] = s.code;
  p[1] = s.row;
  p[2] = s.value;
  p[3] = s.aux;
}

inline void zero_fill(ffi::Result<ffi::AnyBuffer>& out) {
  std::memset(out->untyped_data(), 0, out->size_bytes());
}

// Reports the batch status; a refused batch gets a zero output and no kernel call (nothing
// written, so the aliased caches come back unchanged). Returns whether to run the kernel.
inline bool accept_batch(const Status& s, ffi::Result<ffi::Buffer<ffi::S32>>& status, ffi::Result<ffi::AnyBuffer>& out) {
  write_status(status, s);
  if (!s.ok()) zero_fill(out);
  else advise_huge_pages(out->untyped_data(), out->size_bytes());
  return s.ok();
}

}  // namespace gdn

namespace gdn {

// q, k [T, H, K], v [T, HV, V], ssm_state [N, HV, K, V]; fills the shape fields of either
// RecurrentArgs or ChunkArgs. Or the mixed form: q, k, v all the one [T, D] buffer whose rows
// are q ++ k ++ v (the conv output, passed without split copies); HV, K, V then come from
// ssm_state and H from D = 2 H K + HV V.
template <class Args>
ffi::Error qkv_state_shapes(const char* op, ffi::AnyBuffer& q, ffi::AnyBuffer& k, ffi::AnyBuffer& v,
                            ffi::AnyBuffer& ssm_state, Args& p) {
  if (!to_dtype(q.element_type(), &p.act) || k.element_type() != q.element_type() ||
      v.element_type() != q.element_type())
    return bad(op, "q, k, v must share one dtype, float32 or bfloat16");
  if (!to_dtype(ssm_state.element_type(), &p.state)) return bad(op, "ssm_state must be float32 or bfloat16");
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), sd = ssm_state.dimensions();
  if (sd.size() != 4) return bad(op, "ssm_state must be [N, HV, K, V], got " + dims_str(sd));
  if (qd.size() == 2) {  // mixed [T, D]
    if (kd.size() != 2 || vd.size() != 2 || kd[0] != qd[0] || kd[1] != qd[1] || vd[0] != qd[0] || vd[1] != qd[1])
      return bad(op, "the mixed form passes one [T, D] qkv array as q, k and v");
    p.T = qd[0]; p.HV = sd[1]; p.K = sd[2]; p.V = sd[3];
    const int64_t D = qd[1], rest = D - p.HV * p.V;
    if (p.K <= 0 || rest <= 0 || rest % (2 * p.K) != 0)
      return bad(op, "mixed qkv rows of D = " + std::to_string(D) + " do not hold 2 H K + HV V for ssm_state " +
                         dims_str(sd));
    p.H = rest / (2 * p.K);
    const size_t es = p.act == DType::f32 ? 4 : 2;
    p.q = q.untyped_data();  // (the three operands are one array; each read from its own pointer)
    p.k = static_cast<const char*>(k.untyped_data()) + size_t(p.H * p.K) * es;
    p.v = static_cast<const char*>(v.untyped_data()) + size_t(2 * p.H * p.K) * es;
    p.qk_ld = p.v_ld = D;
  } else {
    if (qd.size() != 3 || kd.size() != 3 || vd.size() != 3 || qd[0] != kd[0] || qd[1] != kd[1] ||
        qd[2] != kd[2] || vd[0] != qd[0])
      return bad(op, "q, k must be [T, H, K] and v [T, HV, V]; got q " + dims_str(qd) + ", k " + dims_str(kd) +
                         ", v " + dims_str(vd));
    p.T = qd[0]; p.H = qd[1]; p.K = qd[2]; p.HV = vd[1]; p.V = vd[2];
    p.q = q.untyped_data(); p.k = k.untyped_data(); p.v = v.untyped_data();
  }
  if (p.H <= 0 || p.HV % p.H != 0) return bad(op, "HV must be a multiple of H");
  if (sd[1] != p.HV || sd[2] != p.K || sd[3] != p.V)
    return bad(op, "ssm_state must be [N, HV, K, V] = [N, " + std::to_string(p.HV) + ", " + std::to_string(p.K) +
                       ", " + std::to_string(p.V) + "], got " + dims_str(sd));
  if (p.K < 1 || p.K > 256 || p.V < 1 || p.V > 256)
    return bad(op, "head dims K and V must be in [1, 256], got K=" + std::to_string(p.K) + ", V=" + std::to_string(p.V));
  p.N = sd[0];
  p.ssm_state = ssm_state.untyped_data();
  return ffi::Error::Success();
}

// The chunked prefill steps through K and V 16 lanes at a time (panels, row vectors): any other
// head dim would read and write past its rows. (The recurrence takes any K, V <= 256.)
inline ffi::Error chunk_head_dims(const char* op, int64_t K, int64_t V) {
  if (K % 16 == 0 && V % 16 == 0) return ffi::Error::Success();
  return bad(op, "head dims K and V must be multiples of 16 in [16, 256] for the chunked prefill, got K=" +
                     std::to_string(K) + ", V=" + std::to_string(V));
}

// Fills the shape part of ConvArgs shared by both ops; layout 0 = SD [N, L, D], 1 = DS [N, D, L].
// weight and bias come in the model's dtype (f32 or bf16, each its own); a bias of 0
// elements means none.
inline ffi::Error conv_common(const char* op, ffi::AnyBuffer& x, ffi::AnyBuffer& weight, ffi::AnyBuffer& bias,
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

}  // namespace gdn
