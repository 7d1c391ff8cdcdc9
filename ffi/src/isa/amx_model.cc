// The AMX kernels run through a software model of the tile instructions (GDN_AMX_MODEL, see
// kernels/amx_tiles.h): the same kernel source as isa/amx.cc (tiling, VNNI packing, tile
// config), compiled with baseline flags and the generic vector header, so that it runs on any
// x86-64 CPU. A test ISA: listed last by available_isas() and never chosen automatically.
#define GDN_ISA_NS amx_model
#define GDN_VEC_HEADER "kernels/vec_generic.h"
#define GDN_AMX 1
#define GDN_AMX_MODEL 1
#include "kernels/all_kernels.inc"

#include "isa/amx_test_hooks.h"

namespace gdn {
namespace amx_model_test {

void ldtilecfg(const void* cfg) {
  amx_model::AmxTileConfig c;
  std::memcpy(&c, cfg, sizeof c);
  amx_model::tile_loadconfig(&c);
}
void tileloadd(int tile, const void* base, int64_t stride) { amx_model::amx_model_load(tile, base, stride); }
void tilestored(int tile, void* base, int64_t stride) { amx_model::amx_model_store(tile, base, stride); }
void tilezero(int tile) { amx_model::amx_model_zero(tile); }
void tdpbf16ps(int c, int a, int b) { amx_model::amx_model_dpbf16ps(c, a, b); }
void tilerelease() { amx_model::tile_release(); }
uint8_t* tile_bytes(int tile) { return amx_model::amx_model_tile_bytes(tile); }

namespace {
template <int Parts, class TO>
void run_gemm(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb,
              int64_t bsb, const float* Cin, int64_t ldc, int64_t bsc, const float* crs, void* Cout, int64_t ldo,
              int64_t bso, int shape) {
  using namespace amx_model;
  gemm_amx<Parts, TO>(M, N, P, A, rsa, csa, Mat<const float>{B, ldb, bsb}, Mat<const float>{Cin, ldc, bsc}, crs,
                      Mat<TO>{static_cast<TO*>(Cout), ldo, bso}, static_cast<GemmShape>(shape));
}
}  // namespace

void gemm(int parts, bool out_bf16, int M, int N, int P, const float* A, int64_t rsa, int64_t csa,
          const float* B, int64_t ldb, int64_t bsb, const float* Cin, int64_t ldc, int64_t bsc,
          const float* crs, void* Cout, int64_t ldo, int64_t bso, int shape) {
#define GDN_RUN(PARTS, TO) run_gemm<PARTS, TO>(M, N, P, A, rsa, csa, B, ldb, bsb, Cin, ldc, bsc, crs, Cout, ldo, bso, shape)
  if (out_bf16) {
    if (parts == 1) GDN_RUN(1, bf16);
    else if (parts == 3) GDN_RUN(3, bf16);
    else GDN_RUN(2, bf16);
  } else {
    if (parts == 1) GDN_RUN(1, float);
    else if (parts == 3) GDN_RUN(3, float);
    else GDN_RUN(2, float);
  }
#undef GDN_RUN
}

}  // namespace amx_model_test
}  // namespace gdn
