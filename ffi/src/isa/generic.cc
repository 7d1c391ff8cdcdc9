// Portable back end: any x86-64 or aarch64 compiler, baseline flags. Always available.
#define GDN_ISA_NS generic
#define GDN_VEC_HEADER "kernels/vec_generic.h"
#include "kernels/all_kernels.inc"
