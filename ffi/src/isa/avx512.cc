// AVX-512F (+DQ/BW/VL, FMA) back end. Compiled with -mavx512f... (CMakeLists.txt);
// selected only when the CPU and OS support all of them.
#include <immintrin.h>
#define GDN_ISA_NS avx512
#define GDN_VEC_HEADER "kernels/vec_avx512.h"
// Chunk size of sequences longer than 128 tokens (kernels/chunk.h): 32 measured 4-9% faster
// than 64 on Zen 4 (ffi/README.md, "Chunk size").
#define GDN_CHUNK_LONG 32
#include "kernels/all_kernels.inc"
