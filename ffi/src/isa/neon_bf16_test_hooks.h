// Test entry point into the neon_bf16 translation unit (aarch64 builds only): the BFMMLA
// micro-GEMM of kernels/neon_bf16_gemm.h. Used by tests/cpp/core_tests.cc; not part of the
// kernel table. Call it only when available_isas() lists neon_bf16 (else SIGILL).
#pragma once
#include <cstdint>

namespace gdn {
namespace neon_bf16_test {

// Same arguments as amx_model_test::gemm (isa/amx_test_hooks.h): `parts` bf16 parts per
// operand (1, 2 = bf16 activations, 3 = f32 activations), Cout = (crs ? crs ⊙ Cin : 0) + A B,
// A(i, p) = A[i * rsa + p * csa], B, Cin and Cout addressed per 16-column block ({p, ld, bs}
// as chunk.h's Mat), Cout f32 or bf16 bits; shape: 0 full, 1 triangular columns, 2
// triangular depth (chunk.h's GemmShape).
void gemm(int parts, bool out_bf16, int M, int N, int P, const float* A, int64_t rsa, int64_t csa,
          const float* B, int64_t ldb, int64_t bsb, const float* Cin, int64_t ldc, int64_t bsc,
          const float* crs, void* Cout, int64_t ldo, int64_t bso, int shape);

}  // namespace neon_bf16_test
}  // namespace gdn
