// Two builds of one ISA's kernels in one process: the working tree's (gdn_core) and a base
// revision's, compiled from that revision's ffi/src with the same flags into the namespace
// GDN_AB_BASE_NS (benchmarks/kernel_ab.py prepares and runs it). Each case calls the two in
// turn on one thread on the same inputs (the order swapped every round, the two sets of output
// and state buffers every other round) and reports the median of the per-round ratios
// new / base with their p25-p75. Before timing, each case runs once per build on identical
// copies of its state and compares every output and state byte: "same bits" or how many values
// differ. Where the code and scratch of the two builds land still biases one process's ratio
// by up to a few percent: kernel_ab.py runs several processes (benchmarks/README.md).
// Qwen3-Next-80B shapes (H = 16, HV = 32, K = V = 128, conv D = 8192, W = 4), bf16 activations,
// f32 state (the _bf16 cases: bf16).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gdn/dispatch.h"
#include "memory_hints.h"

namespace gdn {
namespace GDN_AB_BASE_NS {
void fill_table(KernelTable& t);
}
}  // namespace gdn

namespace {

using gdn::bf16;
using gdn::DType;
using gdn::KernelTable;
using gdn::Parallel;

constexpr int64_t H = 16, HV = 32, K = 128, V = 128, W = 4, L = W - 1, D = 2 * H * K + HV * V;

// A zeroed buffer on 2 MiB-aligned memory (XLA's large buffers are page-aligned; the conv's
// streamed stores need 64-byte rows).
struct Buf {
  std::unique_ptr<char, decltype(&std::free)> p{nullptr, &std::free};
  size_t bytes = 0;
  explicit Buf(size_t n = 0) : bytes(n) {
    if (n == 0) return;
    const size_t a = size_t(2) << 20, r = (n + a - 1) / a * a;
    p.reset(static_cast<char*>(std::aligned_alloc(a, r)));
    if (!p) {
      std::fprintf(stderr, "kernel_ab: out of memory (%zu bytes)\n", n);
      std::exit(1);
    }
    gdn::advise_huge_pages(p.get(), r);
    std::memset(p.get(), 0, r);
  }
  template <class T>
  T* as() const { return reinterpret_cast<T*>(p.get()); }
  Buf copy() const {
    Buf b(bytes);
    std::memcpy(b.p.get(), p.get(), bytes);
    return b;
  }
};

std::mt19937 g_rng(7);

bf16 to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return bf16{uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}

Buf normal_bf16(size_t n, float scale) {
  Buf b(n * 2);
  std::normal_distribution<float> nd(0.f, scale);
  for (size_t i = 0; i < n; ++i) b.as<bf16>()[i] = to_bf16(nd(g_rng));
  return b;
}

Buf normal_f32(size_t n, float scale) {
  Buf b(n * 4);
  std::normal_distribution<float> nd(0.f, scale);
  for (size_t i = 0; i < n; ++i) b.as<float>()[i] = nd(g_rng);
  return b;
}

// What one build's call writes: its own outputs and its own copy of the state pool.
struct Side {
  std::vector<Buf> outs;  // compared byte for byte between the builds; [0] may be the pool
  std::vector<int> elem;  // element size of each, for the count of differing values
  int64_t calls = 0;      // calls so far (the cycling cases' next slot set)
  Side& add(Buf b, int elem_bytes) {
    outs.push_back(std::move(b));
    elem.push_back(elem_bytes);
    return *this;
  }
};

// Zeroed outputs of these sizes in bytes, with their element sizes.
Side zeroed(std::initializer_list<std::pair<size_t, int>> bufs) {
  Side s;
  for (const auto& [bytes, elem] : bufs) s.add(Buf(bytes), elem);
  return s;
}

struct Case {
  std::string name, shape;
  std::function<void(const KernelTable&, Side&)> call;  // one call (the side's buffers)
  std::function<Side()> side;                           // fresh buffers, identical for both builds
};

// Per-call slot sets that cycle through a pool of `slots` (a cold pool when it is well past the
// LLC): slot i of a side's call c is (c * B + i) mod slots.
std::vector<int32_t> next_slots(Side& s, int64_t B, int64_t slots) {
  std::vector<int32_t> idx(static_cast<size_t>(B));
  for (int64_t i = 0; i < B; ++i) idx[size_t(i)] = int32_t((s.calls * B + i) % slots);
  ++s.calls;
  return idx;
}

// query_start_loc of `rows` rows of one token each.
std::vector<int32_t> one_token_rows(int64_t rows) {
  std::vector<int32_t> q(static_cast<size_t>(rows + 1));
  for (int64_t i = 0; i <= rows; ++i) q[size_t(i)] = int32_t(i);
  return q;
}

struct Inputs {
  int64_t T, B, pool_slots;
  Buf x, a, b, A_log, dt_bias, qkv;
};

Case gating_case(const Inputs& in) {
  const int64_t T = in.T;
  Case c{"gating", "T = " + std::to_string(T), nullptr, nullptr};
  c.side = [T] { return zeroed({{size_t(T * HV) * 4, 4}, {size_t(T * HV) * 4, 4}}); };
  c.call = [&in, T](const KernelTable& kt, Side& s) {
    const gdn::GatingArgs g{DType::bf16, in.a.p.get(), in.b.p.get(), in.A_log.as<float>(), in.dt_bias.as<float>(),
                            s.outs[0].as<float>(), s.outs[1].as<float>(), T, HV};
    kt.gating(g, Parallel{});
  };
  return c;
}

gdn::ConvArgs conv_args(const Inputs& in, int64_t T, void* y, void* pool, int64_t slots) {
  gdn::ConvArgs p{};
  p.act = DType::bf16;
  p.x = in.x.p.get();
  p.y = y;
  p.weight = in.qkv.p.get();  // [D, W] bf16: the first D * W values of the qkv buffer
  p.bias = nullptr;
  p.weight_dtype = p.bias_dtype = DType::bf16;
  p.T = T;
  p.D = D;
  p.W = W;
  p.silu = true;
  p.conv_state = pool;
  p.N = slots;
  p.L = L;
  p.slot_stride = L * D;
  p.time_stride = D;
  p.chan_stride = 1;
  return p;
}

Case conv_fwd_case(const Inputs& in) {
  const int64_t T = in.T;
  Case c{"conv_fwd", "T = " + std::to_string(T), nullptr, nullptr};
  c.side = [T] { return zeroed({{size_t(4 * L * D) * 2, 2}, {size_t(T * D) * 2, 2}}); };
  c.call = [&in, T](const KernelTable& kt, Side& s) {
    const int32_t qsl[2] = {0, int32_t(T)}, idx[1] = {1};
    const bool init[1] = {true};
    gdn::ConvArgs p = conv_args(in, T, s.outs[1].p.get(), s.outs[0].p.get(), 4);
    p.query_start_loc = qsl;
    p.state_indices = idx;
    p.has_initial_state = init;
    p.S = 1;
    // As the handler does: y past half the LLC goes out with streamed stores.
    p.stream_y = uint64_t(T * D * 2) > gdn::last_level_cache_bytes() / 2;
    kt.conv_fwd(p, Parallel{});
  };
  return c;
}

Case conv_update_case(const Inputs& in) {
  const int64_t B = in.B, slots = in.pool_slots * 32;  // conv slots are 48 KiB, the state's 2 MiB
  Case c{"conv_update", "B = " + std::to_string(B) + ", " + std::to_string(slots) + " slots", nullptr, nullptr};
  c.side = [B, slots] { return zeroed({{size_t(slots * L * D) * 2, 2}, {size_t(B * D) * 2, 2}}); };
  c.call = [&in, B, slots, qsl = one_token_rows(B), acc = std::vector<int32_t>(size_t(B), 1)](
               const KernelTable& kt, Side& s) {
    const std::vector<int32_t> idx = next_slots(s, B, slots);
    gdn::ConvArgs p = conv_args(in, B, s.outs[1].p.get(), s.outs[0].p.get(), slots);
    p.query_start_loc = qsl.data();
    p.state_indices = idx.data();
    p.num_accepted = acc.data();
    p.S = B;
    kt.conv_update(p, Parallel{});
  };
  return c;
}

// q, k, v rows of the recurrence and the chunk: the mixed [T, D] qkv form (q at 0, k at H K,
// v at 2 H K), as the serving step passes the conv's output.
template <class Args>
void qkv_rows(const Inputs& in, Args& p) {
  const bf16* qkv = in.qkv.as<bf16>();
  p.act = DType::bf16;
  p.state = DType::f32;
  p.q = qkv;
  p.k = qkv + H * K;
  p.v = qkv + 2 * H * K;
  p.qk_ld = p.v_ld = D;
  p.H = H;
  p.HV = HV;
  p.K = K;
  p.V = V;
  p.scale = 1.f / std::sqrt(float(K));
  p.eps = 1e-6f;
  p.l2norm = true;
}

// B rows of `tokens` tokens each from a cold pool: decode (one token, the slot updated in place)
// or spec verify (each token's state to a slot of its own, the first from the start slot).
Case recurrent_case(const Inputs& in, int64_t tokens, DType state, const char* name) {
  const int64_t B = in.B, n_tok = B * tokens, es = state == DType::bf16 ? 2 : 4;
  const int64_t slots = std::max(n_tok, in.pool_slots * 4 / es);  // the bytes of the f32 pool
  Case c{name,
         "B = " + std::to_string(B) + (tokens > 1 ? " x " + std::to_string(tokens) : "") +
             (state == DType::bf16 ? ", bf16" : ", f32") + " state, " + std::to_string(slots) + " slots",
         nullptr, nullptr};
  std::vector<int32_t> qsl(size_t(B + 1));
  for (int64_t i = 0; i <= B; ++i) qsl[size_t(i)] = int32_t(i * tokens);
  c.side = [n_tok, slots, es] {
    return zeroed({{size_t(slots * HV * K * V * es), int(es)}, {size_t(n_tok * HV * V) * 2, 2}});
  };
  c.call = [&in, B, tokens, n_tok, slots, state, qsl, acc = std::vector<int32_t>(size_t(B), 1)](
               const KernelTable& kt, Side& s) {
    const std::vector<int32_t> idx = next_slots(s, n_tok, slots);  // row i's columns: i * tokens + t
    gdn::RecurrentArgs r{};
    qkv_rows(in, r);
    r.state = state;
    r.a = in.a.p.get();
    r.b = in.b.p.get();
    r.A_log = in.A_log.as<float>();
    r.dt_bias = in.dt_bias.as<float>();
    r.ssm_state = s.outs[0].p.get();
    r.o = s.outs[1].p.get();
    r.query_start_loc = qsl.data();
    r.state_indices = idx.data();
    r.num_accepted = acc.data();
    r.index_cols = tokens;
    r.T = n_tok;
    r.S = B;
    r.N = slots;
    kt.recurrent(r, Parallel{});
  };
  return c;
}

// The chunked prefill of one sequence of T tokens from slot 1's state: the chunk alone (q, k, v
// read from the qkv rows), or the serving step's fused conv + chunk (conv_chunk: q, k, v made
// from x by the conv, chunk by chunk). g and beta come from the new build's gating, once.
Case chunk_case(const Inputs& in, bool fused) {
  const int64_t T = in.T;
  Case c{fused ? "conv_chunk" : "chunk", "T = " + std::to_string(T) + ", f32 state", nullptr, nullptr};
  auto gates = std::make_shared<Buf>(size_t(2 * T * HV) * 4);
  const gdn::GatingArgs g{DType::bf16, in.a.p.get(), in.b.p.get(), in.A_log.as<float>(), in.dt_bias.as<float>(),
                          gates->as<float>(), gates->as<float>() + T * HV, T, HV};
  gdn::current_table().gating(g, Parallel{});
  auto pool0 = std::make_shared<Buf>(normal_f32(size_t(4 * HV * K * V), 0.05f));
  c.side = [T, pool0, fused] {
    Side s;
    s.add(pool0->copy(), 4).add(Buf(size_t(T * HV * V) * 2), 2);
    if (fused) s.add(Buf(size_t(4 * L * D) * 2), 2);  // the conv's state
    return s;
  };
  c.call = [&in, T, gates, fused](const KernelTable& kt, Side& s) {
    const int32_t qsl[2] = {0, int32_t(T)}, idx[1] = {1};
    const bool init[1] = {true};
    gdn::ChunkArgs p{};
    qkv_rows(in, p);
    p.g = gates->as<float>();
    p.beta = gates->as<float>() + T * HV;
    p.ssm_state = s.outs[0].p.get();
    p.o = s.outs[1].p.get();
    p.query_start_loc = qsl;
    p.state_indices = idx;
    p.has_initial_state = init;
    p.T = T;
    p.S = 1;
    p.N = 4;
    if (!fused) {
      kt.chunk(p, Parallel{});
      return;
    }
    // The conv's y is never written by conv_chunk: q, k, v point into it only to name channels.
    gdn::ConvArgs cv = conv_args(in, T, const_cast<void*>(static_cast<const void*>(in.qkv.p.get())),
                                 s.outs[2].p.get(), 4);
    cv.query_start_loc = qsl;
    cv.state_indices = idx;
    cv.has_initial_state = init;
    cv.S = 1;
    kt.conv_chunk(cv, p, Parallel{});
  };
  return c;
}

// The layer's projections on packed w (GDNLayerParams.packed) of T tokens: in_proj's qkv and z
// parts in one call (in = hidden 2048), or out_proj (in = HV V). Random bf16 values stand in
// for the packed weights (the kernels read bytes; the layout decides only which multiply which).
// The calls cycle over copies of w holding at least --pool-mib (past the LLC: w from memory, as
// a model's layers read theirs).
Case linear_case(const Inputs& in, bool out_proj) {
  const int64_t T = in.T, hidden = 2048, n_in = out_proj ? HV * V : hidden;
  const std::vector<int64_t> outs = out_proj ? std::vector<int64_t>{hidden} : std::vector<int64_t>{D, HV * V};
  int64_t w_bytes = 0;
  for (const int64_t o : outs) w_bytes += o * n_in * 2;
  const int64_t copies = std::max<int64_t>(1, (in.pool_slots * HV * K * V * 4 + w_bytes - 1) / w_bytes);
  Case c{out_proj ? "out_proj" : "in_proj",
         "T = " + std::to_string(T) + ", in " + std::to_string(n_in) + (out_proj ? "" : ", 2 parts") + ", " +
             std::to_string(copies) + " w",
         nullptr, nullptr};
  auto x = std::make_shared<Buf>(normal_bf16(size_t(T * n_in), 1.f));
  auto w = std::make_shared<std::vector<Buf>>();  // copy k's parts at [k * parts + i]
  for (const int64_t o : outs) w->push_back(normal_bf16(size_t(o * n_in), 0.02f));
  for (int64_t k = 1; k < copies; ++k)
    for (size_t i = 0; i < outs.size(); ++i) w->push_back((*w)[i].copy());
  c.side = [T, outs] {
    Side s;
    for (const int64_t o : outs) s.add(Buf(size_t(T * o) * 2), 2);
    return s;
  };
  c.call = [T, n_in, outs, x, w, copies](const KernelTable& kt, Side& s) {
    const size_t k = size_t(s.calls++ % copies) * outs.size();
    gdn::LinearPackedArgs p{DType::bf16, DType::bf16, x->p.get(), T, n_in, int(outs.size()), {}};
    for (size_t i = 0; i < outs.size(); ++i) p.parts[i] = {(*w)[k + i].p.get(), s.outs[i].p.get(), outs[i]};
    kt.linear_packed(p, Parallel{});
  };
  return c;
}

// How many values of one output differ, and the largest relative difference among them.
std::string compare(const Buf& a, const Buf& b, int elem) {
  if (std::memcmp(a.p.get(), b.p.get(), a.bytes) == 0) return "";
  const size_t n = a.bytes / size_t(elem);
  size_t diff = 0;
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i) {
    float x, y;
    if (elem == 4) {
      x = a.as<float>()[i];
      y = b.as<float>()[i];
    } else {
      const uint32_t ux = uint32_t(a.as<uint16_t>()[i]) << 16, uy = uint32_t(b.as<uint16_t>()[i]) << 16;
      std::memcpy(&x, &ux, 4);
      std::memcpy(&y, &uy, 4);
    }
    if (std::memcmp(&x, &y, 4) == 0) continue;
    ++diff;
    const double d = std::fabs(double(x) - double(y)) / std::max(1e-30, std::max(std::fabs(double(x)), std::fabs(double(y))));
    worst = std::max(worst, std::isnan(d) ? INFINITY : d);
  }
  char s[96];
  std::snprintf(s, sizeof s, "%zu of %zu values differ (max rel %.1e)", diff, n, worst);
  return s;
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * double(v.size() - 1);
  const size_t i = size_t(pos);
  return i + 1 < v.size() ? v[i] + (pos - double(i)) * (v[i + 1] - v[i]) : v[i];
}

// Median seconds per call of `calls` calls.
double time_calls(const Case& c, const KernelTable& kt, Side& s, int calls) {
  std::vector<double> t(static_cast<size_t>(calls));
  for (int i = 0; i < calls; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    c.call(kt, s);
    t[size_t(i)] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return quantile(t, 0.5);
}

// Every case main() knows ("--cases all"), so that a smoke run of the driver covers a new one.
constexpr const char* kAllCases =
    "gating,conv_fwd,conv_update,decode,decode_bf16,spec,spec_bf16,chunk,conv_chunk,in_proj,out_proj";

int usage(const char* why) {
  std::fprintf(stderr,
               "%s\nusage: gdn_kernel_ab [--cases all|<comma-separated of %s>] "
               "[--tokens T] [--batch B] [--pool-mib M] [--rounds R] [--round-ms MS] [--expect-same-bits 0|1]\n",
               why, kAllCases);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string cases = "gating,conv_fwd,conv_update,decode,chunk,conv_chunk";
  int64_t T = 2048, B = 8, pool_mib = 256;
  int rounds = 12;
  double round_ms = 200.0;
  bool expect_same = false;  // exit status 1 when any case's bits differ (a change meant to keep them)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (i + 1 >= argc) return usage(("missing value for " + a).c_str());
    const std::string v = argv[++i];
    if (a == "--cases") cases = v == "all" ? kAllCases : v;
    else if (a == "--tokens") T = std::atoll(v.c_str());
    else if (a == "--batch") B = std::atoll(v.c_str());
    else if (a == "--pool-mib") pool_mib = std::atoll(v.c_str());
    else if (a == "--rounds") rounds = std::atoi(v.c_str());
    else if (a == "--round-ms") round_ms = std::atof(v.c_str());
    else if (a == "--expect-same-bits") expect_same = v == "1";
    else return usage(("bad argument " + a + " " + v).c_str());
  }
  if (T < 1 || B < 1 || pool_mib < 2 || rounds < 2 || round_ms <= 0)
    return usage("need T >= 1, B >= 1, M >= 2, R >= 2, MS > 0");

  // The working tree's table of the same ISA; only then the base's (its fill_table may use the
  // ISA's instructions itself).
  std::string why;
  if (!gdn::select_isa(GDN_AB_ISA_NAME, &why)) {
    std::fprintf(stderr, "kernel_ab: cannot run the %s units here: %s\n", GDN_AB_ISA_NAME, why.c_str());
    return 2;
  }
  const KernelTable& now = gdn::current_table();
  KernelTable base;
  gdn::GDN_AB_BASE_NS::fill_table(base);
  base.isa = GDN_AB_ISA_NAME;

  const int64_t rows = std::max(T, 4 * B);  // spec: B rows of 4 tokens
  Inputs in{T, B, std::max<int64_t>(B, (pool_mib << 20) / (HV * K * V * 4)), normal_bf16(size_t(rows * D), 1.f),
            normal_bf16(size_t(rows * HV), 1.f), normal_bf16(size_t(rows * HV), 1.f), Buf(HV * 4), Buf(HV * 4),
            normal_bf16(size_t(std::max(rows * D, D * W)), 0.5f)};
  for (int64_t h = 0; h < HV; ++h) {
    in.A_log.as<float>()[h] = std::log(1.f + float(h % 16));
    in.dt_bias.as<float>()[h] = 0.1f * float(h % 5) - 0.2f;
  }

  std::printf("kernel_ab: isa %s, one thread, %d rounds of ~%.0f ms per build; ratio = new / base per round\n",
              base.isa, rounds, round_ms);
  std::printf("%-12s %-34s %12s %12s %22s  %s\n", "case", "shape", "base us", "new us", "new/base (p25-p75)", "bits");
  bool all_same = true;
  size_t start = 0;
  while (start <= cases.size()) {
    const size_t end = std::min(cases.find(',', start), cases.size());
    const std::string name = cases.substr(start, end - start);
    start = end + 1;
    Case c;
    if (name == "gating") c = gating_case(in);
    else if (name == "conv_fwd") c = conv_fwd_case(in);
    else if (name == "conv_update") c = conv_update_case(in);
    else if (name == "decode") c = recurrent_case(in, 1, DType::f32, "decode");
    else if (name == "decode_bf16") c = recurrent_case(in, 1, DType::bf16, "decode_bf16");
    else if (name == "spec") c = recurrent_case(in, 4, DType::f32, "spec");
    else if (name == "spec_bf16") c = recurrent_case(in, 4, DType::bf16, "spec_bf16");
    else if (name == "chunk") c = chunk_case(in, false);
    else if (name == "conv_chunk") c = chunk_case(in, true);
    else if (name == "in_proj") c = linear_case(in, false);
    else if (name == "out_proj") c = linear_case(in, true);
    else return usage(("unknown case " + name).c_str());

    // Bits: one call each on identical buffers (the cycling cases start at the same slots).
    Side sb = c.side(), sn = c.side();
    c.call(base, sb);
    c.call(now, sn);
    std::string bits;
    for (size_t i = 0; i < sb.outs.size(); ++i) {
      const std::string d = compare(sb.outs[i], sn.outs[i], sb.elem[i]);
      if (!d.empty()) bits += (bits.empty() ? "" : "; ") + std::string("output ") + std::to_string(i) + ": " + d;
    }
    all_same = all_same && bits.empty();
    if (bits.empty()) bits = "same bits";

    // Calls per round from one timed call of each build.
    const double once = 0.5 * (time_calls(c, base, sb, 3) + time_calls(c, now, sn, 3));
    const int calls = std::max(3, int(round_ms * 1e-3 / std::max(once, 1e-7)));
    // The order swaps every round and the two sets of buffers every other round, so that neither
    // build keeps the first turn or the luckier placement of its data in the caches.
    std::vector<double> ratio, tb, tn;
    for (int r = 0; r < rounds; ++r) {
      Side& for_base = (r / 2) % 2 == 0 ? sb : sn;
      Side& for_new = (r / 2) % 2 == 0 ? sn : sb;
      double b, n;
      if (r % 2 == 0) {
        b = time_calls(c, base, for_base, calls);
        n = time_calls(c, now, for_new, calls);
      } else {
        n = time_calls(c, now, for_new, calls);
        b = time_calls(c, base, for_base, calls);
      }
      tb.push_back(b);
      tn.push_back(n);
      ratio.push_back(n / b);
    }
    char rr[64];
    std::snprintf(rr, sizeof rr, "%.3f (%.3f-%.3f)", quantile(ratio, 0.5), quantile(ratio, 0.25), quantile(ratio, 0.75));
    std::printf("%-12s %-34s %12.1f %12.1f %22s  %s\n", c.name.c_str(), c.shape.c_str(), quantile(tb, 0.5) * 1e6,
                quantile(tn, 0.5) * 1e6, rr, bits.c_str());
    std::fflush(stdout);
  }
  if (expect_same && !all_same) {
    std::fprintf(stderr, "kernel_ab: the builds wrote different bits (--expect-same-bits 1)\n");
    return 1;
  }
  return 0;
}
