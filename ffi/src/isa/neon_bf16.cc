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

#define GDN_SPLIT_GEMM gemm_bfmmla
#include "isa/split_gemm_test_hook.inc"
#undef GDN_SPLIT_GEMM

}  // namespace neon_bf16_test
}  // namespace gdn
