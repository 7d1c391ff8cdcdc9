# The two commands of the README:
#   make demo   set everything up (venv, deps, extension) and run the serving-loop demo
#   make test   set everything up and run the whole test suite
# Everything else here is a step of those two.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
BUILD  ?= build/dev
JOBS   ?= 2
# What a fresh venv gets; e.g. JAX_REQ="jax==0.5.3 jaxlib==0.5.3" VENV=.venv-jax053 BUILD=build/jax053
# tests the bottom of the supported range (README.md).
JAX_REQ ?= "jax>=0.5.3,<0.12" "jaxlib>=0.5.3,<0.12"
# Test-only: hypothesis; safetensors (cross-checks our checkpoint reader); transformers with
# the CPU build of torch to build reference models (2.13.0 is the CPU wheel this machine kind
# serves; a plain "torch" would pull a CUDA build of several GB).
TEST_REQ ?= "safetensors>=0.4" "hypothesis>=6.100" "transformers>=5.2,<6" "torch==2.13.0"

.PHONY: demo test test-core test-sanitize build venv bench bench-quick clean

venv: $(VENV)/.deps-stamp
$(VENV)/.deps-stamp: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(JAX_REQ) "numpy>=1.26" \
	    "nanobind>=2.4" "scikit-build-core>=0.10" "pytest>=8" ninja cmake $(TEST_REQ)
	@touch $@

# In-tree build: the extension lands in gdn_jax/ so `import gdn_jax` works from the
# checkout (tests, examples, benchmarks). `pip install .` builds the same thing as a wheel.
# The same build directory holds the C++ core tests (built only by test-core): the kernel
# library is compiled once for both, and the A/B driver's smoke build (benchmarks/kernel_ab.py's
# gdn_kernel_ab with this tree as its own base, the portable unit twice).
build: venv
	$(VENV)/bin/cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release -DGDN_BUILD_CORE_TESTS=ON \
	    -DGDN_AB_BASE=$(CURDIR) -DGDN_AB_ISA=generic -DPython_EXECUTABLE=$(abspath $(PY)) >/dev/null
	$(VENV)/bin/cmake --build $(BUILD) -j $(JOBS) --target _gdn_ffi
	cp $(BUILD)/_gdn_ffi*.so gdn_jax/

demo: build
	PYTHONPATH=. $(PY) examples/serving_loop.py

test: build test-core
	PYTHONPATH=. $(PY) -m pytest -q tests

# The C++ kernel-core tests alone: native + aarch64 under qemu, then natively under
# AddressSanitizer + UndefinedBehaviorSanitizer (the sanitized aarch64 build and the sanitized
# extension are `make test-sanitize`: too long for every CI run on 2 cores).
test-core: build
	$(VENV)/bin/cmake --build $(BUILD) -j $(JOBS) --target gdn_core_tests gdn_recurrent_kernel_bench gdn_conv_kernel_bench \
	    gdn_kernel_ab
	CMAKE=$(abspath $(VENV)/bin/cmake) CORE_BUILD=$(BUILD) tests/cpp/run_core_tests.sh
	CMAKE=$(abspath $(VENV)/bin/cmake) PY=$(PY) GDN_SAN_CORE_ONLY=1 GDN_SKIP_ARM=1 tests/cpp/run_sanitize.sh

# The sanitized core tests, then the extension built with ASan+UBSan under a pytest subset
# (every op on every ISA here, the bad-batch tests, the fuzz): docs/reliability.md.
test-sanitize: venv
	CMAKE=$(abspath $(VENV)/bin/cmake) PY=$(PY) tests/cpp/run_sanitize.sh

# Everything, written to benchmarks/RESULTS.md + benchmarks/plots/ (PNG) + benchmarks/out/results.json. With
# vLLM beside it: make bench VLLM_PYTHON=/path/to/vllm-venv/bin/python (or GDN_VLLM_PYTHON=...).
# matplotlib is the optional `bench` extra of pyproject.toml (plots only).
VLLM_PYTHON ?=
BENCH_ARGS  ?=
bench: build
	$(PY) -m pip install -q "matplotlib>=3.7" || echo "matplotlib not installed: the run writes no plots"
	PYTHONPATH=. $(PY) benchmarks/run.py $(if $(VLLM_PYTHON),--vllm-python $(VLLM_PYTHON)) $(BENCH_ARGS)

bench-quick: build
	PYTHONPATH=. $(PY) benchmarks/run.py --quick $(BENCH_ARGS)

clean:
	rm -rf build gdn_jax/_gdn_ffi*.so
