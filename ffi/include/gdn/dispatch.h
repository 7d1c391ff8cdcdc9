// Run-time choice of the kernel table from the exact CPU features each ISA needs.
#pragma once
#include <string>
#include <vector>

#include "gdn/types.h"

namespace gdn {

// Names, best first: "amx", "avx512bf16", "avx512", "avx2", "neon_bf16", "neon", "generic",
// then the test ISA "amx_model" (x86 builds: the AMX kernels on a software tile model; never
// chosen automatically). Those compiled into this build and supported by this CPU (and OS and
// Linux permission, for AMX tiles).
std::vector<std::string> available_isas();

// The table the handlers use now. Chosen at load: GDN_JAX_ISA if set (must be available),
// else the best available ISA.
const KernelTable& current_table();
std::string selected_isa();

// Forces an ISA (tests, benchmarks). Returns false and leaves the choice unchanged if the
// name is unknown or not available here; `why` then says which and why.
bool select_isa(const std::string& name, std::string* why);

// Forces the chunked prefill's chunk size for every sequence: 32 or 64, or 0 for each ISA's own
// choice (kernels/chunk.h, chunk_size_for). Benchmarks and tests; false for any other size.
bool force_chunk_size(int size);
int forced_chunk_size();

// CPU feature report for diagnostics ("avx512f avx512bf16 ..."). When the CPU has AMX but
// it cannot be used, one of "amx_os_disabled", "amx_permission_denied" is listed too.
std::string cpu_features();

// AMX availability, exposed for the tests. request_amx_permission(): asks Linux for tile data
// permission (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)); 0 when granted, else the
// errno (-1 off x86). decide_amx(): the verdict from CPUID (AMX-TILE + AMX-BF16 + the
// AVX512-BF16 set), the OS (XCR0 tile state) and that permission; dispatch asks once.
struct AmxDecision {
  bool available = false;
  std::string token;  // "", "amx_os_disabled" or "amx_permission_denied" (cpu_features)
  std::string why;    // why unavailable (select_isa's message)
};
int request_amx_permission();
AmxDecision decide_amx(bool cpu_has, bool os_has, int permission);

}  // namespace gdn
