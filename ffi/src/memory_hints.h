// Page-backing hints for the kernels' large outputs. No XLA dependency (the core tests use it).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace gdn {

constexpr uintptr_t kHugePage = uintptr_t(2) << 20;

// The whole 2 MiB pages inside [p, p + bytes), as [*begin, *end); empty (begin == end) below
// two huge pages, where the hint is not worth a system call.
inline void huge_page_range(const void* p, size_t bytes, uintptr_t* begin, uintptr_t* end) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p), hi = lo + bytes;
  uintptr_t a = (lo + kHugePage - 1) & ~(kHugePage - 1), e = hi & ~(kHugePage - 1);
  if (bytes < 2 * kHugePage || e <= a) a = e = lo;
  *begin = a;
  *end = e;
}

// Asks Linux to back the whole 2 MiB pages inside a large output with transparent huge pages
// before a kernel first writes it. XLA's CPU runtime allocates large outputs and temporaries
// fresh per call (glibc serves them with mmap), so every call faults in new 4 KiB pages: at
// T = 8192 a conv output is 128 MiB, 32 Ki faults, about half of the op's time on the dev
// host. With THP in "madvise" mode (a common default) this cuts the faults 512-fold; where THP
// is off, or the pages are present already, it changes nothing. Contents are never touched.
// Returns whether the hint was given and accepted.
inline bool advise_huge_pages(void* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  uintptr_t a, e;
  huge_page_range(p, bytes, &a, &e);
  return e > a && madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE) == 0;
#else
  (void)p;
  (void)bytes;
  return false;
#endif
}

// The largest CPU cache of cpu0 in bytes (the last level), from Linux's sysfs; 32 MiB where it
// cannot be read. Read once.
inline uint64_t last_level_cache_bytes() {
  static const uint64_t bytes = [] {
    uint64_t best = 0;
    int best_level = -1;
    for (int i = 0; i < 16; ++i) {
      char path[96];
      int level = 0;
      unsigned long long size = 0;
      char unit = 0;
      std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/level", i);
      FILE* f = std::fopen(path, "r");
      if (!f) continue;
      const bool got_level = std::fscanf(f, "%d", &level) == 1;
      std::fclose(f);
      std::snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu0/cache/index%d/size", i);
      f = std::fopen(path, "r");
      if (!f) continue;
      const int got = std::fscanf(f, "%llu%c", &size, &unit);
      std::fclose(f);
      if (!got_level || got < 1) continue;
      const uint64_t b = size << (unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0);
      if (level > best_level || (level == best_level && b > best)) best_level = level, best = b;
    }
    return best > 0 ? best : uint64_t(32) << 20;
  }();
  return bytes;
}

}  // namespace gdn
