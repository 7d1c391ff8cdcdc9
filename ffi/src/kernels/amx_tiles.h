// The AMX tile operations the kernels use (palette 1: 8 tiles tmm0..tmm7 of at most 16 rows
// x 64 bytes, configured by a 64-byte block). Included inside the ISA namespace (no include
// guard, no system includes).
//
// Two implementations of one interface, chosen by the translation unit:
//  * real (isa/amx.cc, compiled with -mamx-tile -mamx-bf16): each call is the instruction
//    itself (inline asm: the tile number must be an immediate, and GCC 12's _tile_loadd /
//    _tile_loadconfig macros do not tell the compiler that they read memory, which lets it
//    drop or sink the stores that packed the operand; these have a "memory" clobber);
//  * model (isa/amx_model.cc defines GDN_AMX_MODEL): a per-thread software tile register
//    file (8 x 1 KiB + the configuration) with the architectural semantics of the Intel SDM,
//    so that the AMX kernels' own code (tiling, VNNI packing, tile config) runs on any x86
//    CPU in the tests. It traps (prints and aborts) where the hardware would fault (#GP on a
//    bad configuration, #UD on a tile op without one or with inconsistent shapes).
//
// Semantics (both): ldtilecfg sets every tile's shape and zeroes all tile data; tileloadd
// fills rows [0, rows) with colsb bytes each from base + r * stride and zeroes the rest of the
// 16 x 64-byte register; tilestored writes rows [0, rows), colsb bytes each; tilezero zeroes
// the tile; tdpbf16ps C += A . B on bf16 pairs (see tile_dpbf16ps below); tilerelease returns
// to the init state (no configuration).

constexpr int kTileRows = 16;    // palette 1: max rows
constexpr int kTileColsB = 64;   // palette 1: max bytes per row
constexpr int kTiles = 8;        // palette 1: tmm0..tmm7

// The 64-byte operand of ldtilecfg.
struct alignas(64) AmxTileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
static_assert(sizeof(AmxTileConfig) == 64, "ldtilecfg operand is 64 bytes");

// A config with tiles [0, n) of rows x colsb each (palette 1), the others unused.
inline AmxTileConfig amx_config(int n, int rows, int colsb) {
  AmxTileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int t = 0; t < n; ++t) {
    c.rows[t] = uint8_t(rows);
    c.colsb[t] = uint16_t(colsb);
  }
  return c;
}

#if defined(GDN_AMX_MODEL)

// ---------------------------------------------------------------------------------------
// Software model
// ---------------------------------------------------------------------------------------

struct AmxModelState {
  alignas(64) uint8_t data[kTiles][kTileRows][kTileColsB];
  int rows[kTiles];
  int colsb[kTiles];
  bool configured = false;  // false: init state (no ldtilecfg yet, or tilerelease)
};

inline AmxModelState& amx_model_state() {
  static thread_local AmxModelState s;
  return s;
}

[[noreturn]] inline void amx_model_fault(const char* insn, const char* why) {
  std::fprintf(stderr, "AMX model: %s would fault on hardware: %s\n", insn, why);
  std::fflush(stderr);
  std::abort();
}

// Tile t must be configured (both dims non-zero) and AMX state not init.
inline void amx_model_need(const char* insn, int t) {
  const AmxModelState& s = amx_model_state();
  if (!s.configured) amx_model_fault(insn, "no tile configuration (#UD)");
  if (t < 0 || t >= kTiles) amx_model_fault(insn, "tile number out of range");
  if (s.rows[t] == 0 || s.colsb[t] == 0) amx_model_fault(insn, "tile not configured (#UD)");
}

inline void tile_loadconfig(const AmxTileConfig* cfg) {
  AmxModelState& s = amx_model_state();
  if (cfg->palette_id == 0) {  // palette 0: init state, like tilerelease
    s.configured = false;
    return;
  }
  if (cfg->palette_id != 1) amx_model_fault("ldtilecfg", "palette other than 0 or 1 (#GP)");
  if (cfg->start_row != 0) amx_model_fault("ldtilecfg", "start_row != 0 (the kernels never restart)");
  for (uint8_t r : cfg->reserved)
    if (r != 0) amx_model_fault("ldtilecfg", "reserved bytes not zero (#GP)");
  for (int t = 0; t < 16; ++t) {
    const int rows = cfg->rows[t], colsb = cfg->colsb[t];
    if (t >= kTiles) {
      if (rows != 0 || colsb != 0) amx_model_fault("ldtilecfg", "tile >= 8 configured in palette 1 (#GP)");
      continue;
    }
    if (rows > kTileRows) amx_model_fault("ldtilecfg", "rows > 16 (#GP)");
    if (colsb > kTileColsB) amx_model_fault("ldtilecfg", "colsb > 64 (#GP)");
    if ((rows == 0) != (colsb == 0)) amx_model_fault("ldtilecfg", "one of rows/colsb zero, the other not (#GP)");
  }
  for (int t = 0; t < kTiles; ++t) {
    s.rows[t] = cfg->rows[t];
    s.colsb[t] = cfg->colsb[t];
  }
  std::memset(s.data, 0, sizeof s.data);  // ldtilecfg zeroes all tile data
  s.configured = true;
}

inline void tile_release() {
  AmxModelState& s = amx_model_state();
  std::memset(s.data, 0, sizeof s.data);
  s.configured = false;
}

// The model's operations take the tile number at run time (the test hooks call them so);
// the kernels use the template forms below, like the real instructions.
inline void amx_model_zero(int T) {
  amx_model_need("tilezero", T);
  std::memset(amx_model_state().data[T], 0, sizeof amx_model_state().data[T]);
}

inline void amx_model_load(int T, const void* base, int64_t stride) {
  amx_model_need("tileloadd", T);
  AmxModelState& s = amx_model_state();
  const uint8_t* b = static_cast<const uint8_t*>(base);
  for (int r = 0; r < kTileRows; ++r) {
    uint8_t* row = s.data[T][r];
    if (r < s.rows[T]) {
      std::memcpy(row, b + r * stride, size_t(s.colsb[T]));
      std::memset(row + s.colsb[T], 0, size_t(kTileColsB - s.colsb[T]));
    } else {
      std::memset(row, 0, kTileColsB);
    }
  }
}

inline void amx_model_store(int T, void* base, int64_t stride) {
  amx_model_need("tilestored", T);
  const AmxModelState& s = amx_model_state();
  uint8_t* b = static_cast<uint8_t*>(base);
  for (int r = 0; r < s.rows[T]; ++r) std::memcpy(b + r * stride, s.data[T][r], size_t(s.colsb[T]));
}

// bf16 input with denormals treated as zero (sign kept).
inline float amx_model_bf16_daz(uint16_t h) {
  if ((h & 0x7f80u) == 0) h &= 0x8000u;
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// f32 with denormals flushed to zero (sign kept): DAZ on f32 inputs, FTZ on outputs.
inline float amx_model_ftz(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  std::memcpy(&x, &u, 4);
  return x;
}
// One f32 FMA c + a * b, rounded once to nearest even, DAZ and FTZ. a and b are bf16 values:
// their product (<= 16 significant bits) is exact in double; the double sum is then either
// exact, or one term lies far below an f32 ulp of the other, so rounding it to f32 gives the
// correctly rounded f32 FMA (no double-rounding error: 53 >= 2 * 24 + 2 bits). Checked
// against std::fma in tests/cpp/core_tests.cc. Not modelled: whether the hardware decides
// "tiny" for FTZ before or after rounding (results within an ulp of 2^-126 only).
inline float amx_model_fma(float a, float b, float c) {
  return amx_model_ftz(float(double(a) * double(b) + double(c)));
}

// TDPBF16PS tmm<C>, tmm<A>, tmm<B> (Intel SDM): for each row m < C.rows, two f32 partial
// sums per output column, the even and the odd bf16 of each pair, accumulated over k <
// A.colsb / 4 with FMA (RNE, DAZ, FTZ); then C[m][n] += even + odd (two more roundings).
// Bytes of C past colsb and rows past C.rows are zeroed. Faults on inconsistent shapes.
inline void amx_model_dpbf16ps(int C, int A, int B) {
  if (C == A || C == B || A == B) amx_model_fault("tdpbf16ps", "the same tile twice (#UD)");
  amx_model_need("tdpbf16ps", C);
  amx_model_need("tdpbf16ps", A);
  amx_model_need("tdpbf16ps", B);
  AmxModelState& s = amx_model_state();
  if (s.colsb[C] % 4 || s.colsb[A] % 4 || s.colsb[B] % 4) amx_model_fault("tdpbf16ps", "colsb not a multiple of 4 (#UD)");
  if (s.rows[C] != s.rows[A]) amx_model_fault("tdpbf16ps", "C.rows != A.rows (#UD)");
  if (s.colsb[A] / 4 != s.rows[B]) amx_model_fault("tdpbf16ps", "A.colsb / 4 != B.rows (#UD)");
  if (s.colsb[C] != s.colsb[B]) amx_model_fault("tdpbf16ps", "C.colsb != B.colsb (#UD)");
  const int M = s.rows[C], N = s.colsb[C] / 4, Kp = s.colsb[A] / 4;
  for (int m = 0; m < kTileRows; ++m) {
    uint8_t* crow = s.data[C][m];
    if (m >= M) {
      std::memset(crow, 0, kTileColsB);
      continue;
    }
    float even[16], odd[16];
    for (int n = 0; n < N; ++n) even[n] = odd[n] = 0.f;
    for (int k = 0; k < Kp; ++k) {
      uint16_t a[2];
      std::memcpy(a, s.data[A][m] + 4 * k, 4);
      const float a0 = amx_model_bf16_daz(a[0]), a1 = amx_model_bf16_daz(a[1]);
      const uint8_t* brow = s.data[B][k];
      for (int n = 0; n < N; ++n) {
        uint16_t b[2];
        std::memcpy(b, brow + 4 * n, 4);
        even[n] = amx_model_fma(a0, amx_model_bf16_daz(b[0]), even[n]);
        odd[n] = amx_model_fma(a1, amx_model_bf16_daz(b[1]), odd[n]);
      }
    }
    for (int n = 0; n < N; ++n) {
      float c;
      std::memcpy(&c, crow + 4 * n, 4);
      const float t = amx_model_ftz(even[n] + odd[n]);
      c = amx_model_ftz(amx_model_ftz(c) + t);
      std::memcpy(crow + 4 * n, &c, 4);
    }
    std::memset(crow + 4 * N, 0, size_t(kTileColsB - 4 * N));
  }
}

template <int T>
inline void tile_zero() { amx_model_zero(T); }
template <int T>
inline void tile_load(const void* base, int64_t stride) { amx_model_load(T, base, stride); }
template <int T>
inline void tile_store(void* base, int64_t stride) { amx_model_store(T, base, stride); }
template <int C, int A, int B>
inline void tile_dpbf16ps() {
  static_assert(C != A && C != B && A != B, "tdpbf16ps needs three distinct tiles (#UD)");
  amx_model_dpbf16ps(C, A, B);
}

// Test access to the raw 16 x 64 bytes of a tile register (model only). Tests may write it
// to stand for stale register contents, which a load must clear past the configured shape.
inline uint8_t* amx_model_tile_bytes(int t) { return &amx_model_state().data[t][0][0]; }

#elif defined(__AMX_TILE__) && defined(__AMX_BF16__)

// ---------------------------------------------------------------------------------------
// Real instructions
// ---------------------------------------------------------------------------------------

inline void tile_loadconfig(const AmxTileConfig* cfg) {
  __asm__ volatile("ldtilecfg %0" ::"m"(*cfg) : "memory");
}
inline void tile_release() { __asm__ volatile("tilerelease" ::: "memory"); }

template <int T>
inline void tile_zero() {
  __asm__ volatile("tilezero %%tmm%c0" ::"n"(T));
}
template <int T>
inline void tile_load(const void* base, int64_t stride) {
  __asm__ volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride), "n"(T) : "memory");
}
template <int T>
inline void tile_store(void* base, int64_t stride) {
  __asm__ volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride), "n"(T) : "memory");
}
// AT&T operand order: tdpbf16ps src2, src1, dst.
template <int C, int A, int B>
inline void tile_dpbf16ps() {
  static_assert(C != A && C != B && A != B, "tdpbf16ps needs three distinct tiles (#UD)");
  __asm__ volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"n"(C), "n"(A), "n"(B));
}

#else
#error "amx_tiles.h: compile with -mamx-tile -mamx-bf16 (real tiles) or define GDN_AMX_MODEL (software model)"
#endif
