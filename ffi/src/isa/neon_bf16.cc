// AArch64 NEON + BF16 back end (Armv8.6-A: Graviton3/4, Neoverse V1/V2), compiled with
// -march=armv8.6-a+bf16; selected only when HWCAP2 has BF16.
#include <arm_neon.h>
#define GDN_ISA_NS neon_bf16
#define GDN_VEC_HEADER "kernels/vec_neon.h"
#include "kernels/all_kernels.inc"
