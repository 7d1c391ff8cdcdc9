// AVX-512F (+DQ/BW/VL, FMA) back end. Compiled with -mavx512f... (CMakeLists.txt);
// selected only when the CPU and OS support all of them.
#include <immintrin.h>
#define GDN_ISA_NS avx512
#define GDN_VEC_HEADER "kernels/vec_avx512.h"
#include "kernels/all_kernels.inc"
