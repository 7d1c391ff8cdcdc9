"""The roofline of the benchmarks, measured natively in the run: memory bandwidth with the decode's
own access pattern (in-place read-modify-write), read-only and copy, each inside a jitted XLA custom
call on XLA's intra-op pool through the same fork/join as the kernels (`gdn_jax_bandwidth_probe`,
ffi/src/handlers/probe.cc); the f32 FMA peak and the bf16 dot-product peak (probe.h)."""
from __future__ import annotations

import glob
import os
import time

import jax
import jax.numpy as jnp
import numpy as np


def _cache_size(text):
    """Bytes of a sysfs cache `size` ("32768K", "2M", "512")."""
    text = text.strip()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KkMmGg")) * mult


def llc_bytes(default=32 << 20, sysfs="/sys/devices/system/cpu"):
    """Bytes of last-level cache that this process's threads can fill: for each CPU it may run on,
    the highest data or unified cache level in sysfs, summed over the distinct instances (an L3
    per CCX on AMD, per socket on Intel). `default` where sysfs does not say."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    instances = {}
    for cpu in cpus:
        top = None
        for d in glob.glob(f"{sysfs}/cpu{cpu}/cache/index*"):
            try:
                with open(f"{d}/type") as f:
                    if f.read().strip() == "Instruction":
                        continue
                with open(f"{d}/level") as f:
                    level = int(f.read())
                with open(f"{d}/size") as f:
                    size = _cache_size(f.read())
                with open(f"{d}/shared_cpu_list") as f:
                    shared = f.read().strip()
            except (OSError, ValueError):
                continue
            if top is None or level > top[0]:
                top = (level, shared, size)
        if top:
            instances[top[:2]] = top[2]
    return sum(instances.values()) or default


def mem_available_bytes(meminfo="/proc/meminfo"):
    """MemAvailable in bytes, None where /proc/meminfo does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def cold_bytes(llc, available, factor=4):
    """Bytes of a cold pool: `factor` x the LLC (issue #20: cold-state pools 4x, the bandwidth probe's
    buffer 8x), capped by memory: a layer case holds about a dozen pool-sized buffers at once (its
    pools, their donated copies, the jnp baseline's), and a VM may report its host's whole L3 (480 MiB
    on a 2-vCPU Xeon, where 4x per pool ran a 24 GiB machine out of memory). The cap is factor / 96 of
    the memory available, at least 64 MiB per unit of factor; the reports give the sizes used."""
    want = factor * llc
    if available is None:
        return want
    return min(want, max(factor * (64 << 20), available * factor // 96))


LLC_BYTES = llc_bytes()
MEM_AVAILABLE = mem_available_bytes()
COLD_BYTES = cold_bytes(LLC_BYTES, MEM_AVAILABLE, 4)   # cold state pools
PROBE_BYTES = cold_bytes(LLC_BYTES, MEM_AVAILABLE, 8)  # the bandwidth probe's buffer
PIECE = 16384  # floats per work item of the probe (64 KiB, one f32 state head)

# mode of the probe, and the bytes a call moves per byte of its buffer (read + written). spec:
# the spec verify's pattern, in groups of SPEC_GROUP pieces (the first read and written back in
# place, the others written with non-temporal stores): 1 + SPEC_GROUP bytes per SPEC_GROUP.
SPEC_GROUP = 4
BANDWIDTH_MODES = {"rmw": (0, 2), "read": (1, 1), "copy": (2, 2), "spec": (3, (1 + SPEC_GROUP) / SPEC_GROUP)}


def _probe_call(mode):
    from gdn_jax import _ffi  # noqa: F401  (registers the targets)

    def f(src, dst):
        return jax.ffi.ffi_call(
            "gdn_jax_bandwidth_probe",
            (jax.ShapeDtypeStruct(dst.shape, jnp.float32), jax.ShapeDtypeStruct((1,), jnp.float32)),
            input_output_aliases={1: 0})(src, dst, mode=np.int32(mode))

    return jax.jit(f, donate_argnums=1)


def bandwidth_gbs(kind, nbytes=PROBE_BYTES, reps=7):
    """GB/s (bytes read + written) of the fastest of `reps` probe calls (a ceiling: no call can beat
    the machine, and on a shared host the slower ones are others' load) of `kind` (rmw, read, copy, spec)
    over a buffer of nbytes (default 8x the LLC within the memory cap, PROBE_BYTES, so no pass finds its
    data in cache), after two untimed calls that fault the pages in. A copy's stores count once: its read-for-ownership is not counted,
    as no kernel's bytes count one."""
    mode, per_byte = BANDWIDTH_MODES[kind]
    unit = PIECE * (SPEC_GROUP if kind == "spec" else 1)
    n = max(unit, nbytes // 4 // unit * unit)
    fn = _probe_call(mode)
    # Made like the state pools (gdn_jax.zeros_pool: huge pages where the pools get them), so the
    # probe and the kernels it bounds run on the same page size.
    from gdn_jax import zeros_pool

    dst = zeros_pool((n,), jnp.float32)
    src = zeros_pool((n,), jnp.float32) if kind == "copy" else jnp.ones((PIECE,), jnp.float32)
    ts = []
    for i in range(reps + 2):
        t0 = time.perf_counter()
        dst, s = fn(src, dst)
        jax.block_until_ready((dst, s))
        if i >= 2:
            ts.append(time.perf_counter() - t0)
    if not np.isfinite(float(s[0])):
        raise RuntimeError(f"bandwidth probe {kind}: non-finite checksum")
    return per_byte * n * 4 / min(ts) / 1e9


def bandwidths():
    """The bandwidths of one measurement (each of BANDWIDTH_MODES), GB/s."""
    return {k: bandwidth_gbs(k) for k in BANDWIDTH_MODES}


def core_round_trip_ns():
    """Median ns of a cache line's round trip between threads pinned to the first two CPUs of this
    process's affinity mask; None with fewer than two CPUs or a module without the probe. On a VM it
    tells where the two vCPUs sit: on the Zen 4 of ffi/README.md (Limits) 50-64 ns on one CCX and
    323-377 ns across CCDs, where each thread also has a memory path of its own and the bandwidth
    probes read about twice as much."""
    from gdn_jax import _ffi

    probe = getattr(_ffi._gdn_ffi, "core_round_trip_ns", None)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if probe is None or len(cpus) < 2:
        return None
    return probe(cpus[0], cpus[1])


def fma_peak_gflops(threads):
    from gdn_jax import _ffi

    return max(_ffi._gdn_ffi.fma_peak_gflops(threads, 0.3) for _ in range(3))


# ISAs whose kernels have a bf16 dot-product instruction, and the one their probe times.
NATIVE_BF16_DOT = {"avx512bf16": "AVX512-BF16 vdpbf16ps", "amx": "AMX-BF16 tdpbf16ps",
                   "amx_model": "AMX-BF16 (software model)", "neon_bf16": "NEON BFMMLA"}


def bf16_dot_peak(isa, threads, f32_peak):
    """The bf16 dot-product peak of the selected ISA: measured by the module's bf16 probe when it has
    one; on an ISA without a bf16 dot instruction, bf16 operands are widened to f32 and go through
    the f32 FMAs, so the bf16 peak *is* the f32 FMA peak (said so, not invented)."""
    from gdn_jax import _ffi

    probe = getattr(_ffi._gdn_ffi, "bf16_dot_peak_gflops", None)  # None: a build without it
    first = probe(threads, 0.3) if probe is not None else None       # None: no bf16 dot instruction
    if first is not None:
        peak = max([first] + [probe(threads, 0.3) for _ in range(2)])
        return peak, f"measured: bf16 dot probe of the {isa} kernels ({NATIVE_BF16_DOT[isa]}), {threads} threads"
    if isa in NATIVE_BF16_DOT:
        return None, (f"not measured: {isa} has {NATIVE_BF16_DOT[isa]} but this build of the native module has "
                      f"no bf16 probe; prefill fractions use the f32 FMA peak")
    return f32_peak, (f"= f32 FMA peak: {isa} has no bf16 dot-product instruction (no AVX512-BF16/AMX), "
                      f"bf16 operands are converted to f32 and use the same FMAs")
