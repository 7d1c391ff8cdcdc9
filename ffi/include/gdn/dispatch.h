// Run-time choice of the kernel table from the exact CPU features each ISA needs.
#pragma once
#include <string>
#include <vector>

#include "gdn/types.h"

namespace gdn {

// Names, best first: "amx", "avx512bf16", "avx512", "avx2", "neon_bf16", "neon", "generic".
// Those compiled into this build and supported by this CPU (and OS, for AMX tiles).
std::vector<std::string> available_isas();

// The table the handlers use now. Chosen at load: GDN_JAX_ISA if set (must be available),
// else the best available ISA.
const KernelTable& current_table();
std::string selected_isa();

// Forces an ISA (tests, benchmarks). Returns false and leaves the choice unchanged if the
// name is unknown or not available here; `why` then says which and why.
bool select_isa(const std::string& name, std::string* why);

// CPU feature report for diagnostics ("avx512f avx512bf16 ...").
std::string cpu_features();

}  // namespace gdn
