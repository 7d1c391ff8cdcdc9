#!/usr/bin/env bash
# AddressSanitizer + UndefinedBehaviorSanitizer (GDN_SANITIZE=ON, -O1, UB aborts):
#   1. the C++ kernel-core tests, natively (every ISA this CPU has; the others are not built);
#   2. the same cross-compiled for aarch64 under qemu-aarch64 (skipped with GDN_SKIP_ARM=1);
#   3. the extension, sanitized, under a representative pytest subset (every op on every ISA
#      here, the bad-batch tests, the fuzz); skipped with GDN_SAN_CORE_ONLY=1 (what `make test` runs).
# The sanitized extension is never copied into gdn_jax/: the pytest run imports a shadow
# package (build/san/pkg/gdn_jax: links to the Python files + the sanitized module).
set -euo pipefail
cd "$(dirname "$0")/../.."
CMAKE=${CMAKE:-cmake}
PY=${PY:-.venv/bin/python}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1}

# The x86 units this CPU cannot run are left out (GDN_SKIP_ISAS): sanitized, they would only
# be compiled (1-2 minutes each on 2 cores), never run. dispatch.cc's feature tests, coarsely.
SKIP_ISAS=""
if [ "$(uname -m)" = x86_64 ]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
  has avx512f avx512dq avx512bw avx512vl || SKIP_ISAS="avx512;"
  has avx512f avx512dq avx512bw avx512vl avx512_bf16 || SKIP_ISAS+="avx512bf16;"
  has avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_tile amx_bf16 || SKIP_ISAS+="amx;"
  SKIP_ISAS=${SKIP_ISAS%;}
fi

# One build directory: the core library is compiled once for the core tests and the extension.
# Python only when the extension is built (CMake warns of an unused -D otherwise).
PY_ARGS=(-DGDN_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")")
[ "${GDN_SAN_CORE_ONLY:-0}" = 1 ] && PY_ARGS=(-DGDN_BUILD_PYTHON=OFF)
"$CMAKE" -S . -B build/san -G Ninja -DCMAKE_BUILD_TYPE=Release -DGDN_SANITIZE=ON -DGDN_BUILD_CORE_TESTS=ON \
    -DGDN_SKIP_ISAS="$SKIP_ISAS" "${PY_ARGS[@]}" >/dev/null
"$CMAKE" --build build/san -j 2 --target gdn_core_tests >/dev/null
echo "== core tests, ASan+UBSan, native ($(uname -m); not built here: ${SKIP_ISAS:-none})"
./build/san/gdn_core_tests | tail -n 1

if [ "${GDN_SKIP_ARM:-0}" = 1 ]; then
  echo "== aarch64: skipped (GDN_SKIP_ARM=1)"
else
  if ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null \
     || [ ! -e /usr/aarch64-linux-gnu/lib/libasan.so.8 ]; then
    echo "== installing g++-aarch64-linux-gnu, its ASan/UBSan runtimes and qemu-user"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        g++-aarch64-linux-gnu libasan8-arm64-cross libubsan1-arm64-cross qemu-user >/dev/null
  fi
  "$CMAKE" -S . -B build/core-aarch64-san -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake \
      -DGDN_BUILD_PYTHON=OFF -DGDN_BUILD_CORE_TESTS=ON -DGDN_SANITIZE=ON >/dev/null
  "$CMAKE" --build build/core-aarch64-san -j 2 >/dev/null
  # One CPU model: -cpu max has BF16, so every aarch64 ISA (neon_bf16, neon, generic) runs; the
  # dispatch fallback on a CPU without BF16 is run_core_tests.sh's (unsanitized) -cpu neoverse-n1
  # run. About 20 minutes under qemu on the 2-core dev host.
  # LeakSanitizer cannot run under qemu-user (it stops the process with ptrace and fails at exit):
  # leaks are checked by the native run above; here ASan checks addressing and UBSan the rest.
  echo "== core tests, ASan+UBSan (no leak check), aarch64 under qemu-aarch64 -cpu max"
  # ASan's shadow needs the 47-bit address space layout it expects; qemu-user gives it one.
  out=$(ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0" qemu-aarch64 -cpu max -L /usr/aarch64-linux-gnu \
        ./build/core-aarch64-san/gdn_core_tests)
  echo "$out" | grep -E "FAIL" || true
  echo "$out" | tail -n 1
  echo "$out" | tail -n 1 | grep -q ", 0 failed" || { echo "aarch64 sanitized core tests failed"; exit 1; }
fi

if [ "${GDN_SAN_CORE_ONLY:-0}" = 1 ]; then exit 0; fi

"$CMAKE" --build build/san -j 2 >/dev/null
rm -rf build/san/pkg && mkdir -p build/san/pkg/gdn_jax
for f in gdn_jax/*.py; do ln -s "$PWD/$f" build/san/pkg/gdn_jax/; done
cp build/san/_gdn_ffi*.so build/san/pkg/gdn_jax/
# libasan must be the first library of the process: Python itself is not instrumented, so it
# is preloaded. Leak checking is off for the Python process: the interpreter and jaxlib keep
# allocations alive until exit by design (thousands of reports, none ours); the core tests
# above run with it on.
# libstdc++ is preloaded too: loaded later (by jaxlib), ASan's __cxa_throw interceptor finds no
# real function and aborts at jaxlib's first C++ throw ("real___cxa_throw != 0").
LIBASAN="$("${CXX:-c++}" -print-file-name=libasan.so) $("${CXX:-c++}" -print-file-name=libstdc++.so)"
echo "== extension, ASan+UBSan: the ops on every ISA, bad batches, fuzz (LD_PRELOAD=$LIBASAN)"
cd build/san/pkg
LD_PRELOAD="$LIBASAN" ASAN_OPTIONS="$ASAN_OPTIONS:detect_leaks=0" GDN_JAX_SAN=1 \
  "$OLDPWD/$PY" -m pytest -q -p no:cacheprovider "$OLDPWD/tests/test_ops_gating.py" "$OLDPWD/tests/test_ops_conv.py" \
  "$OLDPWD/tests/test_ops_recurrent.py" "$OLDPWD/tests/test_ops_chunk.py" "$OLDPWD/tests/test_ops_slots.py" \
  "$OLDPWD/tests/test_checks.py" "$OLDPWD/tests/test_fuzz.py" "$OLDPWD/tests/test_paths.py" \
  -k "not reference and (test_ops or bad or refused or invalid or fuzz or commit)" ${GDN_SAN_PYTEST_ARGS:-}
