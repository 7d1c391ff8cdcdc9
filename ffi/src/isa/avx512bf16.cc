// AVX-512 + AVX512-BF16 back end: hardware bf16 conversion (VCVTNEPS2BF16) and bf16 dot
// products (VDPBF16PS). Selected only when the CPU has AVX512_BF16 besides the AVX-512 set.
#include <immintrin.h>
#define GDN_ISA_NS avx512bf16
#define GDN_VEC_HEADER "kernels/vec_avx512.h"
// Chunk size of sequences longer than 128 tokens (kernels/chunk.h): 32 measured 4-9% faster
// than 64 on Zen 4 (ffi/README.md, "Chunk size").
#define GDN_CHUNK_LONG 32
// bf16 activations: the chunk's Q S0 and K S0 on VDPBF16PS in sequences over 128 tokens
// (kernels/chunk.h, bf16_state_products; ffi/README.md, "bf16 products with the state").
#define GDN_CHUNK_BF16_STATE 1
#include "kernels/all_kernels.inc"
