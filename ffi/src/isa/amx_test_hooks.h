// Test entry points into the amx_model translation unit (x86 builds only): the software tile
// model with run-time tile numbers, and the AMX micro-GEMM itself run through the model.
// Used by tests/cpp/core_tests.cc; not part of the kernel table.
#pragma once
#include <cstdint>

#include "gdn/types.h"  // LinearArgs, Parallel

namespace gdn {
namespace amx_model_test {

// The tile instructions of the model (kernels/amx_tiles.h). cfg: the 64-byte ldtilecfg block.
// A would-be hardware fault prints a line and aborts the process.
void ldtilecfg(const void* cfg);
void tileloadd(int tile, const void* base, int64_t stride);
void tilestored(int tile, void* base, int64_t stride);
void tilezero(int tile);
void tdpbf16ps(int c, int a, int b);
void tilerelease();
// The raw 16 x 64 bytes of a tile register (writable: tests plant stale contents).
uint8_t* tile_bytes(int tile);

// The AMX micro-GEMM (kernels/amx_gemm.h) with `parts` bf16 parts per operand (1, 2 = the
// back end, 3): Cout = (crs ? crs ⊙ Cin : 0) + A B, A(i, p) = A[i * rsa + p * csa], B, Cin and
// Cout addressed per 16-column block ({p, ld, bs} as chunk.h's Mat), Cout f32 or bf16 bits.
// shape: 0 full, 1 triangular columns, 2 triangular depth (chunk.h's GemmShape).
void gemm(int parts, bool out_bf16, int M, int N, int P, const float* A, int64_t rsa, int64_t csa,
          const float* B, int64_t ldb, int64_t bsb, const float* Cin, int64_t ldc, int64_t bsc,
          const float* crs, void* Cout, int64_t ldo, int64_t bso, int shape);

// The packed projection's tile paths (kernels/linear_packed.h), bf16 x, whatever x's size:
// panel_rows 0 the unpacked tiles (linear_packed_amx), -1 x packed in the default panels, else
// in panels of panel_rows rows; items over w groups of at most group_bytes
// (linear_packed_amx_panels).
void linear_packed_tiles(const LinearPackedArgs& p, const Parallel& par, int64_t panel_rows, int64_t group_bytes);

}  // namespace amx_model_test
}  // namespace gdn
