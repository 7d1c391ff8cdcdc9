// CPU feature detection and the choice of kernel table. Each ISA is selected only when the
// CPU has every feature its translation unit was compiled for (vLLM gated an AVX512-BF16
// kernel on "has AMX"; we never gate coarser than the flags we compile with). AMX also needs
// the OS (tile state in XCR0) and Linux's per-process permission for tile data, requested
// once here; when refused, "amx" is unavailable and the reason is reported.
#include "gdn/dispatch.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#define GDN_X86 1
#elif defined(__aarch64__)
#include <sys/auxv.h>
#define GDN_ARM 1
#endif

namespace gdn {
namespace generic { void fill_table(KernelTable&); }
#if GDN_X86
namespace avx2 { void fill_table(KernelTable&); }
namespace avx512 { void fill_table(KernelTable&); }
namespace avx512bf16 { void fill_table(KernelTable&); }
namespace amx { void fill_table(KernelTable&); }
namespace amx_model { void fill_table(KernelTable&); }
#endif
#if GDN_ARM
namespace neon { void fill_table(KernelTable&); }
namespace neon_bf16 { void fill_table(KernelTable&); }
#endif

namespace {

struct Features {
  bool avx2 = false;        // AVX2 + FMA + F16C, with OS ymm state
  bool avx512 = false;      // F, DQ, BW, VL + FMA, AVX2, F16C, with OS zmm state
  bool avx512bf16 = false;  // the above + AVX512_BF16
  bool amx_tile = false, amx_bf16 = false;
  bool amx = false;     // amx_tile + amx_bf16 + avx512bf16, OS tile state, permission granted
  std::string amx_why;  // why "amx" is unavailable (empty when available)
  bool neon = false, neon_bf16 = false;
  std::string names;
};

#if GDN_X86
uint64_t xgetbv0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (uint64_t(edx) << 32) | eax;
}
#endif

Features detect() {
  Features f;
#if GDN_X86
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), f16c = c & (1u << 29);
  if (!osxsave) return f;
  const uint64_t xcr0 = xgetbv0();
  const bool os_avx = (xcr0 & 0x6) == 0x6;
  const bool os_zmm = os_avx && (xcr0 & 0xe0) == 0xe0;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5), a512f = b & (1u << 16), dq = b & (1u << 17),
             bw = b & (1u << 30), vl = b & (1u << 31);
  const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);
  unsigned a1, b1, c1, d1;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  const bool bf16 = a1 & (1u << 5);
  f.avx2 = os_avx && fma && f16c && avx2;
  f.avx512 = os_zmm && fma && f16c && avx2 && a512f && dq && bw && vl;
  f.avx512bf16 = f.avx512 && bf16;
  f.amx_tile = amx_tile;
  f.amx_bf16 = amx_bf16;
  auto add = [&](bool on, const char* n) { if (on) { if (!f.names.empty()) f.names += ' '; f.names += n; } };
  add(fma, "fma"); add(avx2, "avx2"); add(os_zmm && a512f, "avx512f"); add(os_zmm && dq, "avx512dq");
  add(os_zmm && bw, "avx512bw"); add(os_zmm && vl, "avx512vl"); add(os_zmm && bf16, "avx512bf16");
  add(amx_tile, "amx_tile"); add(amx_bf16, "amx_bf16");
  const bool os_amx = os_avx && (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  const bool cpu_amx = amx_tile && amx_bf16 && f.avx512bf16;
  // Ask Linux only when the CPU and OS could run tiles at all.
  const AmxDecision amx = decide_amx(cpu_amx, os_amx, cpu_amx && os_amx ? request_amx_permission() : -1);
  f.amx = amx.available;
  f.amx_why = amx.why;
  add(!amx.token.empty(), amx.token.c_str());
#elif GDN_ARM
  const unsigned long hwcap = getauxval(AT_HWCAP), hwcap2 = getauxval(AT_HWCAP2);
  f.neon = hwcap & (1ul << 1);               // HWCAP_ASIMD
  f.neon_bf16 = f.neon && (hwcap2 & (1ul << 14));  // HWCAP2_BF16
  f.names = f.neon ? (f.neon_bf16 ? "asimd bf16" : "asimd") : "";
#endif
  return f;
}

}  // namespace

int request_amx_permission() {
#if GDN_X86
  // ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18 (<asm/prctl.h>; Linux >= 5.16).
  // Process-wide and idempotent; the first tile instruction without it kills the process.
  if (syscall(SYS_arch_prctl, 0x1023, 18) == 0) return 0;
  return errno != 0 ? errno : -1;
#else
  return -1;
#endif
}

AmxDecision decide_amx(bool cpu_has, bool os_has, int permission) {
  AmxDecision d;
  if (!cpu_has) {
    d.why = "this CPU lacks a feature it needs (AMX-TILE, AMX-BF16 and the AVX512-BF16 set)";
  } else if (!os_has) {
    d.token = "amx_os_disabled";
    d.why = "the CPU has AMX but the OS does not enable tile state (XCR0 bits 17, 18)";
  } else if (permission != 0) {
    d.token = "amx_permission_denied";
    d.why = "the CPU has AMX but Linux refused tile data permission: arch_prctl(ARCH_REQ_XCOMP_PERM, "
            "XFEATURE_XTILEDATA) failed with errno " + std::to_string(permission);
    if (permission > 0) d.why += std::string(" (") + std::strerror(permission) + ")";
  } else {
    d.available = true;
  }
  return d;
}

namespace {

const Features& features() {
  static const Features f = detect();
  return f;
}

struct Entry {
  const char* name;
  void (*fill)(KernelTable&);
  bool (*available)();
};

const Entry kEntries[] = {
#if GDN_X86
// GDN_SKIP_*: units a test build leaves out (CMakeLists.txt, GDN_SKIP_ISAS).
#if !GDN_SKIP_AMX
    {"amx", amx::fill_table, [] { return features().amx; }},
#endif
#if !GDN_SKIP_AVX512BF16
    {"avx512bf16", avx512bf16::fill_table, [] { return features().avx512bf16; }},
#endif
#if !GDN_SKIP_AVX512
    {"avx512", avx512::fill_table, [] { return features().avx512; }},
#endif
    {"avx2", avx2::fill_table, [] { return features().avx2; }},
#endif
#if GDN_ARM
    {"neon_bf16", neon_bf16::fill_table, [] { return features().neon_bf16; }},
    {"neon", neon::fill_table, [] { return features().neon; }},
#endif
    {"generic", generic::fill_table, [] { return true; }},
#if GDN_X86
    // A test ISA after generic, so never the automatic choice: the AMX kernel code on the
    // software tile model (isa/amx_model.cc), on every x86 CPU.
    {"amx_model", amx_model::fill_table, [] { return true; }},
#endif
};

const char* const kKnown[] = {"amx", "avx512bf16", "avx512", "avx2", "neon_bf16", "neon", "generic", "amx_model"};

KernelTable g_tables[sizeof(kEntries) / sizeof(kEntries[0])];
std::atomic<const KernelTable*> g_current{nullptr};
std::once_flag g_init;

void init_tables() {
  // Only the ISAs this CPU runs: fill_table is compiled with its ISA's flags, and the compiler
  // may use them for the table's own stores (GCC 12 did: AVX-512 moves in amx::fill_table).
  for (size_t i = 0; i < sizeof(kEntries) / sizeof(kEntries[0]); ++i) {
    if (kEntries[i].available()) kEntries[i].fill(g_tables[i]);
    g_tables[i].isa = kEntries[i].name;
  }
  const char* forced = std::getenv("GDN_JAX_ISA");
  if (forced != nullptr && *forced != '\0') {
    // The Python side checks GDN_JAX_ISA first and raises a clear error; here we only
    // honour a valid request (a bad one falls through to the best ISA).
    for (size_t i = 0; i < sizeof(kEntries) / sizeof(kEntries[0]); ++i)
      if (std::string(forced) == kEntries[i].name && kEntries[i].available()) {
        g_current.store(&g_tables[i]);
        return;
      }
  }
  for (size_t i = 0; i < sizeof(kEntries) / sizeof(kEntries[0]); ++i)
    if (kEntries[i].available()) {
      g_current.store(&g_tables[i]);
      return;
    }
}

}  // namespace

std::vector<std::string> available_isas() {
  std::call_once(g_init, init_tables);
  std::vector<std::string> out;
  for (const Entry& e : kEntries)
    if (e.available()) out.emplace_back(e.name);
  return out;
}

const KernelTable& current_table() {
  std::call_once(g_init, init_tables);
  return *g_current.load(std::memory_order_acquire);
}

std::string selected_isa() { return current_table().isa; }

bool select_isa(const std::string& name, std::string* why) {
  std::call_once(g_init, init_tables);
  for (size_t i = 0; i < sizeof(kEntries) / sizeof(kEntries[0]); ++i) {
    if (name != kEntries[i].name) continue;
    if (!kEntries[i].available()) {
      if (why) {
        const std::string reason = name == "amx" ? features().amx_why : "this CPU lacks a feature it needs";
        *why = "ISA '" + name + "' is compiled in but " + reason + " (CPU has: " + features().names + ")";
      }
      return false;
    }
    g_current.store(&g_tables[i], std::memory_order_release);
    return true;
  }
  bool known = false;
  for (const char* k : kKnown) known |= name == k;
  if (why)
    *why = known ? "ISA '" + name + "' is not built for this architecture or not implemented in this build"
                 : "unknown ISA '" + name + "'; known: amx, avx512bf16, avx512, avx2, neon_bf16, neon, generic, amx_model";
  return false;
}

static std::atomic<int> g_chunk_size{0};

bool force_chunk_size(int size) {
  if (size != 0 && size != 32 && size != 64) return false;
  g_chunk_size.store(size, std::memory_order_relaxed);
  return true;
}

int forced_chunk_size() { return g_chunk_size.load(std::memory_order_relaxed); }

std::string cpu_features() { return features().names; }

}  // namespace gdn
