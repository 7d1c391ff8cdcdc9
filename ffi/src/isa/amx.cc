// AMX-BF16 back end (Sapphire Rapids and later): the avx512bf16 kernels, with the chunked
// prefill's micro-GEMM on AMX tiles (kernels/amx_gemm.h, split-bf16). Compiled with the
// AVX512-BF16 flags plus -mamx-tile -mamx-bf16 (CMakeLists.txt); selected only when CPUID
// has AMX-TILE, AMX-BF16 and the AVX512-BF16 set, the OS enables tile state in XCR0, and
// Linux granted this process tile data permission (dispatch.cc).
#include <immintrin.h>
#if !defined(__AMX_TILE__) || !defined(__AMX_BF16__) || !defined(__AVX512BF16__)
#error "isa/amx.cc must be compiled with -mamx-tile -mamx-bf16 -mavx512bf16 (CMakeLists.txt)"
#endif
#define GDN_ISA_NS amx
#define GDN_VEC_HEADER "kernels/vec_avx512.h"
#define GDN_AMX 1
// GDN_CHUNK_LONG stays 64: C = 32 measured level on AMX (ffi/README.md, "Chunk size").
#include "kernels/all_kernels.inc"
