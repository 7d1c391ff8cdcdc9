// AVX2 + FMA back end (Haswell / Zen and later without AVX-512). Compiled with -mavx2 -mfma
// -mf16c (CMakeLists.txt); selected only when the CPU and OS support all of them.
#include <immintrin.h>
#define GDN_ISA_NS avx2
#define GDN_VEC_HEADER "kernels/vec_avx2.h"
// Chunk size of sequences longer than 128 tokens (kernels/chunk.h): 32 measured 4-11% faster
// than 64 here on Zen 3 (ffi/README.md, "Chunk size").
#define GDN_CHUNK_LONG 32
#include "kernels/all_kernels.inc"
