// AArch64 NEON + BF16 back end (Armv8.6-A: Graviton3/4, Neoverse V1/V2), compiled with
// -march=armv8.6-a+bf16; selected only when HWCAP2 has BF16. Hardware f32 -> bf16 conversion
// (BFCVTN) and the chunked prefill's micro-GEMM on BFMMLA (GDN_ARM_BF16:
// kernels/neon_bf16_gemm.h, split-bf16 operands); the rest is the neon code.
#include <arm_neon.h>
#if !defined(__ARM_FEATURE_BF16_VECTOR_ARITHMETIC)
#error "isa/neon_bf16.cc must be compiled with -march=armv8.6-a+bf16 (CMakeLists.txt)"
#endif
#define GDN_ISA_NS neon_bf16
#define GDN_VEC_HEADER "kernels/vec_neon.h"
#define GDN_ARM_BF16 1
#include "kernels/all_kernels.inc"

#include "isa/neon_bf16_test_hooks.h"

namespace gdn {
namespace neon_bf16_test {

namespace {
template <int Parts, class TO>
void run_gemm(int M, int N, int P, const float* A, int64_t rsa, int64_t csa, const float* B, int64_t ldb,
              int64_t bsb, const float* Cin, int64_t ldc, int64_t bsc, const float* crs, void* Cout, int64_t ldo,
              int64_t bso, int shape) {
  using namespace neon_bf16;
  gemm_bfmmla<Parts, TO>(M, N, P, A, rsa, csa, Mat<const float>{B, ldb, bsb}, Mat<const float>{Cin, ldc, bsc}, crs,
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

}  // namespace neon_bf16_test
}  // namespace gdn
