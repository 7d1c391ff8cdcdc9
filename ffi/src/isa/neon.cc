// AArch64 NEON back end (every Armv8-A core). Selected when HWCAP has ASIMD.
#include <arm_neon.h>
#define GDN_ISA_NS neon
#define GDN_VEC_HEADER "kernels/vec_neon.h"
#include "kernels/all_kernels.inc"
