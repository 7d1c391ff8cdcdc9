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

void linear_packed_tiles(const LinearPackedArgs& p, const Parallel& par, int64_t panel_rows, int64_t group_bytes) {
  const bool y_bf16 = p.y_dtype == DType::bf16;
  if (panel_rows == 0 && y_bf16) return amx_model::linear_packed_amx<bf16>(p, par);
  if (panel_rows == 0) return amx_model::linear_packed_amx<float>(p, par);
  const int64_t rows = panel_rows < 0 ? 0 : panel_rows;
  if (y_bf16) return amx_model::linear_packed_amx_panels<bf16>(p, par, rows, group_bytes);
  amx_model::linear_packed_amx_panels<float>(p, par, rows, group_bytes);
}

#define GDN_SPLIT_GEMM gemm_amx
#include "isa/split_gemm_test_hook.inc"
#undef GDN_SPLIT_GEMM

}  // namespace amx_model_test
}  // namespace gdn
