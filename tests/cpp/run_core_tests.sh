#!/usr/bin/env bash
# The C++ kernel-core tests: natively (every ISA this CPU has), then cross-compiled for
# aarch64 and run under qemu-aarch64 with a BF16 CPU model (neon_bf16, neon, generic) and
# with one lacking BF16 (neon, generic). Installs the cross compiler and qemu-user if missing.
# CORE_BUILD: a build directory where gdn_core_tests, the two kernel benchmarks and the A/B
# driver are built already (`make test-core` passes the extension's, which shares the kernel
# library); without it the native tests are configured and built in build/core.
set -euo pipefail
cd "$(dirname "$0")/../.."
CMAKE=${CMAKE:-cmake}
CORE_BUILD=${CORE_BUILD:-}
if [ -z "$CORE_BUILD" ]; then
  CORE_BUILD=build/core
  "$CMAKE" -S . -B "$CORE_BUILD" -G Ninja -DGDN_BUILD_PYTHON=OFF -DGDN_BUILD_CORE_TESTS=ON \
    -DGDN_AB_BASE="$PWD" -DGDN_AB_ISA=generic >/dev/null
  "$CMAKE" --build "$CORE_BUILD" -j 2 >/dev/null
fi
echo "== native ($(uname -m))"
"$CORE_BUILD/gdn_core_tests" | tail -n 1
# The kernel benchmarks built beside them must run (benchmarks/README.md); 3 calls, not timed.
"$CORE_BUILD/gdn_recurrent_kernel_bench" --batch 2 --tokens 2 --calls 3 >/dev/null
"$CORE_BUILD/gdn_recurrent_kernel_bench" --batch 2 --pool-mib 1 --calls 3 >/dev/null
"$CORE_BUILD/gdn_conv_kernel_bench" --tokens 5 --batch 3 --dim 40 --calls 3 >/dev/null
"$CORE_BUILD/gdn_conv_kernel_bench" --act f32 --tokens 5 --batch 3 --dim 40 --calls 3 --pool-mib 1 >/dev/null
"$CORE_BUILD/gdn_conv_kernel_bench" --tokens 5 --batch 3 --dim 40 --calls 3 --threads 2 --helpers sleep >/dev/null
if [ "$(nproc)" -ge 2 ]; then  # pins two CPUs
  "$CORE_BUILD/gdn_recurrent_kernel_bench" --batch 2 --pool-mib 1 --tag-seconds 0.05 >/dev/null
fi
# The A/B driver (benchmarks/kernel_ab.py) with this tree as its own base: every case must write
# the same bits in both builds (the comparison can fail: --expect-same-bits exits 1).
"$CORE_BUILD/gdn_kernel_ab" --cases all --tokens 70 --batch 2 --pool-mib 8 --rounds 2 --round-ms 1 --expect-same-bits 1 >/dev/null

if [ "${GDN_SKIP_ARM:-0}" = 1 ]; then echo "== aarch64: skipped (GDN_SKIP_ARM=1)"; exit 0; fi
if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  echo "== installing g++-aarch64-linux-gnu and qemu-user"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
      g++-aarch64-linux-gnu qemu-user >/dev/null
fi
"$CMAKE" -S . -B build/core-aarch64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
    -DGDN_BUILD_PYTHON=OFF -DGDN_BUILD_CORE_TESTS=ON >/dev/null
"$CMAKE" --build build/core-aarch64 -j 2 >/dev/null
# -cpu max has BF16: every aarch64 ISA's kernels run. -cpu neoverse-n1 has none: the dispatch must
# fall back (its ISA line is checked); its neon and generic kernels are the instructions the max
# run has just tested, so they are not run again (GDN_CORE_TEST_ISAS=none; about 90 s saved).
for cpu in max neoverse-n1; do
  echo "== aarch64 under qemu-aarch64 -cpu $cpu"
  only=""; want="ISAs: neon_bf16 neon generic; selected: neon_bf16"
  if [ "$cpu" = neoverse-n1 ]; then only="none"; want="ISAs: neon generic; selected: neon"; fi
  out=$(env ${only:+GDN_CORE_TEST_ISAS=$only} qemu-aarch64 -cpu "$cpu" -L /usr/aarch64-linux-gnu \
        ./build/core-aarch64/gdn_core_tests)
  echo "$out" | sed -n 1,2p  # sed reads to the end: head could exit first and SIGPIPE the echo (pipefail)
  echo "$out" | grep -E "FAIL" || true
  echo "$out" | tail -n 1
  # grep without -q reads to the end: -q exits at the match and could SIGPIPE the echo (pipefail).
  echo "$out" | grep -x "$want" >/dev/null || { echo "aarch64 ($cpu): expected \"$want\""; exit 1; }
  echo "$out" | tail -n 1 | grep -q ", 0 failed" || { echo "aarch64 ($cpu) core tests failed"; exit 1; }
done
