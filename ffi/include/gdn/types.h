// Plain data shared by the handlers and every ISA back end: element types, the argument
// block of each kernel, the parallel-for the kernels run on, and the dispatch table.
// No XLA, nanobind or ISA headers here: this is what the cross-compiled core sees.
#pragma once
#include <cstdint>
#include <type_traits>

#include "gdn/flush_denormals.h"

namespace gdn {

// bf16 as stored (upper half of an IEEE f32). A distinct type so that overloads on
// `const bf16*` and `const float*` pick the right conversion.
struct bf16 {
  uint16_t bits;
};

enum class DType : int32_t { f32 = 0, bf16 = 1 };

// Parallel-for handed to every kernel. run(n, grain, body) calls body(ctx, begin, end) on
// disjoint ranges covering [0, n); ranges are at least `grain` long (except the last).
// Each work item must write disjoint memory and compute the same bits whichever thread
// runs it, so results never depend on the thread count. Every range runs with denormals
// flushed (gdn/flush_denormals.h), on the caller's thread too.
struct Parallel {
  using Body = void (*)(void* body_ctx, int64_t begin, int64_t end);
  void* ctx = nullptr;
  void (*run_fn)(void* ctx, int64_t n, int64_t grain, Body body, void* body_ctx) = nullptr;
  int num_threads = 1;

  template <class F>
  void operator()(int64_t n, int64_t grain, F&& f) const {
    using Fn = typename std::remove_reference<F>::type;
    Body body = [](void* c, int64_t b, int64_t e) {
      const FlushDenormals flush;
      (*static_cast<Fn*>(c))(b, e);
    };
    if (run_fn == nullptr || num_threads <= 1 || n <= grain) {
      if (n > 0) body(&f, 0, n);
      return;
    }
    run_fn(ctx, n, grain, body, &f);
  }
};

// Every pointer below is valid for the shape it names; index arrays have been validated
// (validate.h) before a kernel is called, so kernels trust them. A slot index of -1
// (PAD_SLOT_ID) marks a padding row: nothing read or written, output rows zero.

// The rows a conv, recurrent or chunk kernel owns. A serving step (handlers/step.cc) runs
// several kernels over one batch of mixed row kinds: each then owns the rows whose row_kind
// has its bit in `kinds` and neither reads nor writes the others, output included (their
// tokens belong to another kernel of the same call). Default: every row.
struct RowFilter {
  const int32_t* row_kind = nullptr;  // [S] (validate.h RowKind); null: every row
  uint32_t kinds = ~0u;               // bit k: rows of kind k
  bool owns(int64_t s) const { return row_kind == nullptr || ((kinds >> (uint32_t(row_kind[s]) & 31u)) & 1u) != 0; }
};

struct GatingArgs {
  DType act;               // dtype of a, b
  const void* a;           // [T, HV]
  const void* b;           // [T, HV]
  const float* A_log;      // [HV]
  const float* dt_bias;    // [HV]
  float* g;                // [T, HV]  g = -exp(A_log) * softplus(a + dt_bias)
  float* beta;             // [T, HV]  beta = sigmoid(b)
  int64_t T, HV;
};

// The layer's gated RMSNorm per row of V (a value head; transformers' Qwen3NextRMSNormGated):
// n = T(x rsqrt(mean(x^2) + eps)) with x = f32(o), m = T(T(weight) n), y = T(m silu(f32(z))),
// T() the rounding to the arrays' dtype, every product and sum in f32.
struct GatedNormArgs {
  DType dtype;         // of o, z, weight and y (all f32 or all bf16)
  const void* o;       // [rows, V]
  const void* z;       // [rows, V]
  const void* weight;  // [V]
  void* y;             // [rows, V]
  int64_t rows, V;
  float eps;
};

// Causal depthwise conv. The pool is addressed through strides (in elements) so that the
// SD [N, L, D] and DS [N, D, L] layouts share one code path.
struct ConvArgs {
  DType act;                       // dtype of x, y and conv_state
  const void* x;                   // [T, D] token-major
  void* y;                         // [T, D]
  const void* weight;              // [D, W] (tap W-1 multiplies the current token)
  const void* bias;                // [D] or nullptr (no bias)
  DType weight_dtype = DType::f32; // model parameters, each f32 or bf16 (read as f32)
  DType bias_dtype = DType::f32;
  int64_t T, D, W;
  bool silu;
  void* conv_state;                // pool, N slots of L time rows
  int64_t N, L;
  int64_t slot_stride, time_stride, chan_stride;
  const int32_t* query_start_loc;  // [S + 1]
  const int32_t* state_indices;    // [S]
  const bool* has_initial_state;   // [S]   (conv_fwd only)
  const int32_t* num_accepted;     // [S]   (conv_update only; window starts at row acc-1)
  int64_t S;
  RowFilter rows;                  // all rows unless a serving step says otherwise
  bool stream_y = false;           // conv_fwd: y with non-temporal stores (too large to stay cached for its reader)
};

// Token recurrence with fused gating: plain decode (one token per row, one index column,
// num_accepted = 1) and spec verify (row i reads slot idx[i, acc-1], writes the state after
// its token t to idx[i, t]).
struct RecurrentArgs {
  DType act;                       // dtype of q, k, v, a, b, o
  DType state;                     // dtype of ssm_state
  const void *q, *k;               // [T, H, K], token rows qk_ld elements apart
  const void* v;                   // [T, HV, V], token rows v_ld elements apart
  int64_t qk_ld = 0, v_ld = 0;     // H*K and HV*V when dense; D inside a mixed [T, D] qkv row
  const void *a, *b;               // [T, HV]
  const float *A_log, *dt_bias;    // [HV]
  void* ssm_state;                 // [N, HV, K, V], k-major per head
  void* o;                         // [T, HV, V]
  const int32_t* query_start_loc;  // [S + 1]
  const int32_t* state_indices;    // [S, index_cols]
  const int32_t* num_accepted;     // [S]
  int64_t index_cols;
  int64_t T, S, N, H, HV, K, V;
  float scale, eps;
  bool l2norm;
  RowFilter rows;                  // all rows unless a serving step says otherwise
};

// Chunked (WY, chunk 64) varlen prefill.
struct ChunkArgs {
  DType act, state;
  const void *q, *k;               // [T, H, K], token rows qk_ld elements apart
  const void* v;                   // [T, HV, V], token rows v_ld elements apart
  int64_t qk_ld = 0, v_ld = 0;     // as in RecurrentArgs
  const float *g, *beta;           // [T, HV] (g in log space, beta post-sigmoid)
  void* ssm_state;                 // [N, HV, K, V]
  void* o;                         // [T, HV, V]
  const int32_t* query_start_loc;  // [S + 1]
  const int32_t* state_indices;    // [S]
  const bool* has_initial_state;   // [S]
  int64_t T, S, N, H, HV, K, V;
  float scale, eps;
  bool l2norm;
  RowFilter rows;                  // all rows unless a serving step says otherwise
  int chunk_size = 0;              // 32 or 64 for every sequence; 0: the ISA's choice per sequence
};

// Token-row strides of q / k and v (RecurrentArgs, ChunkArgs): dense when the ld is 0.
template <class Args>
inline int64_t qk_row_stride(const Args& p) { return p.qk_ld ? p.qk_ld : p.H * p.K; }
template <class Args>
inline int64_t v_row_stride(const Args& p) { return p.v_ld ? p.v_ld : p.HV * p.V; }

// Dense projection y [T, out] = x [T, in] @ w [out, in]^T, f32 accumulation, one rounding
// to y's dtype. Each of x, w, y is f32 or bf16; all dense, row-major.
struct LinearArgs {
  DType x_dtype, w_dtype, y_dtype;
  const void* x;  // [T, in]
  const void* w;  // [out, in]; packed (one_part): [ceil(out / 16), ceil(in / 2), 16, 2] bf16
  void* y;        // [T, out]
  int64_t T, in, out;
};

// Packed projections of one x (gdn_jax.ops.merged_linear; the layer's in_proj_qkv, _z, _b, _a):
// part i is y_i [T, out_i] = x [T, in] @ w_i^T, w_i packed by gdn_jax.ops.pack_linear_weight
// ([ceil(out_i / 16), ceil(in / 2), 16, 2] bf16). One call: x is read (and on AMX copied into
// tile order) once for all parts, and the parts' work items share one fork.
struct LinearPart {
  const void* w;
  void* y;  // [T, out], LinearPackedArgs::y_dtype
  int64_t out;
};
constexpr int kMaxLinearParts = 8;
struct LinearPackedArgs {
  DType x_dtype, y_dtype;
  const void* x;  // [T, in]
  int64_t T, in;
  int n_parts;
  LinearPart parts[kMaxLinearParts];
};
// One packed projection (LinearArgs::w packed) as a LinearPackedArgs of one part.
inline LinearPackedArgs one_part(const LinearArgs& p) {
  LinearPackedArgs q{p.x_dtype, p.y_dtype, p.x, p.T, p.in, 1, {}};
  q.parts[0] = {p.w, p.y, p.out};
  return q;
}

// The bandwidth probe's spec pattern: pieces per group, the first read and written back, the
// others written (a spec row of 4 tokens: its start slot read, 4 states written).
constexpr int64_t kSpecProbeGroup = 4;

struct KernelTable {
  const char* isa = nullptr;
  void (*gating)(const GatingArgs&, const Parallel&) = nullptr;
  void (*conv_fwd)(const ConvArgs&, const Parallel&) = nullptr;
  void (*conv_update)(const ConvArgs&, const Parallel&) = nullptr;
  void (*recurrent)(const RecurrentArgs&, const Parallel&) = nullptr;
  void (*chunk)(const ChunkArgs&, const Parallel&) = nullptr;
  // The serving step's prefill rows: conv_fwd (its state and row filter included) and chunk
  // in one pass, the chunk's q, k, v (pointing into the rows of the conv's y) made per chunk
  // from x instead of written to y; the bits of conv_fwd then chunk. y is not touched.
  void (*conv_chunk)(const ConvArgs&, const ChunkArgs&, const Parallel&) = nullptr;
  // The chunk size chunk() uses for a sequence of `len` tokens (`forced`: ChunkArgs::chunk_size).
  int (*chunk_size_for)(int forced, int64_t len) = nullptr;
  // With bf16 activations, sequences of at least this many tokens take the chunk's Q S0 and
  // K S0 on bf16 pairs (kernels/chunk.h, bf16_state_products); 0: never. Benchmarks' flop mix.
  int64_t chunk_pairs_min_tokens = 0;
  void (*gated_rms_norm)(const GatedNormArgs&, const Parallel&) = nullptr;
  void (*linear)(const LinearArgs&, const Parallel&) = nullptr;
  void (*linear_packed)(const LinearPackedArgs&, const Parallel&) = nullptr;
  float (*fma_probe)(int64_t iters) = nullptr;  // benchmarks: f32 FMA peak
  int64_t fma_probe_flops = 0;                   // per iteration
  // benchmarks: bf16 dot-product peak; null on ISAs without a bf16 dot instruction.
  float (*bf16_dot_probe)(int64_t iters) = nullptr;
  int64_t bf16_dot_probe_flops = 0;  // per iteration
  // benchmarks: the spec verify's state traffic on kSpecProbeGroup pieces of n floats (probe.h).
  float (*spec_probe_piece)(float* dst, int64_t n) = nullptr;
  // tests: n f32 values through this ISA's vector f32 -> bf16 store (the kernels' rounding).
  void (*round_bf16)(const float* x, bf16* y, int64_t n) = nullptr;
  // tests: the same through the pair order of the recurrence's bf16 state (vec_avx2.h; the
  // plain order elsewhere), then y widened back into w the same way.
  void (*round_bf16_pairs)(const float* x, bf16* y, float* w, int64_t n) = nullptr;
  // tests: n values through this ISA's SiLU for bf16 outputs (vsilu_bf16), before the rounding.
  void (*silu_bf16)(const float* x, float* y, int64_t n) = nullptr;
};

}  // namespace gdn
